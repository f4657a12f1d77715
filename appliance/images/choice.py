"""The image a new instance gets when the operator names none.

The version tag of the newest appliance image on this host of the profile's build (CPU or CUDA:
its ``io.gemma4-appliance.variant`` label), serving Gemma 4 MTP when the profile asks for it:
newest by vLLM version, then by creation. A version tag, not ``latest``: ``appliance image
build`` moves ``latest``, and the next plain restart would run the new engine ungated
(gotchas/cutover-raw-path.md). With no such image here (or no Docker to ask) the build's
``latest`` (``gemma4-vllm:latest``, ``gemma4-vllm:latest-cpu``) stays the default, and the
warning says to build or load an image and cut over to its version tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine_api import versions
from ..errors import UsageError
from ..oci import labels
from . import scheme


@dataclass(frozen=True)
class Choice:
    """The image chosen, and the warning that goes with a floating default (None: a version
    tag found on the host)."""

    ref: str
    warning: str | None = None


def fallback(device: str, repository: str = scheme.REPOSITORY) -> str:
    """The build's ``latest`` tag: the default when the host has no image to choose from."""
    return f"{repository}:{scheme.latest_tag(device)}"


def newest(client, device: str, mtp: bool, repository: str = scheme.REPOSITORY) -> str | None:
    """The version tag of the newest appliance image of build ``device`` in the engine (only
    MTP images when ``mtp``); None when there is none (broken test images never count)."""
    found = []
    for image in client.images.list(filters={"label": f"{labels.VARIANT}={device}"}):
        have = dict(image.labels or {})
        version = labels.vllm_version(have)
        if version is None or have.get(scheme.BROKEN) == labels.TRUE:
            continue
        if mtp and not labels.supports_mtp(have):
            continue
        ref = scheme.version_ref(have, repository)
        if ref is None or ref not in image.tags:
            continue
        try:
            key = versions.release(version)
        except UsageError:
            continue
        found.append((key, str(image.attrs.get("Created") or ""), ref))
    return max(found)[2] if found else None


def default_image(client, device: str, mtp: bool, profile: str) -> Choice:
    """What a new instance of ``profile`` (build ``device``, asking for MTP when ``mtp``) runs
    when no image is named; ``client`` None: no Docker to ask (the fallback, with a warning)."""
    ref = newest(client, device, mtp) if client is not None else None
    if ref is not None:
        return Choice(ref)
    where = "on this host" if client is not None else "(no Docker engine answered)"
    floating = fallback(device)
    return Choice(
        floating,
        warning=f"no {device} appliance image {where} for profile {profile}: VLLM_IMAGE="
        f"{floating}, a tag `appliance image build` moves (the next restart would run the new "
        "engine ungated); build or load the image, then `appliance cutover` to its version tag",
    )
