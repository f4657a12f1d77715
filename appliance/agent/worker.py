"""The agent's one background thread: after-reads at once, the work that waits on them in batches.

The after-read, and everything that waits on it (figures, span end, metrics, ``on_call``), runs
on :data:`WORKER`, off the caller's path: the caller neither reads nor sends anything for it (a
request sent from the caller's thread as its call ends was measured at 1.4-2.4 ms there on a
2-core host: the server woken to render the page takes the caller's CPU). The after-read runs as
soon as it is queued; a call's span end, metrics and record are handed over with no wake
(:meth:`Worker.defer`: at the call's end when its figures need no read, after its after-read
otherwise) and run in batches, every ``DRAIN_S`` or ``DRAIN_BATCH`` calls and at
:meth:`Worker.flush`, in the order they were handed over. Batches because that work is cheap hot
and dear cold: one call's span end and metrics on a thread that slept since the last call cost
three to four times what they cost a few calls into a batch (issue 56 §2). At interpreter exit
the queued work is flushed, bounded, ahead of tracer providers' own shutdown
(:func:`register_exit_flush`); a forked child starts with an empty queue and fresh locks.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("appliance.agent")


class Worker:
    """One daemon thread running the agent's reads at once and the work that waits on them in
    batches, in the order it was handed over.

    Bounded: :meth:`offer` refuses work past ``MAX_BACKLOG`` queued jobs (the call then gets
    ``unknown``/``skipped`` figures, counted as ``gemma4_agent_errors_total{kind="backlog"}``).
    ``put`` is a ``queue.SimpleQueue.put``: reentrant, so a garbage-collection finalizer may call
    it while the interrupted thread holds any lock (it takes none of the agent's); those jobs are
    tiny and network-free. Exit: :func:`_exit_flush` runs at interpreter exit, registered again
    whenever a client is instrumented or the thread starts, so it runs before the ``atexit``
    shutdown of any tracer provider created earlier. Fork: the child starts with an empty queue
    and fresh locks (:meth:`reset_after_fork`); the parent's queued jobs stay the parent's.
    """

    MAX_BACKLOG = 512
    DRAIN_S = 1.0  # deferred work waits at most about this long
    DRAIN_BATCH = 64  # or until this many calls are waiting
    SLEEP_AFTER_S = 1.0  # with nothing deferred this long, the thread sleeps until woken

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._deferred: collections.deque[Callable[[], None]] = collections.deque()
        self._sleeping = False  # blocked with no timeout: a defer must wake it
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._pid = os.getpid()

    def reset_after_fork(self) -> None:
        """In a forked child: an empty queue, no thread, a fresh lock."""
        self._q, self._thread, self._start_lock = queue.SimpleQueue(), None, threading.Lock()
        self._deferred, self._sleeping = collections.deque(), False
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

    def offer(self, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` unless the backlog is full (False: the caller degrades and counts it)."""
        if self._q.qsize() >= self.MAX_BACKLOG:
            return False
        # A daemon: alive once started. No os.getpid() here (a system call on every call, as
        # costly as the rest of a hand-over on the caller's thread, issue 56 §2): a fork
        # empties _thread in the child (reset_after_fork, an at-fork hook), so the child's
        # first call starts a thread of its own.
        if self._thread is None:
            self.start()
        self._q.put(fn)
        return True

    def put(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def defer(self, fn: Callable[[], None]) -> bool:
        """Hand ``fn`` over without waking the thread (it runs with its batch: at the next tick,
        ``DRAIN_S`` after the last, when ``DRAIN_BATCH`` wait, or at :meth:`flush`); False when
        the backlog is full (the caller then runs it itself). The thread is woken only when it
        sleeps (idle ``SLEEP_AFTER_S``) or the batch is full."""
        if len(self._deferred) >= self.MAX_BACKLOG:
            return False
        if self._thread is None:  # as in offer: a forked child's is emptied
            self.start()
        self._deferred.append(fn)
        if self._sleeping:
            self._sleeping = False
            self._q.put(_nothing)
        elif len(self._deferred) == self.DRAIN_BATCH:
            self._q.put(_nothing)  # a full batch: drain now, not at the next tick
        return True

    def _drain(self) -> None:
        deferred = self._deferred
        while deferred:
            try:
                deferred.popleft()()
            except BaseException:
                log.debug("agent background job failed", exc_info=True)

    def _run(self) -> None:
        # Polled only for deferred work: a queued job wakes the thread itself. Deferred work
        # runs in batches (at a tick, a full batch or a flush), so that a queued job (an
        # after-read) runs at once and the spans, metrics and records run together; the idle
        # time counts from the last drain, after which the thread sleeps with no timed
        # wake-ups until work comes (issue 56 §2).
        drained = time.monotonic()
        while True:
            if self._sleeping:
                timeout = None
            else:  # the next tick, or with nothing deferred the time to sleep
                wait = self.DRAIN_S if self._deferred else self.SLEEP_AFTER_S
                timeout = max(0.0, drained + wait - time.monotonic())
            try:
                fn = self._q.get(timeout=timeout)
            except queue.Empty:
                fn = None
            if self._deferred:
                if (
                    fn is None
                    or isinstance(fn, _Flush)
                    or len(self._deferred) >= self.DRAIN_BATCH
                    or time.monotonic() - drained >= self.DRAIN_S
                ):
                    self._drain()
                    drained = time.monotonic()
            elif not self._sleeping and time.monotonic() - drained >= self.SLEEP_AFTER_S:
                self._sleep()
            if fn is not None:
                try:
                    fn()
                except BaseException:
                    log.debug("agent background job failed", exc_info=True)

    def _sleep(self) -> None:
        # First the flag, then the check: a defer that ran before the flag was set is seen
        # here, one after it sees the flag and wakes the thread.
        self._sleeping = True
        if self._deferred:
            self._sleeping = False

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued or deferred so far has run; False if ``timeout``
        passed first."""
        if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
            return self._q.empty() and not self._deferred
        if threading.current_thread() is self._thread:
            return False  # called from a job (an on_call callback): waiting on itself
        done = _Flush()
        self._q.put(done)
        return done.wait(timeout)


def _nothing() -> None:
    """The job that wakes a sleeping thread to drain what was deferred."""


class _Flush(threading.Event):
    """A flush's job: everything deferred before it is drained first, then it is set."""

    def __call__(self) -> None:
        self.set()


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
os.register_at_fork(after_in_child=WORKER.reset_after_fork)
