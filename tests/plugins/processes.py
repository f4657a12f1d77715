"""Processes as /proc shows them, for tests that signal a program at a given moment: whether it
has its own handler for a signal yet, its children, whether it holds a socket.

Plain functions (no fixtures): a test imports them from ``plugins.processes``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.002


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether ``pid`` has its own handler for ``sig`` (Python's or a Go runtime's)."""
    caught = _status(pid).get("SigCgt")
    return caught is not None and bool(int(caught, 16) & (1 << (sig - 1)))


def holds_socket(pid: int) -> bool:
    """Whether ``pid`` has a socket open (a docker client: its connection to the daemon)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def signal_state(pid: int) -> str:
    """``pid``'s blocked, ignored and caught signal masks, for a failure's message."""
    status = _status(pid)
    if not status:
        return f"process {pid} is gone"
    return ", ".join(f"{key} {status.get(key, '?')}" for key in ("SigBlk", "SigIgn", "SigCgt"))


def until(ready: Callable[[], bool], timeout: float) -> bool:
    """Poll ``ready`` every couple of milliseconds; whether it came true within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
