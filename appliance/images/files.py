"""Small file helpers for the image builder: content digests (writes: appliance.fsutil)."""

from __future__ import annotations

import hashlib


def digest(*parts: bytes | str) -> str:
    """A short, stable SHA-256 over ``parts`` (the images' cache keys)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:16]
