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

The unit's serve program runs ``verify --quick`` at every start (:mod:`appliance.serve`): this
package's ``__init__``, :mod:`.cache` and :mod:`.verify` use the standard library only.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ApplianceError

EX_CONFIG = 78  # sysexits' EX_CONFIG: systemd's unit does not restart on it
# What vLLM accepts as a Gemma 4 MTP drafter (vllm/config/speculative.py rewrites the first two
# to gemma4_mtp).
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


def hub_fix(selector: Sequence[str], pull_extra: Sequence[str] = ()) -> str:
    """What fixes a missing or broken model in the hub cache, on a connected host and on an
    air-gapped one; ``selector`` names the models as ``appliance models`` takes them."""
    pull = shlex.join(["appliance", "models", "pull", *selector, *pull_extra])
    imp = shlex.join(["appliance", "models", "import", *selector, "--from", "COPY"])
    return f"fix: {pull}; air-gapped: {imp}"


def model_dir_fix(env_path: str) -> str:
    """What fixes a broken tiny model pair."""
    return (
        "fix: appliance dev devmodel DIR (a new or empty directory), "
        f"then MODEL_DIR=DIR in {env_path}"
    )
