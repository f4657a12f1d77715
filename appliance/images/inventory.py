"""Which appliance images the engine holds, and which instance refers to which image.

References come from the host's files under an optional ``root`` (tests use a temporary one):

- ``etc/gemma4-vllm/<instance>.env``: the ``VLLM_IMAGE`` the unit runs (source ``env``);
- ``var/lib/gemma4-appliance/rollback/<instance>.json``: the rollback slot, every image named
  in it (source ``rollback``);
- ``var/lib/gemma4-appliance/cutover/<instance>.env.prev``: the env file saved by a cutover in
  progress (source ``saved-env``).

Paths are the cutover's (:class:`appliance.host.layout.Layout`): one layout, two readers.
Every referenced image is protected from pruning (:mod:`appliance.images.prune`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..host.layout import Layout
from ..oci import labels
from . import scheme

IMAGE_KEY = "VLLM_IMAGE"


@dataclass(frozen=True)
class Reference:
    """One file's reference to an image."""

    instance: str
    source: str  # "env", "rollback" or "saved-env"
    ref: str
    path: Path


@dataclass
class ImageInfo:
    """One image in the engine, with its labels and who refers to it."""

    id: str
    tags: list[str]
    labels: dict[str, str]
    size_bytes: int
    created: str
    references: list[Reference] = field(default_factory=list)

    @property
    def short_id(self) -> str:
        return self.id.split(":", 1)[-1][:12]

    @property
    def vllm_version(self) -> str | None:
        return labels.vllm_version(self.labels)

    @property
    def mtp(self) -> bool:
        return labels.supports_mtp(self.labels)

    @property
    def variant(self) -> str | None:
        """``cpu`` or ``cuda`` (the ``io.gemma4-appliance.variant`` label), None when unlabelled."""
        return labels.variant(self.labels)

    @property
    def used_by(self) -> list[str]:
        """Instances whose env file runs this image."""
        return sorted({r.instance for r in self.references if r.source == "env"})

    @property
    def rollback_for(self) -> list[str]:
        return sorted({r.instance for r in self.references if r.source != "env"})


def _env_value(path: Path, key: str) -> str | None:
    """``key``'s value in a systemd EnvironmentFile (last assignment wins, quotes stripped)."""
    value = None
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, rest = line.strip().partition("=")
        if sep and name.strip() == key:
            rest = rest.strip()
            if len(rest) >= 2 and rest[0] == rest[-1] and rest[0] in "\"'":
                rest = rest[1:-1]
            value = rest
    return value or None


def _images_in_json(data: object, key: str = "") -> list[str]:
    """Every string under a key naming an image, anywhere in a JSON document."""
    if isinstance(data, dict):
        return [ref for k, v in data.items() for ref in _images_in_json(v, str(k))]
    if isinstance(data, list):
        return [ref for v in data for ref in _images_in_json(v, key)]
    if isinstance(data, str) and "image" in key.lower() and data.strip():
        return [data.strip()]
    return []


def references(root: Path = Path("/")) -> list[Reference]:
    """Every image reference in the instances' env files, rollback slots and what a cutover
    saved (env file, slot)."""
    layout = Layout(Path(root))
    refs: list[Reference] = []
    for path in sorted(layout.env_dir.glob("*.env")):
        value = _env_value(path, IMAGE_KEY)
        if value:
            refs.append(Reference(path.name[: -len(".env")], "env", value, path))
    for path in sorted((layout.state_dir / "rollback").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            # Unreadable slot: nothing to protect by name, but say so rather than guess.
            continue
        for value in _images_in_json(data):
            refs.append(Reference(path.stem, "rollback", value, path))
    for path in sorted((layout.state_dir / "cutover").glob("*.env.prev")):
        value = _env_value(path, IMAGE_KEY)
        if value:
            refs.append(Reference(path.name[: -len(".env.prev")], "saved-env", value, path))
    # The slot a killed cutover's recovery puts back (empty when there was none).
    for path in sorted((layout.state_dir / "cutover").glob("*.slot.prev")):
        try:
            data = json.loads(path.read_text() or "null")
        except (OSError, ValueError):
            continue
        for value in _images_in_json(data):
            refs.append(Reference(path.name[: -len(".slot.prev")], "saved-slot", value, path))
    return refs


def resolve(client, ref: str) -> str | None:
    """The image id ``ref`` names in the engine, or None when it has no such image."""
    import docker.errors

    try:
        return client.images.get(ref).id
    except (docker.errors.ImageNotFound, docker.errors.APIError):
        return None


def is_appliance_image(image_labels: dict[str, str] | None) -> bool:
    return labels.vllm_version(image_labels) is not None


def list_images(
    client, root: Path = Path("/"), repository: str = scheme.REPOSITORY
) -> tuple[list[ImageInfo], list[Reference]]:
    """Appliance images (labelled, or tagged in ``repository``, or referenced by an instance),
    newest first, and the references that name no image in the engine."""
    refs = references(root)
    by_id: dict[str, list[Reference]] = {}
    missing: list[Reference] = []
    for r in refs:
        image_id = resolve(client, r.ref)
        if image_id is None:
            missing.append(r)
        else:
            by_id.setdefault(image_id, []).append(r)
    out: list[ImageInfo] = []
    for image in client.images.list():
        image_labels = dict(image.labels or {})
        tags = sorted(image.tags)
        ours = is_appliance_image(image_labels) or any(
            t.rsplit(":", 1)[0] == repository for t in tags
        )
        if not ours and image.id not in by_id:
            continue
        out.append(
            ImageInfo(
                id=image.id,
                tags=tags,
                labels=image_labels,
                size_bytes=int(image.attrs.get("Size") or 0),
                created=str(image.attrs.get("Created") or ""),
                references=by_id.get(image.id, []),
            )
        )
    out.sort(key=lambda i: i.created, reverse=True)
    return out, missing
