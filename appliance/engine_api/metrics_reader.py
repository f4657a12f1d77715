"""The one reader of vLLM's ``/metrics``: bounded, filtered, sync and async, one typed error.

Every caller that reads the engine's speculative-decoding counters (the telemetry agent,
:class:`~appliance.engine_api.vllm_client.VLLMClient`) goes through :func:`read` / :func:`aread`. A
read is bounded as a whole by ``timeout``: connect, headers and the body (a server that trickles its
page is cut off by an overall deadline, not only per gap between bytes). Every failure is one
:class:`MetricsReadError` whose ``kind`` says what went wrong: ``timeout``, ``unreachable``,
``status`` or ``parse``. Callers map the kinds to their own reporting (the agent counts them, the
client raises ``EngineError`` / ``NotVLLMError``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlencode, urlsplit

import httpx

from ..errors import AuthError, EngineError, NotVLLMError
from . import specdecode

Kind = Literal["timeout", "unreachable", "status", "parse"]

GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"

# The speculative series plus two whole-server counters the agent uses to prove a window held
# only its own call: output tokens generated and requests finished (any reason, abort included).
PARAMS = (
    *specdecode.SNAPSHOT_PARAMS,
    ("name[]", GENERATION_TOKENS + "_total"),
    ("name[]", REQUEST_SUCCESS + "_total"),
)


class MetricsReadError(Exception):
    """A ``/metrics`` read failed; ``kind`` is timeout, unreachable, status or parse."""

    def __init__(self, kind: Kind, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.status_code = status_code


@dataclass(frozen=True)
class Reading:
    """One read of ``/metrics``: the speculative counters and the server's work counters.

    ``generation_tokens`` and ``finished_requests`` are sums over engines and models (``None``
    when the page has no such series); ``at`` is ``time.monotonic()`` when the body was complete.
    """

    snapshot: specdecode.Snapshot
    generation_tokens: float | None = None
    finished_requests: float | None = None
    at: float = 0.0


def parse(status: int, body: bytes, url: str = "/metrics") -> Reading:
    """A :class:`Reading` from one response; :class:`MetricsReadError` when it is not one."""
    if status != 200:
        raise MetricsReadError("status", f"{url} answered {status}", status_code=status)
    text = body.decode("utf-8", errors="replace")
    try:
        snap, (tokens, finished) = specdecode.parse_seen(text, _TOTALS) or specdecode.parse_with(
            text, _TOTALS
        )
    except specdecode.MetricsParseError as exc:
        raise MetricsReadError("parse", str(exc)) from None
    return Reading(snap, tokens, finished, time.monotonic())


# The work counters' samples, summed over every label set in the same pass as the snapshot.
_TOTALS = (GENERATION_TOKENS + "_total", REQUEST_SUCCESS + "_total")


def read_text(
    url: str, *, timeout: float, client: httpx.Client | None = None, params=None
) -> tuple[int, bytes]:
    """GET ``url`` within ``timeout`` overall; the status and body (no status check)."""
    own = client is None
    http = client or httpx.Client()
    deadline = time.monotonic() + timeout
    try:
        with http.stream("GET", url, params=params, timeout=timeout) as resp:
            body = bytearray()
            # httpx's read timeout bounds each gap between bytes: a trickling server must still
            # not hold the caller past the overall deadline.
            for part in resp.iter_bytes():
                body += part
                if time.monotonic() > deadline:
                    raise MetricsReadError("timeout", f"{url} took longer than {timeout} s")
            return resp.status_code, bytes(body)
    except httpx.TimeoutException as exc:
        raise MetricsReadError("timeout", f"{url} timed out after {timeout} s") from exc
    except httpx.HTTPError as exc:
        raise MetricsReadError("unreachable", f"cannot reach {url}: {exc}") from exc
    finally:
        if own:
            http.close()


def read(url: str, *, timeout: float, client: httpx.Client | None = None) -> Reading:
    """One filtered, bounded read of the speculative series at ``url`` (``.../metrics/``)."""
    status, body = read_text(url, timeout=timeout, client=client, params=PARAMS)
    return parse(status, body, url)


async def aread(url: str, *, timeout: float, client: httpx.AsyncClient | None = None) -> Reading:
    """The async twin of :func:`read` (same bound, same errors)."""
    own = client is None
    http = client or httpx.AsyncClient()
    try:
        # wait_for is the overall deadline; httpx's own timeout bounds connect and each read.
        resp = await asyncio.wait_for(http.get(url, params=PARAMS, timeout=timeout), timeout)
        return parse(resp.status_code, resp.content, url)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise MetricsReadError("timeout", f"{url} timed out after {timeout} s") from exc
    except httpx.HTTPError as exc:
        raise MetricsReadError("unreachable", f"cannot reach {url}: {exc}") from exc
    finally:
        if own:
            await http.aclose()


class KeptReader:
    """Filtered reads of ``url`` on one kept-alive connection (the telemetry agent reads the
    same page once per call: a fresh connection each time would cost a handshake and a
    server-side accept). Only one read at a time: :meth:`read` returns ``None`` while another
    is outstanding and the caller reads the usual way instead.

    The request is one fixed set of bytes, and the answer is read by :class:`_Answer`, a
    minimal HTTP/1.1 response reader (status line, the three headers that frame a body, a body
    by ``Content-Length``, chunks or the connection's close): ``http.client`` parsed every
    answer's headers through the ``email`` package, and with its request building it was half
    of the agent's background CPU per call (issue 56 §2). Anything it does not understand is a
    failed read (``unreachable``), never a guess.
    """

    IDLE_S = 2.0  # reuse a connection idle for less than this (vLLM's keep-alive is 5 s)

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        target = (parts.path or "/") + "?" + urlencode(PARAMS)
        netloc = parts.netloc.rpartition("@")[2] or self._host  # as the URL names the server
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {netloc}\r\nAccept-Encoding: identity\r\n"
            "Accept: text/plain\r\n\r\n"
        ).encode("ascii")
        self.url = url
        self._sock: socket.socket | None = None
        self._busy = False
        self._idle_since = 0.0
        self._lock = threading.Lock()

    def read(self, timeout: float) -> Reading | None:
        """Send and receive at once, on this thread (on a fresh connection when the kept one is
        idle too long, or once more on a fresh one when the kept one turns out closed);
        ``None`` when a read is outstanding on the connection (read another way)."""
        with self._lock:
            if self._busy:
                return None
            self._busy = True
            if self._sock is not None and time.monotonic() - self._idle_since > self.IDLE_S:
                self._sock.close()
                self._sock = None
            reused = self._sock is not None
        try:
            return self._send_and_answer(timeout)
        except MetricsReadError as exc:
            if not reused or exc.kind != "unreachable":
                raise
        with self._lock:  # the server closed the kept connection: _drop freed it, take it back
            if self._busy:
                return None
            self._busy = True
        return self._send_and_answer(timeout)

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client does
            if self._https:
                import ssl

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            sock.close()
            raise
        return sock

    def _send_and_answer(self, timeout: float) -> Reading:
        deadline = time.monotonic() + timeout
        try:
            try:
                if self._sock is None:
                    self._sock = self._connect(timeout)
                elif self._sock.gettimeout() != timeout:  # settimeout is a syscall each time
                    self._sock.settimeout(timeout)
                self._sock.sendall(self._request)
                answer = _Answer(self._sock, deadline)
            except TimeoutError as exc:
                raise MetricsReadError(
                    "timeout", f"{self.url} timed out after {timeout} s"
                ) from exc
            except _Late:
                raise MetricsReadError(
                    "timeout", f"{self.url} took longer than {timeout} s"
                ) from None
            except OSError as exc:
                raise MetricsReadError("unreachable", f"cannot reach {self.url}: {exc}") from exc
            except _BadAnswer as exc:
                raise MetricsReadError("unreachable", f"{self.url}: {exc}") from None
            reading = parse(answer.status, answer.body, self.url)
        except BaseException:  # a failed or interrupted read leaves no half-read connection
            self._drop()
            raise
        with self._lock:
            if answer.will_close:
                self._sock.close()
                self._sock = None
            self._busy = False
            self._idle_since = time.monotonic()
        return reading

    def _drop(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
            self._sock, self._busy = None, False


class _BadAnswer(Exception):
    """An answer that is not HTTP/1.x as :class:`_Answer` reads it."""


class _Answer:
    """One HTTP/1.x response read from ``sock`` by ``deadline`` (monotonic): ``status``,
    ``body`` and ``will_close`` (the connection cannot carry another request). Reads only what
    frames the body: ``Content-Length``, ``Transfer-Encoding: chunked`` (else the body ends
    when the server closes) and ``Connection``; interim 1xx answers are skipped. Every socket
    read is bounded by the socket's timeout, the whole by ``deadline`` (:class:`_Late` past
    it)."""

    MAX_HEAD = 65536

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline
        self._buf = bytearray()
        while True:
            head = self._head()
            self.status, length, chunked, self.will_close = _framing(head)
            if not 100 <= self.status < 200:
                break
        if self.status in (204, 304):
            self.body = b""
        elif chunked:
            self.body = self._chunked()
        elif length is not None:
            self.body = self._exactly(length)
        else:
            self.body = self._to_close()
            self.will_close = True
        if self._buf:  # bytes past the answer: the connection's next answer is out of step
            self.will_close = True

    def _fill(self) -> bool:
        """One more read into the buffer; False when the server closed the connection."""
        if time.monotonic() > self._deadline:
            raise _Late
        chunk = self._sock.recv(65536)
        self._buf += chunk
        return bool(chunk)

    def _need(self, n: int) -> None:
        while len(self._buf) < n:
            if not self._fill():
                raise _BadAnswer("the connection closed inside an answer")

    def _line(self) -> bytes:
        return self._until(b"\r\n", "a line", "inside an answer")

    def _head(self) -> bytes:
        return self._until(b"\r\n\r\n", "a header", "before an answer")

    def _until(self, end: bytes, what: str, where: str) -> bytes:
        """The buffered bytes up to ``end`` (taken from the buffer with it), read as needed."""
        while (i := self._buf.find(end)) < 0:
            if len(self._buf) > self.MAX_HEAD:
                raise _BadAnswer(f"{what} longer than 64 KiB")
            if not self._fill():
                raise _BadAnswer(f"the connection closed {where}")
        got = bytes(self._buf[:i])
        del self._buf[: i + len(end)]
        return got

    def _exactly(self, n: int) -> bytes:
        self._need(n)
        body = bytes(self._buf[:n])
        del self._buf[:n]
        return body

    def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise _BadAnswer(f"a chunk size of {size_line[:20]!r}") from None
            if size < 0:
                raise _BadAnswer("a negative chunk size")
            if size == 0:
                while self._line():  # the trailer, up to its empty line
                    pass
                return bytes(body)
            self._need(size + 2)
            if self._buf[size : size + 2] != b"\r\n":
                raise _BadAnswer("a chunk without its CRLF")
            body += self._buf[:size]
            del self._buf[: size + 2]

    def _to_close(self) -> bytes:
        while self._fill():
            pass
        body = bytes(self._buf)
        self._buf.clear()
        return body


class _Late(Exception):
    """The deadline passed between two socket reads."""


def _framing(head: bytes) -> tuple[int, int | None, bool, bool]:
    """Status, ``Content-Length`` (None: not given), chunked, and whether the connection closes
    after the answer, from a response head (status line and header lines)."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise _BadAnswer(f"a status line of {lines[0][:40]!r}")
    length: int | None = None
    chunked = False
    tokens: set[bytes] = set()
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise _BadAnswer(f"a header line of {line[:40]!r}")
        name = name.strip().lower()
        if name == b"content-length":
            value = value.strip()
            if not value.isdigit() or (length is not None and int(value) != length):
                raise _BadAnswer(f"a Content-Length of {value[:20]!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            codings = [c.strip().lower() for c in value.split(b",")]
            if codings[-1] != b"chunked":
                raise _BadAnswer(f"a Transfer-Encoding of {value.strip()[:40]!r}")
            chunked = True
        elif name == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    close = b"close" in tokens or (version == b"HTTP/1.0" and b"keep-alive" not in tokens)
    return int(code), None if chunked else length, chunked, close


def engine_error(exc: MetricsReadError, base_url: str) -> EngineError:
    """A failed read as the CLI-facing error family reports it (``VLLMClient``'s mapping)."""
    url = f"{base_url}/metrics"
    if exc.kind == "timeout":
        return EngineError(f"{url} timed out")
    if exc.kind == "unreachable":
        cause = exc.__cause__ or exc
        return EngineError(
            f"cannot reach {base_url}: {cause}", fix="is the engine running and the URL right?"
        )
    if exc.kind == "status" and exc.status_code == 401:
        return AuthError(url)
    if exc.kind == "status":
        return EngineError(f"{url} answered {exc.status_code}")
    return NotVLLMError(f"{url}: {exc}")
