"""The tag scheme of appliance images.

The CUDA image (``docker/Dockerfile``) is the product; a CPU image (``docker/cpu``, the real engine
the tests and the demo run) gets the same tags with ``-cpu`` appended, so no tag ever names both
builds and an operator's ``gemma4-vllm:latest`` is never a CPU engine on a GPU host:

- An image whose vLLM serves Gemma 4 MTP gets ``REPO:<vllm>-mtp``, ``REPO:mtp`` and
  ``REPO:latest`` (CPU: ``REPO:<vllm>-mtp-cpu``, ``REPO:mtp-cpu``, ``REPO:latest-cpu``). If
  ``latest`` (``latest-cpu``) was a non-MTP image, that image keeps (gets) ``pre-mtp``
  (``pre-mtp-cpu``) first: the last known-good non-MTP image stays addressable for a rollback.
- An image without MTP gets ``REPO:<vllm>`` and ``REPO:pre-mtp`` (CPU: ``REPO:<vllm>-cpu``,
  ``REPO:pre-mtp-cpu``).
- A deliberately broken test image gets only ``REPO:<vllm>-mtp-broken`` (CPU:
  ``REPO:<vllm>-mtp-broken-cpu``): never a floating tag.

Which build an image is, is its ``io.gemma4-appliance.variant`` label (:data:`labels.VARIANT`),
not its tag; an image without that label (made by hand) is tagged as the product's, as before
the variants had tags of their own. The image's own version (``org.opencontainers.image.version``)
is the engine's, the same for both builds (``0.32.0-mtp``).

``mtp``, ``latest`` and ``pre-mtp`` (and their ``-cpu`` forms) are *floating*: the next
``appliance image build`` moves them. A cutover to one is refused without ``--force``
(:func:`floating`), since the next plain restart would run whatever the tag points at then,
ungated; the version tag names the image instead (it moves only when the same version is rebuilt
from changed inputs, and the rollback slot keeps the image ID: ``appliance/cutover/slot.py``).

``REPO`` is ``gemma4-vllm`` unless told otherwise. Tags are applied from the image's labels (see
:mod:`appliance.oci.labels`), never from what the operator believes is inside.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..engine_api import versions
from ..errors import UsageError
from ..oci import labels

REPOSITORY = "gemma4-vllm"
MTP_TAG = "mtp"
LATEST_TAG = "latest"
PRE_MTP_TAG = "pre-mtp"
# Appended to every tag of a CPU image.
CPU_SUFFIX = "-cpu"
FLOATING_TAGS = (MTP_TAG, LATEST_TAG, PRE_MTP_TAG)
# Every tag the scheme moves, in both builds' spellings.
ALL_FLOATING_TAGS = (*FLOATING_TAGS, *(t + CPU_SUFFIX for t in FLOATING_TAGS))
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


def image_version(version: str, mtp: bool, broken: bool = False) -> str:
    """The image's own version (``org.opencontainers.image.version``): the engine's, the same
    for both builds."""
    tag = f"{check_version(version)}-mtp" if mtp else check_version(version)
    return f"{tag}-broken" if broken else tag


def suffix(variant: str | None) -> str:
    """What the scheme appends to each tag of an image of ``variant`` (``-cpu`` or nothing)."""
    return CPU_SUFFIX if variant == "cpu" else ""


def version_tag(version: str, mtp: bool, broken: bool = False, variant: str | None = None) -> str:
    """The image's version tag: its own version, with ``-cpu`` for a CPU build."""
    return image_version(version, mtp, broken) + suffix(variant)


def floating(ref: str) -> bool:
    """True when ``ref`` names an image by a tag the scheme moves (``mtp``, ``latest``,
    ``pre-mtp``, their ``-cpu`` forms, in any repository), or by no tag at all (Docker reads
    that as ``latest``). A digest or an image ID is never floating."""
    if "@" in ref or ref.startswith("sha256:"):
        return False
    last = ref.rsplit("/", 1)[-1]
    tag = last.rsplit(":", 1)[1] if ":" in last else LATEST_TAG
    return tag in ALL_FLOATING_TAGS


def version_ref(image_labels: Mapping[str, str] | None, ref: str) -> str | None:
    """The version tag, in ``ref``'s repository, of the image with ``image_labels`` (None when
    the image is not labelled as an appliance image)."""
    version = labels.vllm_version(image_labels)
    if version is None:
        return None
    try:
        tag = version_tag(
            version,
            labels.supports_mtp(image_labels),
            (image_labels or {}).get(BROKEN) == labels.TRUE,
            labels.variant(image_labels),
        )
    except UsageError:
        return None
    return f"{repository_of(ref)}:{tag}"


def repository_of(ref: str) -> str:
    """``ref`` without its tag or digest."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    last = last.split(":", 1)[0]
    return f"{head}/{last}" if head else last


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
    """The scheme's tags for an image with ``image_labels`` (see the module docstring);
    ``current_latest``: the labels of the image its variant's ``latest`` names now."""
    repo = check_repository(repository)
    version = labels.vllm_version(image_labels)
    if version is None:
        raise UsageError(
            "the image has no appliance labels",
            fix=f"build it with `appliance image build` (it needs {labels.VLLM_VERSION})",
        )
    mtp = labels.supports_mtp(image_labels)
    variant = labels.variant(image_labels)
    end = suffix(variant)
    if (image_labels or {}).get(BROKEN) == labels.TRUE:
        return TagPlan((f"{repo}:{version_tag(version, mtp, True, variant)}",))
    if not mtp:
        return TagPlan(
            (f"{repo}:{version_tag(version, False, False, variant)}", f"{repo}:{PRE_MTP_TAG}{end}")
        )
    keep = None
    if current_latest_id is not None and not labels.supports_mtp(current_latest):
        keep = current_latest_id
    return TagPlan(
        (
            f"{repo}:{version_tag(version, True, False, variant)}",
            f"{repo}:{MTP_TAG}{end}",
            f"{repo}:{LATEST_TAG}{end}",
        ),
        keep_pre_mtp=keep,
    )


def latest_tag(variant: str | None) -> str:
    """The ``latest`` tag of ``variant``'s images (``latest`` or ``latest-cpu``)."""
    return LATEST_TAG + suffix(variant)


def pre_mtp_tag(variant: str | None) -> str:
    """The ``pre-mtp`` tag of ``variant``'s images (``pre-mtp`` or ``pre-mtp-cpu``)."""
    return PRE_MTP_TAG + suffix(variant)


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
    variant = labels.variant(image.labels)
    latest_ref = f"{check_repository(repository)}:{latest_tag(variant)}"
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
        _tag(client.images.get(plan.keep_pre_mtp), f"{repository}:{pre_mtp_tag(variant)}")
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
