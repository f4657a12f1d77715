"""Which MTP figures belong to one call, and where they came from.

Order of preference (see adr/0006-telemetry-agent.md):

1. The response's own ``metrics.speculative_decoding`` block (vLLM >= 0.32 with
   ``--per-request-spec-decode-metrics``): exact, immune to overlap and restarts, no extra HTTP
   request. Source ``request``.
2. ``/metrics`` counter snapshots taken just before and just after the call. Exact (source
   ``counters``) only when nothing overlapped the window; otherwise the delta also holds other
   calls' drafts and is marked ``shared``. Overlap is known from this process's own in-flight
   calls and from the server's ``vllm:num_requests_running`` gauge at either read: the first read
   precedes our request and the second follows its completion, so any running request seen
   there is someone else's.
3. ``absent`` when the server has no speculative decoding; ``unknown`` when the figures cannot
   be known (a snapshot failed, or the counters reset between the reads).

Every read is bounded (``snapshot_timeout`` covers connect, read and body) and every failure is
counted, never raised.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass, field

import httpx

from .. import specdecode
from .metrics import AgentMetrics


@dataclass(frozen=True)
class Figures:
    """One call's MTP figures and their provenance."""

    source: str  # request | counters | shared | absent | unknown
    status: str  # ok | absent | reset | failed | skipped | missing
    shared: bool = False
    drafts: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    acceptance: float | None = None
    tokens_per_step: float | None = None
    per_position: tuple[float, ...] | None = None

    @property
    def exact(self) -> bool:
        return self.source in ("request", "counters")

    @classmethod
    def from_delta(cls, d: specdecode.Delta, source: str, shared: bool = False) -> Figures:
        return cls(
            source=source, status=d.status, shared=shared, drafts=d.drafts,
            drafted=d.draft_tokens, accepted=d.accepted, acceptance=d.acceptance,
            tokens_per_step=d.tokens_per_step, per_position=d.per_position,
        )


UNKNOWN_FAILED = Figures("unknown", "failed")


@dataclass
class Window:
    """One call's attribution window; ``overlapped`` is set when another call shared it."""

    overlapped: bool = False
    before: specdecode.Snapshot | None = None
    snapshots: bool = False


class SnapshotFailed(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass
class Server:
    """What the agent knows about one server's ``/metrics``; shared by every client in the process."""

    metrics_url: str
    per_request: bool | None = None  # learned from responses: does it send per-request figures?
    _active: list[Window] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _skip_until: float = 0.0
    _http: httpx.Client | None = None
    _ahttp: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    # -- overlap -------------------------------------------------------------------------------
    def begin(self) -> Window:
        w = Window()
        with self._lock:
            if self._active:
                w.overlapped = True
                for other in self._active:
                    other.overlapped = True
            self._active.append(w)
        return w

    def end(self, w: Window) -> None:
        with self._lock:
            if w in self._active:
                self._active.remove(w)

    # -- snapshots -----------------------------------------------------------------------------
    def _cooling(self) -> bool:
        return time.monotonic() < self._skip_until

    def _failed(self, metrics: AgentMetrics, kind: str, cooldown: float) -> None:
        self._skip_until = time.monotonic() + cooldown
        metrics.error(kind)

    def snapshot(
        self, metrics: AgentMetrics, timeout: float, cooldown: float
    ) -> specdecode.Snapshot | None:
        """Read ``/metrics`` within the bound; ``None`` (and one counted error) on any failure."""
        if self._cooling():
            metrics.error("metrics_skipped")
            return None
        try:
            if self._http is None:
                self._http = httpx.Client()
            deadline = time.monotonic() + timeout
            with self._http.stream("GET", self.metrics_url, params=specdecode.SNAPSHOT_PARAMS,
                                   timeout=timeout) as resp:
                body = bytearray()
                # The read timeout only bounds each gap between bytes: a server that trickles
                # its page must still not hold the call past the overall deadline.
                for part in resp.iter_bytes():
                    body += part
                    if time.monotonic() > deadline:
                        raise SnapshotFailed("metrics_timeout")
            return _parse(resp.status_code, bytes(body))
        except SnapshotFailed as exc:
            self._failed(metrics, exc.kind, cooldown)
        except httpx.TimeoutException:
            self._failed(metrics, "metrics_timeout", cooldown)
        except httpx.HTTPError:
            self._failed(metrics, "metrics_unreachable", cooldown)
        except Exception:  # noqa: BLE001 - telemetry must never break the call
            self._failed(metrics, "internal", cooldown)
        return None

    async def asnapshot(
        self, metrics: AgentMetrics, timeout: float, cooldown: float
    ) -> specdecode.Snapshot | None:
        """The async twin of :meth:`snapshot`, on a client bound to the running loop."""
        if self._cooling():
            metrics.error("metrics_skipped")
            return None
        try:
            loop = asyncio.get_running_loop()
            client = self._ahttp.get(loop)
            if client is None:
                client = self._ahttp[loop] = httpx.AsyncClient()
            resp = await asyncio.wait_for(
                client.get(self.metrics_url, params=specdecode.SNAPSHOT_PARAMS, timeout=timeout),
                timeout,
            )
            return _parse(resp.status_code, resp.content)
        except SnapshotFailed as exc:
            self._failed(metrics, exc.kind, cooldown)
        except (TimeoutError, httpx.TimeoutException):
            self._failed(metrics, "metrics_timeout", cooldown)
        except httpx.HTTPError:
            self._failed(metrics, "metrics_unreachable", cooldown)
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._failed(metrics, "internal", cooldown)
        return None


def _parse(status: int, body: bytes) -> specdecode.Snapshot:
    if status != 200:
        raise SnapshotFailed("metrics_status")
    try:
        return specdecode.parse(body.decode("utf-8", errors="replace"))
    except specdecode.MetricsParseError:
        raise SnapshotFailed("metrics_parse") from None


_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def server_for(metrics_url: str) -> Server:
    """The process-wide :class:`Server` for ``metrics_url`` (one in-flight view per server)."""
    with _servers_lock:
        srv = _servers.get(metrics_url)
        if srv is None:
            srv = _servers[metrics_url] = Server(metrics_url)
        return srv


def from_response(extra: dict | None) -> Figures | None:
    """Exact figures from a response body's extra fields, or ``None`` when it has none."""
    d = specdecode.from_response_metrics(extra)
    return None if d is None else Figures.from_delta(d, "request")


def from_snapshots(
    before: specdecode.Snapshot | None,
    after: specdecode.Snapshot | None,
    model: str | None,
    overlapped: bool,
) -> Figures:
    """Figures from the two reads around a call (see the module docstring for the rules)."""
    if before is None or after is None:
        return UNKNOWN_FAILED
    names = {m for (m, _) in (*before.series, *after.series)}
    d = specdecode.delta(before, after, model if model in names else None)
    if d.status == "absent":
        return Figures("absent", "absent")
    if d.status == "reset":
        return Figures("unknown", "reset")
    shared = overlapped or bool(before.running) or bool(after.running)
    return Figures.from_delta(d, "shared" if shared else "counters", shared=shared)
