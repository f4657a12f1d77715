"""Which MTP figures belong to one call, and where they came from.

Order of preference (see adr/0006-telemetry-agent.md):

1. The response's own ``metrics.speculative_decoding`` block (vLLM >= 0.29 with
   ``--per-request-spec-decode-metrics``): exact, immune to overlap and restarts, no extra HTTP
   request. Source ``request``.
2. The ``/metrics`` counter delta between a reading that holds none of the call's tokens
   (:meth:`Server.before`) and one taken after the call ended. Exact (source ``counters``) only
   when the window provably held this call alone; otherwise ``shared``. The proof
   (:func:`only_this_call`): no other call of this process overlapped it; exactly one request
   finished in the window (``vllm:request_success_total``, every finish reason); and the
   server's ``vllm:generation_tokens_total`` moved by exactly this call's own
   ``usage.completion_tokens``. Every verification step yields at least one token, so another
   request's drafts in the window would have moved that counter past the call's usage. Without
   usage (a stream without ``include_usage``), nothing may be running at either read.
3. ``absent`` when the server has no speculative decoding; ``unknown`` when the figures cannot
   be known (a read failed, or the counters reset between the reads).

The after-read, and everything that waits on it (figures, span end, metrics, ``on_call``), runs
on one background thread (:class:`Worker`), off the caller's path: the caller neither reads nor
sends anything for it (a request sent from the caller's thread as its call ends was measured at
1.4-2.4 ms there on a 2-core host: the server woken to render the page takes the caller's CPU).
The reading before a call is the newest one that provably holds none of the call's tokens: one
complete before its request went out, or a *certified* after-read (:meth:`Server.certify`): one
whose token counter moved, since a clean reading, by exactly the usage of this process's own
calls that ended before it was sent; it then holds no token of any request sent after the last
of them ended, even if that request went out while the read was still in flight. So sequential
calls cost one read each, none on the caller's path. The worker sends the after-read as soon as
it runs, usually just after the caller's next request: the page is nearly always rendered before
that request's first token, and when it is not, the proof fails, the two calls it touches are
``shared`` and the next after-read certifies both together, so the chain goes on. Foreign traffic
between two calls fails every proof; then a call that finds an after-read pending waits for it
(bounded), at most once a second per server, and less often while such waits do not pay off
(:meth:`Server.restarted`), so back-to-back calls get a clean window again and a server whose
foreign traffic never stops costs no waits. A stream without usage cannot
use a certified reading: it always waits for a pending after-read. Every read is bounded and every
failure is counted, never raised.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
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


@dataclass(eq=False)
class Timed:
    """A reading with when its request went out and when its answer was complete (monotonic).

    ``clean_from``: the reading holds no token of any request sent after this time. ``got`` (the
    page was complete) unless :meth:`Server.certify` proved an earlier time.
    """

    reading: Reading
    sent: float
    got: float
    clean_from: float = 0.0

    def __post_init__(self) -> None:
        self.clean_from = self.clean_from or self.got


@dataclass(eq=False)  # identity, not value: two calls' windows are never "the same window"
class Window:
    """One call's attribution window; ``overlapped`` is set when another call shared it."""

    overlapped: bool = False
    snapshots: bool = False
    sent: float = 0.0  # when the call's request went out (monotonic)
    finished: float = 0.0  # when the call ended for the caller (monotonic)
    quiet_before: bool = False  # no usage to prove with: wait for a pending after-read
    ended: bool = False
    tokens: int | None = None  # the call's usage.completion_tokens; None: unknown


# --- the background thread ------------------------------------------------------------------


class Worker:
    """One daemon thread running the agent's reads and the work that waits on them, in order.

    Bounded: :meth:`offer` refuses work past ``MAX_BACKLOG`` queued jobs (the call then gets
    ``unknown``/``skipped`` figures, counted as ``gemma4_agent_errors_total{kind="backlog"}``).
    ``put`` is a ``queue.SimpleQueue.put``: reentrant, so a garbage-collection finalizer may call
    it while the interrupted thread holds any lock (it takes none of the agent's); those jobs are
    tiny and network-free. Exit: :func:`_exit_flush` runs at interpreter exit, registered again
    whenever a client is instrumented or the thread starts, so it runs before the ``atexit``
    shutdown of any tracer provider created earlier. Fork: the child starts with an empty queue
    and fresh locks (:func:`_after_fork`); the parent's queued jobs stay the parent's.
    """

    MAX_BACKLOG = 512

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._pid = os.getpid()

    def _reset_after_fork(self) -> None:
        self._q, self._thread, self._start_lock = queue.SimpleQueue(), None, threading.Lock()
        self._pid = os.getpid()

    def start(self) -> None:
        """Start the thread (from a normal call path, never from a finalizer)."""
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._start_lock:
            if self._pid != os.getpid():  # forked without the hook (it is registered at import)
                self._q, self._pid = queue.SimpleQueue(), os.getpid()
                self._thread = None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="appliance-agent", daemon=True
                )
                self._thread.start()
                register_exit_flush()

    def busy(self) -> bool:
        return self._q.qsize() >= self.MAX_BACKLOG

    def offer(self, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` unless the backlog is full (False: the caller degrades and counts it)."""
        if self.busy():
            return False
        self.start()
        self._q.put(fn)
        return True

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
        if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
            return self._q.empty()
        if threading.current_thread() is self._thread:
            return False  # called from a job (an on_call callback): waiting on itself
        done = threading.Event()
        self._q.put(done.set)
        return done.wait(timeout)


WORKER = Worker()
EXIT_FLUSH_S = 2.0  # at most this long at exit: every queued read is bounded anyway


def _exit_flush() -> None:
    WORKER.flush(EXIT_FLUSH_S)


def register_exit_flush() -> None:
    """(Re)register the exit flush: ``atexit`` runs last-registered first, so this puts the
    agent's flush ahead of every exit handler registered so far, such as the shutdown of a
    tracer provider created before the client was instrumented (its spans are still exported)."""
    atexit.unregister(_exit_flush)
    atexit.register(_exit_flush)


register_exit_flush()


# --- one server -------------------------------------------------------------------------------

# After foreign traffic broke the chain, a call waits for the pending after-read (to start from
# a clean reading) at most this often per server (each wait is a read's latency on the caller),
# backing off to RESTART_MAX_S while the waits do not pay off (Server.restarted).
RESTART_MIN_S = 1.0
RESTART_MAX_S = 60.0


@dataclass
class Server:
    """What the agent knows about one server's ``/metrics``, shared by the process's clients."""

    metrics_url: str
    per_request: bool | None = None  # learned from responses: does it send per-request figures?
    _active: set[Window] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _skip_until: float = 0.0
    _http: httpx.Client | None = None
    _kept: metrics_reader.KeptReader | None = None  # a kept-alive connection
    _ahttp: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # The newest readings (sent order), candidates for the next calls' before-reading.
    _readings: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    _pending: int = 0  # after-reads queued on the worker and not yet done
    # Whether the newest reading is expected to start the next call's window cleanly (a fresh
    # read, or a certified after-read). When not, the next call may wait for a pending
    # after-read (see _needs), so back-to-back calls get a clean window again.
    _chain: bool = False
    _changed: threading.Condition | None = None
    _restart_at: float = 0.0  # no restart wait before this (monotonic): see restarted()
    _restart_every: float = RESTART_MIN_S
    _restart_window: Window | None = None  # the call that waited last
    # This process's calls to the server, as they ended (certify's own calls).
    _ended: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))

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
        """Close ``w`` (once; later calls are no-ops). Set ``w.tokens`` first when known."""
        with self._lock:
            if not w.ended:
                w.ended = True
                self._active.discard(w)
                if w.sent:
                    self._ended.append(w)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._active)

    # -- the reading before a call ----------------------------------------------------------------
    def _needs(self, w: Window) -> str:
        """What ``w`` needs before its request goes out: ``read`` (no reading yet: a server's
        first call), ``wait`` for a pending after-read (a call without usage, which cannot use a
        certified reading; or, now and then (:meth:`restarted`), the first call after a broken
        chain, see ``_chain``), or nothing (the before-reading is picked after the call,
        on the worker: see :meth:`before`)."""
        with self._lock:
            if not self._readings and not self._pending:
                return "read"
            if not self._pending or w.overlapped:
                return ""
            if w.quiet_before:
                return "wait"
            now = time.monotonic()
            if not self._chain and now >= self._restart_at:
                self._restart_at = now + self._restart_every
                self._restart_window = w
                return "wait"
            return ""

    def prepare(self, w: Window, metrics: AgentMetrics, timeout: float, cooldown: float) -> None:
        """Make sure a reading can precede the call (sync; at most one bounded wait or read)."""
        need = self._needs(w)
        if need == "wait":
            with self._changed:
                self._changed.wait_for(lambda: not self._pending, timeout)
        elif need == "read":
            self.chained(self.read(metrics, timeout, cooldown) is not None)

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
            self.chained(await self.aread(metrics, timeout, cooldown) is not None)

    def restarted(self, w: Window, exact: bool) -> None:
        """Learn from a call's figures whether its restart wait paid off: the next wait may come
        a second later when it did (back-to-back calls after foreign traffic), and twice as late
        as the last one, up to a minute, while it did not (foreign traffic that never stops: the
        waits cannot make any call exact there)."""
        with self._lock:
            if w is not self._restart_window:
                return
            self._restart_window = None
            if exact:
                self._restart_every = RESTART_MIN_S
            else:
                self._restart_every = min(2 * self._restart_every, RESTART_MAX_S)
            self._restart_at = w.finished + self._restart_every

    def chained(self, ok: bool) -> None:
        """Whether the newest reading starts the next window cleanly (see ``_chain``)."""
        self._chain = ok

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
            reading = self._read_now(timeout)
        except metrics_reader.MetricsReadError as exc:
            self._failed(metrics, exc, cooldown)
            return None
        return self._record(reading, sent)

    def _read_now(self, timeout: float) -> Reading:
        with self._lock:
            if self._kept is None:
                self._kept = metrics_reader.KeptReader(self.metrics_url)
            kept = self._kept
        reading = kept.read(timeout)
        if reading is not None:
            return reading
        if self._http is None:  # the kept-alive connection is busy: another one
            self._http = httpx.Client()
        return metrics_reader.read(self.metrics_url, timeout=timeout, client=self._http)

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
        """The newest reading that holds none of the call's tokens (``clean_from`` before the
        call's request went out): complete before it, or certified (:meth:`certify`)."""
        with self._lock:
            readings = list(self._readings)
        for t in reversed(readings):
            if t.clean_from < w.sent:
                return t
        return None

    def certify(self, before: Timed, after: Timed) -> bool:
        """Lower ``after.clean_from`` when the token counter proves it; whether it did.

        Given ``before`` (no token of any request sent after ``before.clean_from``) and
        ``after``, let *own* be this process's calls to the server sent after
        ``before.clean_from`` that ended before ``after`` was sent: each has none of its tokens
        in ``before`` and all of them in ``after``. When the generation-token counter moved by
        exactly their summed usage, no other request moved it in between: ``after`` holds, for
        every other request, exactly the tokens ``before`` held. A request sent after both
        ``before.clean_from`` and the last own call's end is not one of them and ``before``
        holds none of its tokens, so ``after`` holds none either, even if ``after`` was still in
        flight when it was sent. A request with no token in a reading has no drafts in it
        either: every verification step yields at least one token. One own call is the common
        case (its own proof held); several when a leak made the previous call ``shared``.
        """
        b, a = before.reading.generation_tokens, after.reading.generation_tokens
        if b is None or a is None:
            return False
        with self._lock:
            own = [
                w for w in self._ended if before.clean_from < w.sent and w.finished <= after.sent
            ]
            if not own or any(w.tokens is None for w in own):
                return False  # an own call of unknown usage (failed, cancelled) may hold tokens
            if a - b != sum(w.tokens for w in own):
                return False
            last = max(w.finished for w in own)
            after.clean_from = min(after.clean_from, max(before.clean_from, last))
        return True

    def reset_after_fork(self) -> None:
        """In a forked child: fresh locks, no connections or windows of the parent's."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._active = set()
        self._pending = 0
        self._chain = False
        self._ended = collections.deque(maxlen=256)
        self._kept = None  # the parent's socket: left open for the parent
        self._http = None
        self._ahttp = weakref.WeakKeyDictionary()


_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def _after_fork() -> None:
    global _servers_lock
    # A lock held by another thread at fork time would stay held forever in the child.
    _servers_lock = threading.Lock()
    WORKER._reset_after_fork()
    for srv in _servers.values():
        srv.reset_after_fork()


os.register_at_fork(after_in_child=_after_fork)


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

    ``before`` holds none of the call's tokens and ``after`` was taken after it ended (the
    caller picks them so). See the module docstring for the rule. With usage, the running gauge
    does not matter: a request still running at either read with no token inside the window has
    no drafts inside it, and one with a token there moves the token counter past the usage.
    """
    b, a = before.reading, after.reading
    if overlapped:
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
    return b.snapshot.running == 0 and a.snapshot.running == 0


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
    alone = only_this_call(before, after, output_tokens, overlapped)
    b, a = before.reading.snapshot, after.reading.snapshot
    if alone:
        # The proof already accounts for requests running at either read (only_this_call), and
        # the request running at a certified before-reading may be this very call.
        b, a = dataclasses.replace(b, running=0.0), dataclasses.replace(a, running=0.0)
    # The one rule (specdecode.attribute), with this agent's stronger proof of being alone.
    att = specdecode.attribute(b, a, model, overlapped=not alone)
    if att.source == "absent":
        return Figures("absent", "absent")
    if att.source == "unknown":
        return Figures("unknown", "reset")
    return Figures.from_delta(att.delta, att.source, shared=att.source == "shared")
