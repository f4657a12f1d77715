"""Ctrl-C, SIGTERM and an SSH hang-up during a cutover become its way back, not a stranded
instance.

The gates can wait up to ten minutes, and an operator's session does not always last that long.
While a cutover holds its instance, SIGINT, SIGTERM and SIGHUP are caught:

- ``raise`` (the restart and the gates): the first signal raises :class:`Interrupted` where the
  cutover is, which the flow treats as a failed gate (write the saved env file back, restart,
  gate the old image);
- ``defer`` (a few file writes that must not be cut in half): the signal is kept and raised at
  the next :meth:`Guard.arm`;
- ``hold`` (the way back itself): the signal is noted and ignored, so a second Ctrl-C or the
  hang-up that follows a first signal cannot strand the instance half-way back.

SIGKILL and power loss cannot be caught: ``appliance status`` reads what the cutover wrote and
prints the one recovery command (``appliance rollback INSTANCE``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
Mode = Literal["raise", "defer", "hold"]


class Interrupted(BaseException):
    """A cutover was interrupted by ``name``. A BaseException, so that no ``except Exception``
    on the way (an HTTP client, a probe) swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.gates: list | None = None  # the gates up to the interruption, when known
        super().__init__(f"interrupted by {self.name}")


class Guard:
    """The handlers installed by :func:`guard`; switch modes as the cutover moves on."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.mode: Mode = "raise"
        self.pending: int | None = None
        self.until: float | None = None  # when the way back ends at the latest
        self.received: list[str] = []
        self._note = note

    def arm(self) -> None:
        """Raise from now on; a signal deferred meanwhile is raised at once."""
        self.mode = "raise"
        if self.pending is not None:
            signum, self.pending = self.pending, None
            self.mode = "hold"
            raise Interrupted(signum)

    def defer(self) -> None:
        self.mode = "defer"

    def hold(self, within: float | None = None) -> None:
        """Ignore signals from now on; ``within``: the seconds the way back may still take
        (said to whoever sends one)."""
        self.mode = "hold"
        self.until = None if within is None else time.monotonic() + within

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        if signum == signal.SIGHUP:
            _detach_terminal()
        if self.mode == "raise":
            # Only the first one interrupts: what follows is the way back.
            self.mode = "hold"
            raise Interrupted(signum)
        if self.mode == "defer":
            if self.pending is None:
                self.pending = signum
            return
        bound = ""
        if self.until is not None:
            left = max(0.0, self.until - time.monotonic())
            bound = f" (it ends within {left:.0f} s, the --timeout)"
        self._say(f"{name} received while returning to a safe state: ignored, going on{bound}")

    def _say(self, msg: str) -> None:
        # After a hang-up the terminal is gone: a write fails with EIO, never the cutover.
        with contextlib.suppress(Exception):
            self._note(msg)


def _detach_terminal() -> None:
    """After a hang-up, point stdout and stderr that were a terminal at /dev/null (what nohup
    does), so that no later write, down to the exit's error line, fails with EIO. Pipes and
    files (a log) are kept."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                if stat.S_ISCHR(os.fstat(fd).st_mode) and not os.path.samestat(
                    os.fstat(fd), os.fstat(null)
                ):
                    os.dup2(null, fd)
    finally:
        os.close(null)


@contextlib.contextmanager
def guard(note: Callable[[str], None] = lambda _m: None) -> Iterator[Guard]:
    """Catch SIGINT, SIGTERM and SIGHUP for the block (only in the main thread, where Python
    delivers signals; elsewhere the guard changes nothing)."""
    g = Guard(note)
    if threading.current_thread() is not threading.main_thread():
        yield g
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, g._handle)
    try:
        yield g
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
