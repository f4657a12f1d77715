"""What the agent knows about one server's ``/metrics``: in-flight calls, readings, the chain.

The reading before a call is the newest one that provably holds none of the call's tokens: one
complete before its request went out, or a *certified* after-read (:meth:`Server.certify`): one
whose token counter moved, since a clean reading, by exactly the usage of this process's own
calls that ended before it was sent; it then holds no token of any request sent after the last
of them ended, even if that request went out while the read was still in flight. So sequential
calls cost one read each, none on the caller's path. The worker (:mod:`.worker`) sends the
after-read as soon as it runs, usually just after the caller's next request: the page is nearly
always rendered before that request's first token, and when it is not, the proof fails, the two
calls it touches are ``shared`` and the next after-read certifies both together, so the chain
goes on. Foreign traffic between two calls fails every proof; then a call that finds an
after-read pending waits for it (bounded), at most once a second per server, and less often
while such waits do not pay off (:meth:`Server.restarted`), so back-to-back calls get a clean
window again and a server whose foreign traffic never stops costs no waits. A stream without
usage cannot use a certified reading: it always waits for a pending after-read. Every read is
bounded and every failure is counted, never raised. The figures from two readings:
:mod:`.rules`.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import httpx

from ..engine_api import metrics_reader
from ..engine_api.metrics_reader import Reading
from .metrics import AgentMetrics
from .rules import Timed


# Identity, not value: two calls' windows are never "the same window". Slots: a window is made
# and written on the caller's thread every call (one allocation, no attribute dict).
@dataclass(eq=False, slots=True)
class Window:
    """One call's attribution window; ``overlapped`` is set when another call shared it."""

    overlapped: bool = False
    snapshots: bool = False
    sent: float = 0.0  # when the call's request went out (monotonic)
    finished: float = 0.0  # when the call ended for the caller (monotonic)
    quiet_before: bool = False  # no usage to prove with: wait for a pending after-read
    ended: bool = False
    tokens: int | None = None  # the call's usage.completion_tokens; None: unknown
    closed: float = 0.0  # when Server.end took it (monotonic): the order of Server._ended
    need: str = ""  # what a snapshots window needs before its request (Server.needs), at begin


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
    # Whether any call to it took the counters path (Responses, Anthropic, a stream without
    # usage): then its per-request calls read after themselves too, off the caller's path.
    counters_seen: bool = False
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
    # after-read (see needs), so back-to-back calls get a clean window again.
    _chain: bool = False
    _changed: threading.Condition | None = None
    _waiting: int = 0  # callers waiting on _changed (prepare), counted under the lock
    _restart_at: float = 0.0  # no restart wait before this (monotonic): see restarted()
    _restart_every: float = RESTART_MIN_S
    _restart_window: Window | None = None  # the call that waited last
    # This process's calls to the server, as they ended (certify's own calls).
    _ended: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    _last_end: float = 0.0  # when the last of them ended (monotonic)
    _newest_sent: float = 0.0  # the latest ``sent`` of the kept readings (needs reads one field)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    # -- overlap -------------------------------------------------------------------------------
    def begin(self, snapshots: bool = False, quiet_before: bool = False) -> Window:
        """Open a call's window, marking it and every call in flight as overlapped. A window
        that takes ``snapshots`` learns under the same lock what it needs before its request
        goes out (``need``: :meth:`needs`; one lock a call, not two, issue 56 §2)."""
        w = Window(snapshots=snapshots, quiet_before=quiet_before)
        with self._lock:
            if self._active:
                w.overlapped = True
                for other in self._active:
                    other.overlapped = True
            self._active.add(w)
            if snapshots:
                w.need = self._needs(w, None)
        return w

    def end(self, w: Window, after_read: bool = False) -> None:
        """Close ``w`` (once; later calls are no-ops). Set ``w.tokens`` first when known.
        ``after_read``: its after-read is queued next, counted pending (:meth:`after_queued`)
        under the same lock."""
        with self._lock:
            if after_read:
                self._pending += 1
            if not w.ended:
                w.ended = True
                self._active.discard(w)
                if w.sent:
                    w.closed = time.monotonic()  # under the lock: _ended is in this order
                    self._ended.append(w)
                    self._last_end = max(self._last_end, w.finished)

    def in_flight(self) -> int:
        """Calls begun and not yet ended."""
        with self._lock:
            return len(self._active)

    # -- the reading before a call ----------------------------------------------------------------
    def needs(self, w: Window, now: float | None = None) -> str:
        """What ``w`` needs before its request goes out: ``read`` (no reading yet: a server's
        first call; or, with no after-read pending, the newest reading was sent before an own
        call ended, e.g. calls with per-request figures that read nothing: that reading may
        miss some of their tokens, so a window from it would hold them too and could never be
        exact), ``wait`` for a pending after-read (a call without usage, which cannot use a
        certified reading; or, now and then (:meth:`restarted`), the first call after a broken
        chain, see :meth:`chained`), or ``""`` (the before-reading is picked after the call,
        on the worker: see :meth:`before`). ``now``: the monotonic time (default: the clock)."""
        with self._lock:
            return self._needs(w, now)

    def _needs(self, w: Window, now: float | None) -> str:
        # (Under the lock: see needs.)
        if not self._readings and not self._pending:
            return "read"
        if w.overlapped:
            return ""  # shared whatever it starts from: neither a read nor a wait would help
        if not self._pending:
            return "read" if self._newest_sent < self._last_end else ""
        if w.quiet_before:
            return "wait"
        now = time.monotonic() if now is None else now
        if not self._chain and now >= self._restart_at:
            self._restart_at = now + self._restart_every
            self._restart_window = w
            return "wait"
        return ""

    def prepare(self, w: Window, metrics: AgentMetrics, timeout: float, cooldown: float) -> None:
        """Make sure a reading can precede the call (sync; at most one bounded wait or read):
        what ``w`` needs, learnt at :meth:`begin`."""
        need = w.need
        if need == "wait":
            with self._changed:
                self._waiting += 1
                try:
                    self._changed.wait_for(lambda: not self._pending, timeout)
                finally:
                    self._waiting -= 1
        elif need == "read":
            self.chained(self.read(metrics, timeout, cooldown) is not None)

    async def aprepare(
        self, w: Window, metrics: AgentMetrics, timeout: float, cooldown: float
    ) -> None:
        """The async twin of :meth:`prepare` (never blocks the event loop)."""
        import asyncio

        need = w.need
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

    def restarting(self, w: Window) -> bool:
        """Whether ``w``'s call waited for a restart (:meth:`restarted` learns from it; set at
        its begin, so read without the lock)."""
        return w is self._restart_window

    def chained(self, ok: bool) -> None:
        """Whether the newest reading starts the next window cleanly (see ``_chain``)."""
        self._chain = ok

    def after_queued(self) -> None:
        """One more after-read queued on the worker (:meth:`after_done` when it is done)."""
        with self._lock:
            self._pending += 1

    def after_done(self) -> None:
        with self._lock:
            self._pending -= 1
            # Only a restart or a stream without usage waits (prepare): most after-reads wake
            # nobody, and notify_all's Python steps are skipped (issue 56 §2).
            if self._waiting:
                self._changed.notify_all()

    def pending(self) -> int:
        """After-reads queued on the worker and not yet done."""
        with self._lock:
            return self._pending

    # -- reads ---------------------------------------------------------------------------------
    def _cooling(self, metrics: AgentMetrics) -> bool:
        if time.monotonic() < self._skip_until:
            metrics.error("metrics_skipped")
            return True
        return False

    def record(self, reading: Reading, sent: float) -> Timed:
        """Keep ``reading`` (its request went out at ``sent``) as a candidate before-reading."""
        t = Timed(reading, sent, reading.at)
        with self._lock:
            self._readings.append(t)
            self._newest_sent = max(self._newest_sent, sent)
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
        return self.record(reading, sent)

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
        return self.record(reading, sent)

    def before(self, w: Window) -> Timed | None:
        """The newest reading that holds none of the call's tokens (``clean_from`` before the
        call's request went out): complete before it, or certified (:meth:`certify`)."""
        with self._lock:  # newest first, usually the first or second: no copy of all 64
            for t in reversed(self._readings):
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
            own = []
            # Newest first, and no further than the first call closed before ``before``'s
            # clean_from: it, and every call closed before it, went out before that (a call is
            # sent before it is closed), so none is an own call. Usually two windows, not 256.
            for w in reversed(self._ended):
                if w.closed <= before.clean_from:
                    break
                if before.clean_from < w.sent and w.finished <= after.sent:
                    own.append(w)
            if not own:
                return False
            tokens, last = 0, own[0].finished  # one pass, no generator frames (issue 56 §2)
            for w in own:
                if w.tokens is None:
                    return False  # an own call of unknown usage (failed, cancelled) may hold some
                tokens += w.tokens
                last = max(last, w.finished)
            if a - b != tokens:
                return False
            after.clean_from = min(after.clean_from, max(before.clean_from, last))
        return True

    def reset_after_fork(self) -> None:
        """In a forked child: fresh locks, no connections or windows of the parent's."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting = 0
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
