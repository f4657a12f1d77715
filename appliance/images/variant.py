"""Does an image's build (CPU or CUDA) fit a profile's device?

One judgement for every place an image is chosen: ``appliance instance install --image``, the
cutover's preflight, ``appliance status`` and ``appliance host check``. The build is the image's
``io.gemma4-appliance.variant`` label (:data:`appliance.oci.labels.VARIANT`), never its tag: a CPU
image carried ``gemma4-vllm:latest`` until the variants had tags of their own. An image without
the label (made by hand) cannot be judged here: a warning says so, and its other labels are
checked as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UsageError
from ..oci import labels
from . import scheme

CURRENT = "0.32.0"  # the vLLM of the images the appliance ships (docker/cpu/vllm-0.32.0.lock)


@dataclass(frozen=True)
class Fit:
    """The verdict: ``refusal`` (the other build) with its ``fix``, or ``warning`` (no label), or
    neither (the build the profile runs on)."""

    refusal: str | None = None
    fix: str | None = None
    warning: str | None = None


def fit(ref: str, image_labels: Mapping[str, str] | None, device: str, profile: str) -> Fit:
    """How the image ``ref`` with ``image_labels`` fits ``profile``, whose ``[hardware] device``
    is ``device`` (``cpu`` or ``cuda``)."""
    found = labels.variant(image_labels)
    if found is None:
        return Fit(
            warning=f"image {ref} has no {labels.VARIANT} label (made by hand?): whether it is "
            f"a {device} build is not checked"
        )
    if found == device:
        return Fit()
    return Fit(
        refusal=f"image {ref} is a {found} build ({labels.VARIANT}={found}) and profile "
        f"{profile} runs on {device}",
        fix=f"choose a {device} image, e.g. {example(image_labels, ref, device)}",
    )


def example(image_labels: Mapping[str, str] | None, ref: str, device: str) -> str:
    """The image of ``device``'s build that would stand in for ``ref``: its version tag, and how
    it is made."""
    version = labels.vllm_version(image_labels) or CURRENT
    mtp = labels.supports_mtp(image_labels)
    try:
        tag = scheme.version_tag(version, mtp, variant=device)
    except UsageError:  # a label no tag can carry: the current release instead
        version, mtp = CURRENT, True
        tag = scheme.version_tag(version, mtp, variant=device)
    if device == "cuda":
        build = f"appliance image build cuda --vllm-version {version}"
    else:
        build = f"appliance image build {'cpu-mtp' if mtp else 'cpu-pre-mtp'}"
    return f"{scheme.repository_of(ref)}:{tag} ({build})"
