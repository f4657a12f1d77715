"""The rollback slot: the image ``appliance rollback`` returns to (kept by image pruning),
written by a cutover and put back as it was when the cutover does not end on the new image.

It keeps the image's reference as the env file named it and, since tags move (``appliance image
build`` moves ``latest``, a rebuild moves a version tag), the image ID it named then: a rollback
goes to that ID when the reference names another image by then (:func:`appliance.cutover.
recovery.rollback`). A slot written before the ID was kept has only the reference.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..fsutil import write_atomic
from ..host.layout import Layout


@dataclass(frozen=True)
class Slot:
    """The way back: ``image`` as the env file named it, ``image_id`` what it named then (None
    in a slot written by an older appliance, or when the image could not be inspected)."""

    image: str
    image_id: str | None = None


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read(layout: Layout, instance: str) -> Slot | None:
    """The rollback slot of ``instance`` (None when there is none, or it cannot be read)."""
    data = _read(layout.rollback_slot(instance))
    if not isinstance(data, dict) or not isinstance(data.get("image"), str) or not data["image"]:
        return None
    image_id = data.get("image_id")
    return Slot(data["image"], image_id if isinstance(image_id, str) and image_id else None)


def rollback_image(layout: Layout, instance: str) -> str | None:
    """The image ``appliance rollback INSTANCE`` would return to (the rollback slot)."""
    found = read(layout, instance)
    return found.image if found else None


def write(
    layout: Layout, instance: str, image: str, entry_id: str, image_id: str | None = None
) -> None:
    data = {"image": image, "image_id": image_id, "recorded": time.time(), "entry": entry_id}
    write_atomic(layout.rollback_slot(instance), json.dumps(data) + "\n", mode=0o644)


def restore(slot_path: Path, before: bytes | None) -> None:
    if before is None:
        slot_path.unlink(missing_ok=True)
    else:
        write_atomic(slot_path, before)
