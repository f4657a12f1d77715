"""The rollback slot: the image ``appliance rollback`` returns to (kept by image pruning),
written by a cutover and put back as it was when the cutover does not end on the new image."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..fsutil import write_atomic
from ..host.layout import Layout


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rollback_image(layout: Layout, instance: str) -> str | None:
    """The image ``appliance rollback INSTANCE`` would return to (the rollback slot)."""
    slot = _read(layout.rollback_slot(instance))
    return slot.get("image") if isinstance(slot, dict) else None


def write(layout: Layout, instance: str, image: str, entry_id: str) -> None:
    data = {"image": image, "recorded": time.time(), "entry": entry_id}
    write_atomic(layout.rollback_slot(instance), json.dumps(data) + "\n", mode=0o644)


def restore(slot_path: Path, before: bytes | None) -> None:
    if before is None:
        slot_path.unlink(missing_ok=True)
    else:
        write_atomic(slot_path, before)
