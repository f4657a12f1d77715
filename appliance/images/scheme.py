"""The tag scheme of appliance images.

- An image whose vLLM serves Gemma 4 MTP gets ``REPO:<vllm>-mtp``, ``REPO:mtp`` and
  ``REPO:latest``. If ``REPO:latest`` was a non-MTP image, that image keeps (gets) ``REPO:pre-mtp``
  first: the last known-good non-MTP image stays addressable for a rollback.
- An image without MTP gets ``REPO:<vllm>`` and ``REPO:pre-mtp``.
- A deliberately broken test image gets only ``REPO:<vllm>-mtp-broken``: never a floating tag.

``REPO`` is ``gemma4-vllm`` unless told otherwise. Tags are applied from the image's labels (see
:mod:`appliance.labels`), never from what the operator believes is inside.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .. import labels, versions
from ..errors import UsageError

REPOSITORY = "gemma4-vllm"
MTP_TAG = "mtp"
LATEST_TAG = "latest"
PRE_MTP_TAG = "pre-mtp"
FLOATING_TAGS = (MTP_TAG, LATEST_TAG, PRE_MTP_TAG)
# Set by the builder: which recipe made the image, and the digest of everything that went in.
BROKEN = "io.gemma4-appliance.broken"
BUILD_DIGEST = "io.gemma4-appliance.build-digest"

_REPO = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")


# The Docker engine refuses a longer repository name (distribution/reference's NameTotalLengthMax).
_REPO_MAX = 255


def check_repository(repo: str) -> str:
    if not _REPO.fullmatch(repo or ""):
        raise UsageError(f"invalid repository name {repo!r}", fix="e.g. gemma4-vllm")
    if len(repo) > _REPO_MAX:
        raise UsageError(
            f"repository name is {len(repo)} characters, more than {_REPO_MAX}",
            fix="e.g. gemma4-vllm",
        )
    return repo


def check_version(version: str) -> str:
    """``version`` if it is a version that can be part of a tag, else a UsageError."""
    try:
        versions.parse(version)
    except UsageError:
        raise UsageError(f"invalid vLLM version {version!r}", fix="e.g. 0.32.0") from None
    if not re.fullmatch(r"[0-9][0-9A-Za-z.]*", version):
        raise UsageError(f"invalid vLLM version {version!r}", fix="e.g. 0.32.0")
    return version


def version_tag(version: str, mtp: bool, broken: bool = False) -> str:
    """The image's own version (``org.opencontainers.image.version`` and its version tag)."""
    tag = f"{check_version(version)}-mtp" if mtp else check_version(version)
    return f"{tag}-broken" if broken else tag


@dataclass(frozen=True)
class TagPlan:
    """The tags the scheme gives an image, and an image that should keep ``pre-mtp`` first."""

    tags: tuple[str, ...]
    keep_pre_mtp: str | None = None  # image id of the non-MTP image leaving ``latest``


def plan_tags(
    image_labels: Mapping[str, str] | None,
    repository: str = REPOSITORY,
    current_latest: Mapping[str, str] | None = None,
    current_latest_id: str | None = None,
) -> TagPlan:
    """The scheme's tags for an image with ``image_labels`` (see the module docstring)."""
    repo = check_repository(repository)
    version = labels.vllm_version(image_labels)
    if version is None:
        raise UsageError(
            "the image has no appliance labels",
            fix=f"build it with `appliance image build` (it needs {labels.VLLM_VERSION})",
        )
    mtp = labels.supports_mtp(image_labels)
    if (image_labels or {}).get(BROKEN) == labels.TRUE:
        return TagPlan((f"{repo}:{version_tag(version, mtp, broken=True)}",))
    if not mtp:
        return TagPlan((f"{repo}:{version_tag(version, False)}", f"{repo}:{PRE_MTP_TAG}"))
    keep = None
    if current_latest_id is not None and not labels.supports_mtp(current_latest):
        keep = current_latest_id
    return TagPlan(
        (f"{repo}:{version_tag(version, True)}", f"{repo}:{MTP_TAG}", f"{repo}:{LATEST_TAG}"),
        keep_pre_mtp=keep,
    )


def apply_tags(client, image_ref: str, repository: str = REPOSITORY) -> list[str]:
    """Tag the image ``image_ref`` per the scheme in the engine; returns the tags it now has."""
    import docker.errors

    from . import refused

    try:
        image = client.images.get(image_ref)
    except docker.errors.ImageNotFound as exc:
        raise UsageError(f"no image {image_ref!r} in the local engine") from exc
    except docker.errors.APIError as exc:
        raise refused(f"look up image {image_ref!r}", exc) from exc
    latest_ref = f"{check_repository(repository)}:{LATEST_TAG}"
    try:
        latest = client.images.get(latest_ref)
    except docker.errors.ImageNotFound:
        latest = None
    except docker.errors.APIError as exc:
        raise refused(f"look up {latest_ref}", exc) from exc
    plan = plan_tags(
        image.labels,
        repository,
        latest.labels if latest is not None else None,
        latest.id if latest is not None and latest.id != image.id else None,
    )
    if plan.keep_pre_mtp is not None:
        _tag(client.images.get(plan.keep_pre_mtp), f"{repository}:{PRE_MTP_TAG}")
    for ref in plan.tags:
        _tag(image, ref)
    return sorted(client.images.get(image.id).tags)


def _tag(image, ref: str) -> None:
    """Tag ``image`` as ``ref``; the engine's refusal (e.g. a reference longer than it allows,
    which the name rules here do not check) is one line naming the reference."""
    import docker.errors

    from . import refused

    repo, tag = ref.rsplit(":", 1)
    try:
        image.tag(repo, tag)
    except docker.errors.APIError as exc:
        raise refused(
            f"tag {image.short_id} as {ref}",
            exc,
            fix=f"check --repository and the image's {labels.VLLM_VERSION} label",
        ) from exc
