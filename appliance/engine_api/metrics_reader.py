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
import http.client
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
        snap, (tokens, finished) = specdecode.parse_with(text, _TOTALS)
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
    """

    IDLE_S = 2.0  # reuse a connection idle for less than this (vLLM's keep-alive is 5 s)

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._target = (parts.path or "/") + "?" + urlencode(PARAMS)
        self.url = url
        self._conn: http.client.HTTPConnection | None = None
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
            if self._conn is not None and time.monotonic() - self._idle_since > self.IDLE_S:
                self._conn.close()
                self._conn = None
            reused = self._conn is not None
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

    def _send_and_answer(self, timeout: float) -> Reading:
        try:
            if self._conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = cls(self._host, self._port, timeout=timeout)
            self._conn.request("GET", self._target)
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise MetricsReadError("unreachable", f"cannot reach {self.url}: {exc}") from exc
        except BaseException:
            self._drop()
            raise
        try:
            return self._answer(timeout)
        except BaseException:  # a failed or interrupted read leaves no half-read connection
            self._drop()
            raise

    def _answer(self, timeout: float) -> Reading:
        conn = self._conn
        deadline = time.monotonic() + timeout
        try:
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            resp = conn.getresponse()
            body = bytearray()
            while chunk := resp.read(65536):  # each gap bounded; the whole by the deadline
                body += chunk
                if time.monotonic() > deadline:
                    raise MetricsReadError("timeout", f"{self.url} took longer than {timeout} s")
            reading = parse(resp.status, bytes(body), self.url)
        except TimeoutError as exc:
            raise MetricsReadError("timeout", f"{self.url} timed out after {timeout} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise MetricsReadError("unreachable", f"cannot reach {self.url}: {exc}") from exc
        with self._lock:
            if resp.will_close:
                conn.close()
                self._conn = None
            self._busy = False
            self._idle_since = time.monotonic()
        return reading

    def _drop(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn, self._busy = None, False


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
