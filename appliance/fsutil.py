"""Atomic file writes: the one way the appliance replaces a file.

A reader (systemd, Prometheus, an operator's editor, the next command after a crash) sees the old
content or the new content, never a partial file: write a temporary file in the same directory,
set its mode before any data (a secret is never readable by others), fsync, rename over the
target, then fsync the directory so the rename itself survives a power cut.

A writer killed between its temporary file and the rename (SIGKILL, the OOM killer, systemd's
final kill) cannot clean up: its pid is in the temporary file's name, and the next write of the
same file removes those whose writer is gone.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import UsageError


def private_dir(path: Path | str) -> Path:
    """``path`` as a directory only its owner may enter (0700), created with its parents; an
    existing one is tightened (a looser one lets other users read what it holds)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def check_target(path: Path | str, option: str, *, directory: bool = False) -> Path:
    """Refuse, before any work, an output ``path`` that cannot be written: a folder where a file
    goes (or a file where a folder goes), a file in the way of its parents, or a place no file
    can be made (``/proc``, a read-only mount, another user's folder). Probes by creating and
    removing a temporary file in the nearest existing folder: as root, permission bits say
    nothing about /proc or a read-only mount. Writes nothing that stays."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file, not a folder", fix="name a folder")
    if not directory and path.is_dir():
        raise UsageError(f"{option} {path} is a folder", fix="give a file name in it")
    nearest = path if directory and path.is_dir() else path.parent
    while not nearest.exists() and not nearest.is_symlink():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise UsageError(
            f"{option} {path}: {nearest} is not a folder", fix="choose a path in a folder"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=nearest, prefix=".appliance-probe.")
    except OSError as exc:
        raise UsageError(
            f"{option} {path}: cannot write in {nearest} ({exc.strerror})",
            fix="choose a path in a writable folder",
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path


def shared_dir(path: Path | str, *, top: Path | str | None = None) -> Path:
    """``path`` as a folder other users may read (0755), created with its parents whatever the
    umask; ``path`` and the folders between it and ``top`` (itself included) get at least
    0755, for a reader that runs as another user (node_exporter)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
    if top is not None:
        for folder in path.parents:
            if not folder.is_relative_to(top):
                break
            if folder.stat().st_mode & 0o755 != 0o755:
                folder.chmod(folder.stat().st_mode | 0o755)
    return path


def write_atomic(path: Path | str, data: bytes | str, *, mode: int | None = None) -> Path:
    """Replace ``path`` with ``data``; ``mode`` defaults to the existing file's mode, else 0644.

    An existing file's owner is kept when running as root. Parent directories are created.
    """
    if isinstance(data, str):
        data = data.encode()
    with atomic_writer(path, mode=mode) as f:
        f.write(data)
    return Path(path)


@contextlib.contextmanager
def atomic_writer(path: Path | str, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """A file to stream ``path``'s new content into, renamed over ``path`` when the block ends
    without an exception (removed otherwise, Ctrl-C included). Mode and owner as
    :func:`write_atomic`."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    if mode is None:
        mode = (st.st_mode & 0o7777) if st else 0o644
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            # Only when it differs: a chown to oneself changes nothing, and the units' seccomp
            # filter (~@privileged) refuses every chown, so the state timer's second run failed.
            if (
                st is not None
                and os.geteuid() == 0
                and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid())
            ):
                os.fchown(f.fileno(), st.st_uid, st.st_gid)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path | str) -> None:
    """Sync folder ``path``: a file created or renamed in it survives a power cut only then."""
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_orphans(path: Path) -> None:
    """Remove the temporary files of ``path``'s killed writers (their pid no longer runs)."""
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True
