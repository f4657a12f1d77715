"""One cutover at a time per instance: an exclusive ``flock(2)`` on the instance's lock file.

The kernel drops the lock when its holder dies, however it dies, so a killed cutover never
leaves a stale lock behind. The holder writes its PID and what it is doing into the file, so a
second cutover's error can say who holds it.

The file is unlinked only by its holder, as the last thing before it lets go
(:meth:`InstanceLock.remove`: the last instance's purge): a lock file removed earlier would let a
second process lock a new file while the first still works. A process that opened the old file
meanwhile gets its lock only once the holder is done; :func:`hold` then sees that the path no
longer names the file it locked, and starts over on the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError
from ..fsutil import private_dir


class LockBusy(ApplianceError):
    """Another cutover or rollback of the same instance is in progress."""

    exit_code = 3


class LockUnavailable(ApplianceError):
    """The lock file cannot be created or opened (not root, or a broken state directory)."""


# Readers (`appliance status`, `history`) hold the lock shared for a few microseconds to see
# whether anyone holds it; a cutover that meets one retries for this long before it is busy.
# A real holder keeps the lock for minutes, so this only delays its LockBusy by as much.
BUSY_RETRY_S = 1.0


@dataclass
class Holder:
    """What the lock file says about the process holding it."""

    pid: int | None = None
    action: str = ""
    since: float | None = None
    entry_id: str | None = None


class InstanceLock:
    """The held lock; :meth:`note` records what the holder is doing (e.g. the history id)."""

    def __init__(self, fd: int, instance: str, action: str, path: Path) -> None:
        self._fd = fd
        self.path = path
        self.holder = Holder(os.getpid(), action, time.time())
        self.instance = instance
        self._write()

    def remove(self) -> None:
        """Unlink the lock file while still holding it: the holder's very last step."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def note(self, entry_id: str) -> None:
        self.holder.entry_id = entry_id
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.holder.__dict__).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)


@contextlib.contextmanager
def hold(path: Path, instance: str, action: str) -> Iterator[InstanceLock]:
    """Hold the instance's lock for the block, or raise :class:`LockBusy` (within
    :data:`BUSY_RETRY_S`) when another cutover or rollback holds it."""
    while True:
        fd = _open(path)
        try:
            if not _acquire(fd):
                raise _busy(instance, read_holder(path)) from None
            if _still_named(fd, path):
                yield InstanceLock(fd, instance, action, path)
                return
        finally:
            os.close(fd)  # closing the descriptor releases the flock


def refuse_if_busy(path: Path, instance: str) -> None:
    """Raise :class:`LockBusy` now when another cutover or rollback holds the lock: checked
    first, before any preflight, so the operator hears about the move in progress (and
    nothing else is asked of Docker or systemd meanwhile). Creates nothing."""
    holder = current_holder(path)
    if holder is not None:
        raise _busy(instance, holder)


def _busy(instance: str, h: Holder) -> LockBusy:
    alive = h.pid and pid_alive(h.pid)
    who = f"pid {h.pid}, {h.action}" if alive else "an unknown process"
    return LockBusy(
        f"instance {instance} is busy: a cutover or rollback is in progress ({who})",
        fix="wait for it to finish, then check `appliance status`",
    )


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` locked (its holder may have removed it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _open(path: Path) -> int:
    """The lock file's descriptor (created 0600 in a 0700 folder); LockUnavailable if not."""
    try:
        # Owner only: any user who can open the file can hold a shared flock on it, and every
        # cutover and rollback of the instance is then busy for as long as that user likes.
        private_dir(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # a lock file made by an older appliance was 0644
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise LockUnavailable(
            f"cannot open the cutover lock {path}: {exc.strerror or exc}{where}",
            fix=f"cutover and rollback need root, or write access to {path.parent}",
        ) from exc
    return fd


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts). The lock file names its
    last writer, which may be long gone while another process holds the lock without writing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _acquire(fd: int) -> bool:
    """Take the exclusive lock, retrying past readers' brief shared locks."""
    deadline = time.monotonic() + BUSY_RETRY_S
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def read_holder(path: Path) -> Holder:
    """What the lock file says (whoever held it last); empty if unreadable."""
    try:
        data = json.loads(path.read_text() or "{}")
        return Holder(**{k: data.get(k) for k in Holder.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return Holder()


def current_holder(path: Path) -> Holder | None:
    """The live holder of the lock, or ``None`` when nobody holds it now.

    It takes the lock shared for an instant (flock(2) has no way to ask without trying);
    :func:`hold` retries past that, so a reader never makes a cutover busy."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)  # at once, before anything else
        return None
    finally:
        os.close(fd)
