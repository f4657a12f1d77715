"""Small file helpers for the image builder: atomic writes and content digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..fsutil import write_atomic


def write_text_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` atomically (see :mod:`appliance.fsutil`)."""
    write_atomic(path, text, mode=mode)


def digest(*parts: bytes | str) -> str:
    """A short, stable SHA-256 over ``parts`` (the images' cache keys)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:16]
