"""Small file helpers for the image builder: content digests, a per-machine lock (writes:
appliance.fsutil)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path


def digest(*parts: bytes | str) -> str:
    """A short, stable SHA-256 over ``parts`` (the images' cache keys)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def held(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if missing), waiting for it: two builds
    on one machine make each cached input once, the second finds it made."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
