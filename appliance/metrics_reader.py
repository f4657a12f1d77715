"""The one reader of vLLM's ``/metrics``: bounded, filtered, sync and async, one typed error.

Every caller that reads the engine's speculative-decoding counters (the telemetry agent,
:class:`~appliance.vllm_client.VLLMClient`) goes through :func:`read` / :func:`aread`. A read is
bounded as a whole by ``timeout``: connect, headers and the body (a server that trickles its page
is cut off by an overall deadline, not only per gap between bytes). Every failure is one
:class:`MetricsReadError` whose ``kind`` says what went wrong: ``timeout``, ``unreachable``,
``status`` or ``parse``. Callers map the kinds to their own reporting (the agent counts them, the
client raises ``EngineError`` / ``NotVLLMError``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import httpx

from . import specdecode
from .errors import AuthError, EngineError, NotVLLMError

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
        snap = specdecode.parse(text)
    except specdecode.MetricsParseError as exc:
        raise MetricsReadError("parse", str(exc)) from None
    return Reading(
        snap, _sum(text, GENERATION_TOKENS), _sum(text, REQUEST_SUCCESS), time.monotonic()
    )


def _sum(text: str, family: str) -> float | None:
    """Sum of a counter's ``_total`` samples over every label set (None when there are none)."""
    prefix = family + "_total"
    total: float | None = None
    for line in text.splitlines():
        if line.startswith(prefix) and line[len(prefix) : len(prefix) + 1] in ("{", " "):
            try:
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                raise MetricsReadError("parse", f"unparsable {prefix} sample") from None
    return total


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
