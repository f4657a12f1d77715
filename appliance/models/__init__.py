"""The weights on the host: pull, export, import and verify a profile's target and drafter.

The engine runs offline (``HF_HUB_OFFLINE=1``), so both models must already sit in the
instance's Hugging Face cache (``HF_CACHE_DIR``, mounted at ``/root/.cache/huggingface``) in
the layout the hub client writes: ``hub/models--ORG--NAME/{blobs,snapshots/COMMIT,refs/main}``.

- :mod:`.where`: which profile, cache and token file a command is about (``--instance`` or not).
- :mod:`.cache`: that cache layout, read and written.
- :mod:`.token`: the hub token, read from a 0600 file only.
- :mod:`.pull`: download with ``huggingface_hub`` (connected hosts).
- :mod:`.manifest`, :mod:`.export`, :mod:`.importer`: a hashed copy for air-gapped hosts.
- :mod:`.verify`: present, complete, hashes right, and the drafter fits the profile (also for
  the tiny dev models in ``MODEL_DIR``).

The serve script repeats the cheap part of ``verify --quick`` in bash at every start (the host
may have no Python): see ``check_models`` in ``appliance/units/serve.sh``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ApplianceError, UsageError
from ..profiles import DEVMODEL, Profile

EX_CONFIG = 78  # sysexits' EX_CONFIG: systemd's unit does not restart on it
# What vLLM accepts as a Gemma 4 MTP drafter (vllm/config/speculative.py rewrites the first two
# to gemma4_mtp). The args file carries them for the serve script's start-time check.
DRAFTER_TYPES = ("gemma4_assistant", "gemma4_unified_assistant", "gemma4_mtp")


class ModelsNotReady(ApplianceError):
    """A model the profile needs is missing, incomplete or the wrong one (exit 78)."""

    exit_code = EX_CONFIG


class TransferError(ApplianceError):
    """A download, export or import failed; nothing half-written was left behind."""


@dataclass(frozen=True)
class ModelSpec:
    """One model a profile serves: its role, hub repo id and pinned revision (None: main)."""

    role: str  # "target" or "drafter"
    repo_id: str
    revision: str | None = None

    @property
    def ref(self) -> str:
        return self.revision or "main"


def specs(profile: Profile) -> list[ModelSpec]:
    """The target and (with speculative decoding) the drafter ``profile`` serves, from the hub."""
    if profile.uses_devmodel:
        raise UsageError(
            f"profile {profile.name} serves the tiny dev models from MODEL_DIR, not the hub",
            fix="build them with: appliance devmodel build DIR",
        )
    out = [ModelSpec("target", profile.model, profile.revision)]
    spec = profile.speculative
    if spec is not None and spec.model:
        out.append(ModelSpec("drafter", spec.model, spec.revision))
    return out


def dir_specs(profile: Profile) -> list[ModelSpec]:
    """A tiny dev model profile's target and drafter: ``repo_id`` is the directory inside
    ``MODEL_DIR`` (``target``, ``drafter``)."""
    prefix = DEVMODEL + "/"
    out = []
    for role, model in (
        ("target", profile.model),
        ("drafter", profile.speculative.model if profile.speculative else None),
    ):
        if model:
            if not model.startswith(prefix):
                raise UsageError(f"profile {profile.name}: {role} {model!r} is not in MODEL_DIR")
            out.append(ModelSpec(role, model[len(prefix) :]))
    return out
