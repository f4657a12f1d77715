"""What ``appliance image build`` can build: one recipe per image kind."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Target:
    """One image recipe: its Dockerfile (under ``docker/``) and what goes into it."""

    name: str
    dockerfile: str
    variant: str  # "cpu" or "cuda"
    description: str
    # The vLLM version; None means the operator chooses (``--vllm-version``).
    vllm_version: str | None = None
    # Built from the CPU base (mmdebstrap) and a wheel lock (docker/cpu/vllm-<v>.lock).
    uses_lock: bool = False
    # Built on top of another target's image.
    parent: str | None = None
    broken: bool = False


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "cpu-mtp",
            "cpu/Dockerfile",
            "cpu",
            "real vLLM 0.32.0 CPU engine, Gemma 4 MTP",
            "0.32.0",
            uses_lock=True,
        ),
        Target(
            "cpu-pre-mtp",
            "cpu/Dockerfile",
            "cpu",
            "real vLLM 0.19.0 CPU engine, no MTP (the seed's rollback image)",
            "0.19.0",
            uses_lock=True,
        ),
        Target(
            "cpu-broken",
            "cpu-broken/Dockerfile",
            "cpu",
            "cpu-mtp whose engine exits at start (cutover tests)",
            "0.32.0",
            parent="cpu-mtp",
            broken=True,
        ),
        Target(
            "cuda",
            "Dockerfile",
            "cuda",
            "official vllm/vllm-openai:v<version> + entry point + labels (GPU hosts)",
        ),
    )
}


def get(name: str) -> Target:
    """The target ``name``, or a UsageError listing the known ones."""
    try:
        return TARGETS[name]
    except KeyError:
        raise UsageError(
            f"unknown image target {name!r}", fix=f"known: {', '.join(TARGETS)}"
        ) from None
