"""Removing appliance images, and the images that no command ever removes.

Protected, in every mode: an image that an instance's env file, a rollback slot or a cutover's
saved env file refers to (resolved to an image id at prune time, so a tag that moved does not
fool it), and the image tagged ``pre-mtp`` or ``pre-mtp-cpu`` (the last known-good image
without MTP). Nothing is forced: an image a container still uses makes the engine refuse, and
that is reported as kept.

Modes, each a superset of the one before:

- ``dangling``: appliance images with no tag left (a rebuild moved the tags away);
- ``superseded``: also images of the repository whose only tags there are version tags (no
  ``mtp``/``latest``/``pre-mtp``, nor their ``-cpu`` forms);
- ``all``: every image of the repository (only its tags in that repository are removed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from . import refused, scheme
from .inventory import ImageInfo, list_images

MODES = ("dangling", "superseded", "all")


@dataclass
class PruneResult:
    """What a prune removed (or would remove, for a dry run) and what it kept, with why."""

    removed: list[ImageInfo] = field(default_factory=list)
    kept: list[tuple[ImageInfo, str]] = field(default_factory=list)
    dry_run: bool = False


def protection(image: ImageInfo, repository: str) -> str | None:
    """Why ``image`` must never be removed, or None."""
    if image.references:
        r = image.references[0]
        more = f" (+{len(image.references) - 1} more)" if len(image.references) > 1 else ""
        return f"referenced by {r.source} of instance {r.instance}: {r.ref}{more}"
    for tag in (scheme.PRE_MTP_TAG, scheme.PRE_MTP_TAG + scheme.CPU_SUFFIX):
        if f"{repository}:{tag}" in image.tags:
            return f"tagged {repository}:{tag} (last known-good non-MTP image)"
    return None


def _own_tags(image: ImageInfo, repository: str) -> list[str]:
    return [t for t in image.tags if t.rsplit(":", 1)[0] == repository]


def _selected(image: ImageInfo, mode: str, repository: str) -> bool:
    """Only untagged images or images tagged in ``repository``: other repositories' images
    (another appliance checkout's, a test's) are never this prune's business."""
    if not image.tags:
        return True
    own = _own_tags(image, repository)
    if not own:
        return False
    if mode == "all":
        return True
    if mode == "superseded":
        floating = {f"{repository}:{t}" for t in scheme.ALL_FLOATING_TAGS}
        return not floating.intersection(own)
    return False


def prune(
    client,
    root: Path = Path("/"),
    mode: str = "dangling",
    repository: str = scheme.REPOSITORY,
    dry_run: bool = False,
) -> PruneResult:
    """Remove the appliance images ``mode`` selects, except protected ones."""
    import docker.errors

    if mode not in MODES:
        raise UsageError(f"unknown prune mode {mode!r}", fix=f"use one of {', '.join(MODES)}")
    images, _missing = list_images(client, root, repository)
    result = PruneResult(dry_run=dry_run)
    for image in images:
        if not _selected(image, mode, repository):
            continue
        why = protection(image, repository)
        if why is not None:
            result.kept.append((image, why))
            continue
        if dry_run:
            result.removed.append(image)
            continue
        try:
            # One tag at a time, never force: removing by id with several tags needs force,
            # and force would also untag images a container uses.
            # Only this repository's tags: an image also tagged elsewhere stays, untagged here.
            for tag in _own_tags(image, repository):
                client.images.remove(tag, force=False, noprune=False)
            if not image.tags:
                client.images.remove(image.id, force=False, noprune=False)
        except docker.errors.APIError as exc:
            result.kept.append((image, f"the engine refused: {exc.explanation or exc}"))
            continue
        result.removed.append(image)
    return result


def remove(client, ref: str, root: Path = Path("/"), repository: str = scheme.REPOSITORY) -> str:
    """Remove one image by reference unless protected; returns its id."""
    from .inventory import resolve

    image_id = resolve(client, ref)
    if image_id is None:
        raise UsageError(f"no image {ref!r} in the local engine")
    images, _ = list_images(client, root, repository)
    info = next((i for i in images if i.id == image_id), None)
    why = protection(info, repository) if info is not None else None
    if why is not None:
        raise UsageError(f"refusing to remove {ref}: {why}")
    import docker.errors

    try:
        # Never forced, like prune: a container's image or a shared image id stays.
        client.images.remove(ref, force=False, noprune=False)
    except docker.errors.APIError as exc:
        raise refused(
            f"remove {ref}", exc, fix=_removal_fix(ref, str(exc.explanation or exc))
        ) from exc
    return image_id


def _removal_fix(ref: str, why: str) -> str | None:
    if "container" in why:
        return f"remove the containers that use it first: docker ps -a --filter ancestor={ref}"
    if "multiple repositories" in why:
        return "remove it by tag, one tag at a time (appliance image list shows them)"
    return None
