"""Which MTP figures belong to one call, and where they came from.

Order of preference (see adr/0006-telemetry-agent.md):

1. The response's own ``metrics.speculative_decoding`` block (vLLM >= 0.29 with
   ``--per-request-spec-decode-metrics``): exact, immune to overlap and restarts, no extra HTTP
   request. Source ``request``.
2. The ``/metrics`` counter delta between a reading complete before the call's request went out
   and one taken after the call ended. Exact (source ``counters``) only when the window provably
   held this call alone; otherwise ``shared``. The proof (:func:`only_this_call`): no other call
   of this process overlapped it; nothing was running at the after-read; exactly one request
   finished in the window (``vllm:request_success_total``, every finish reason); and the
   server's ``vllm:generation_tokens_total`` moved by exactly this call's own
   ``usage.completion_tokens``. Every verification step yields at least one token, so another
   request's drafts in the window would have moved that counter past the call's usage. Without
   usage (a stream without ``include_usage``), nothing may be running at the before-read
   either.
3. ``absent`` when the server has no speculative decoding; ``unknown`` when the figures cannot
   be known (a read failed, or the counters reset between the reads).

The after-read, and everything that waits on it (figures, span end, metrics, ``on_call``), runs
on one background thread (:class:`Worker`), off the caller's path. The reading before a call is
the newest one complete before its request went out, usually the previous call's after-read:
sequential calls cost one read each. The caller waits for it only when that after-read is still
in flight (calls back to back), and reads itself only for a server's first call. A read still in
flight when the request goes out cannot be shown to precede the call's first token; measured, on
a loaded host it often does not. When foreign
traffic moved the counters in between, the proof fails and the call is ``shared``. Every read is
bounded and every failure is counted, never raised.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .. import metrics_reader, specdecode
from ..metrics_reader import Reading
from .metrics import AgentMetrics

log = logging.getLogger("appliance.agent")


@dataclass(frozen=True)
class Figures:
    """One call's MTP figures (vLLM's names) and their provenance."""

    source: str  # request | counters | shared | absent | unknown
    status: str  # ok | absent | reset | failed | skipped | missing | abandoned | call_failed
    shared: bool = False
    drafts: int | None = None
    draft_tokens: int | None = None
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
            source=source,
            status=d.status,
            shared=shared,
            drafts=d.drafts,
            draft_tokens=d.draft_tokens,
            accepted=d.accepted,
            acceptance=d.acceptance,
            tokens_per_step=d.tokens_per_step,
            per_position=d.per_position,
        )


UNKNOWN_FAILED = Figures("unknown", "failed")
UNKNOWN_SKIPPED = Figures("unknown", "skipped")


@dataclass(frozen=True)
class Timed:
    """A reading with when its request went out and when its answer was complete (monotonic)."""

    reading: Reading
    sent: float
    got: float


@dataclass(eq=False)  # identity, not value: two calls' windows are never "the same window"
class Window:
    """One call's attribution window; ``overlapped`` is set when another call shared it."""

    overlapped: bool = False
    snapshots: bool = False
    sent: float = 0.0  # when the call's request went out (monotonic)
    ended: bool = False


# --- the background thread ------------------------------------------------------------------


class Worker:
    """One daemon thread running the agent's reads and the work that waits on them, in order.

    ``put`` is a ``queue.SimpleQueue.put``: reentrant, so a garbage-collection finalizer may call
    it while the interrupted thread holds any lock (it takes none of the agent's).
    """

    MAX_BACKLOG = 512

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._pid = os.getpid()

    def start(self) -> None:
        """Start the thread (from a normal call path, never from a finalizer)."""
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._start_lock:
            if self._pid != os.getpid():  # a forked child inherits the queue, not the thread
                self._q, self._pid = queue.SimpleQueue(), os.getpid()
                self._thread = None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="appliance-agent", daemon=True
                )
                self._thread.start()

    def busy(self) -> bool:
        return self._q.qsize() >= self.MAX_BACKLOG

    def put(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            try:
                fn()
            except BaseException:
                log.debug("agent background job failed", exc_info=True)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far has run; False if ``timeout`` passed first."""
        if self._thread is None or not self._thread.is_alive():
            return self._q.empty()
        done = threading.Event()
        self._q.put(done.set)
        return done.wait(timeout)


WORKER = Worker()
atexit.register(WORKER.flush, 2.0)  # spans finish before the tracer provider's own atexit flush


# --- one server -------------------------------------------------------------------------------


@dataclass
class Server:
    """What the agent knows about one server's ``/metrics``, shared by the process's clients."""

    metrics_url: str
    per_request: bool | None = None  # learned from responses: does it send per-request figures?
    _active: set[Window] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _skip_until: float = 0.0
    _http: httpx.Client | None = None
    _ahttp: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # The newest readings (sent order), candidates for the next calls' before-reading.
    _readings: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    _pending: int = 0  # after-reads queued on the worker and not yet done
    _changed: threading.Condition | None = None

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    # -- overlap -------------------------------------------------------------------------------
    def begin(self) -> Window:
        w = Window()
        with self._lock:
            if self._active:
                w.overlapped = True
                for other in self._active:
                    other.overlapped = True
            self._active.add(w)
        return w

    def end(self, w: Window) -> None:
        """Close ``w`` (once; later calls are no-ops)."""
        with self._lock:
            if not w.ended:
                w.ended = True
                self._active.discard(w)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._active)

    # -- the reading before a call ----------------------------------------------------------------
    def _needs(self, w: Window) -> str:
        """What ``w`` needs before its request goes out: ``wait`` for a pending after-read (the
        previous call's, which is then this call's before), ``read`` (no reading yet), or
        nothing (an older reading is reused; the proof at the end says if it holds)."""
        with self._lock:
            if self._pending and not w.overlapped:
                return "wait"
            return "" if self._readings else "read"

    def prepare(self, w: Window, metrics: AgentMetrics, timeout: float, cooldown: float) -> None:
        """Make sure a reading precedes the call (sync; at most one bounded wait or read)."""
        need = self._needs(w)
        if need == "wait":
            with self._changed:
                self._changed.wait_for(lambda: not self._pending, timeout)
        elif need == "read":
            self.read(metrics, timeout, cooldown)

    async def aprepare(
        self, w: Window, metrics: AgentMetrics, timeout: float, cooldown: float
    ) -> None:
        """The async twin of :meth:`prepare` (never blocks the event loop)."""
        import asyncio

        need = self._needs(w)
        if need == "wait":
            deadline = time.monotonic() + timeout
            while self._pending and time.monotonic() < deadline:
                await asyncio.sleep(0.0005)
        elif need == "read":
            await self.aread(metrics, timeout, cooldown)

    def after_queued(self) -> None:
        with self._lock:
            self._pending += 1

    def after_done(self) -> None:
        with self._changed:
            self._pending -= 1
            self._changed.notify_all()

    # -- reads ---------------------------------------------------------------------------------
    def _cooling(self, metrics: AgentMetrics) -> bool:
        if time.monotonic() < self._skip_until:
            metrics.error("metrics_skipped")
            return True
        return False

    def _record(self, reading: Reading, sent: float) -> Timed:
        t = Timed(reading, sent, reading.at)
        with self._lock:
            self._readings.append(t)
        return t

    def _failed(
        self, metrics: AgentMetrics, exc: metrics_reader.MetricsReadError, cooldown: float
    ) -> None:
        self._skip_until = time.monotonic() + cooldown
        metrics.error("metrics_" + exc.kind)

    def read(self, metrics: AgentMetrics, timeout: float, cooldown: float) -> Timed | None:
        """One bounded read, recorded as a candidate; ``None`` (one counted error) on failure."""
        if self._cooling(metrics):
            return None
        sent = time.monotonic()
        try:
            if self._http is None:
                self._http = httpx.Client()
            reading = metrics_reader.read(self.metrics_url, timeout=timeout, client=self._http)
        except metrics_reader.MetricsReadError as exc:
            self._failed(metrics, exc, cooldown)
            return None
        return self._record(reading, sent)

    async def aread(self, metrics: AgentMetrics, timeout: float, cooldown: float) -> Timed | None:
        """The async twin of :meth:`read`, on a client bound to the running loop."""
        import asyncio

        if self._cooling(metrics):
            return None
        sent = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
            client = self._ahttp.get(loop)
            if client is None:
                client = self._ahttp[loop] = httpx.AsyncClient()
            reading = await metrics_reader.aread(self.metrics_url, timeout=timeout, client=client)
        except metrics_reader.MetricsReadError as exc:
            self._failed(metrics, exc, cooldown)
            return None
        return self._record(reading, sent)

    def before(self, w: Window) -> Timed | None:
        """The newest reading complete before the call's request went out."""
        with self._lock:
            readings = list(self._readings)
        for t in reversed(readings):
            if t.got < w.sent:
                return t
        return None


_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def server_for(metrics_url: str) -> Server:
    """The process-wide :class:`Server` for ``metrics_url`` (one in-flight view per server)."""
    with _servers_lock:
        srv = _servers.get(metrics_url)
        if srv is None:
            srv = _servers[metrics_url] = Server(metrics_url)
        return srv


# --- the rules ------------------------------------------------------------------------------


def from_response(extra: dict | None) -> Figures | None:
    """Exact figures from a response body's extra fields, or ``None`` when it has none."""
    d = specdecode.from_response_metrics(extra)
    return None if d is None else Figures.from_delta(d, "request")


def only_this_call(
    before: Timed, after: Timed, output_tokens: int | None, overlapped: bool
) -> bool:
    """True when the window between the two readings provably held this call alone.

    ``before`` was complete before the call's request went out and ``after`` was taken after it
    ended (the caller picks them so). See the module docstring for the rule.
    """
    b, a = before.reading, after.reading
    if overlapped or a.snapshot.running is None or a.snapshot.running > 0:
        return False
    if b.finished_requests is None or a.finished_requests is None:
        return False
    if a.finished_requests - b.finished_requests != 1:
        return False
    if (
        output_tokens is not None
        and b.generation_tokens is not None
        and a.generation_tokens is not None
    ):
        # Every verification step yields tokens: any other request's drafts in the window
        # would have moved this counter past the call's own usage.
        return a.generation_tokens - b.generation_tokens == output_tokens
    # Without usage: nothing running at either read and one request finished in between.
    return b.snapshot.running == 0


def from_readings(
    before: Timed | None,
    after: Timed | None,
    model: str | None,
    *,
    overlapped: bool,
    output_tokens: int | None,
) -> Figures:
    """Figures from the readings around a call (see the module docstring for the rules)."""
    if before is None or after is None:
        return UNKNOWN_FAILED
    # The one rule (specdecode.attribute), with this agent's stronger proof of being alone.
    att = specdecode.attribute(
        before.reading.snapshot,
        after.reading.snapshot,
        model,
        overlapped=not only_this_call(before, after, output_tokens, overlapped),
    )
    if att.source == "absent":
        return Figures("absent", "absent")
    if att.source == "unknown":
        return Figures("unknown", "reset")
    return Figures.from_delta(att.delta, att.source, shared=att.source == "shared")
