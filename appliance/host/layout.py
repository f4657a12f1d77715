"""Where an instance's files live, under an optional root prefix (tests and image builds).

The env file is the one the unit reads (``EnvironmentFile=``); everything the cutover adds (the
history, the rollback slot, the lock, the saved previous env file) lives in the appliance's
state directory so that a cutover never writes next to the operator's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .names import ENV_DIR as _ENV_DIR
from .names import check_instance

ENV_DIR = Path(_ENV_DIR).relative_to("/")
STATE_DIR = Path("var/lib/gemma4-appliance")


@dataclass(frozen=True)
class Layout:
    """The appliance's paths below ``root`` (``/`` on a real host)."""

    root: Path = Path("/")

    @property
    def env_dir(self) -> Path:
        return self.root / ENV_DIR

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    def env_file(self, instance: str) -> Path:
        return self.env_dir / f"{check_instance(instance)}.env"

    def args_file(self, instance: str) -> Path:
        """The engine's arguments, from the profile (JSON, written by ``appliance install``)."""
        return self.env_dir / f"{check_instance(instance)}.args"

    def api_key_file(self, instance: str) -> Path:
        """The API key vLLM requires on ``/v1`` (mode 0600, written by ``appliance install``)."""
        return self.env_dir / f"{check_instance(instance)}.api-key"

    def history_file(self, instance: str) -> Path:
        return self.state_dir / "history" / f"{check_instance(instance)}.jsonl"

    def lock_file(self, instance: str) -> Path:
        return self.state_dir / "locks" / f"{check_instance(instance)}.lock"

    def rollback_slot(self, instance: str) -> Path:
        """JSON naming the image ``appliance rollback`` returns to (kept by image pruning)."""
        return self.state_dir / "rollback" / f"{check_instance(instance)}.json"

    def saved_env(self, instance: str) -> Path:
        """The env file as it was before the cutover in progress (byte-identical copy)."""
        return self.state_dir / "cutover" / f"{check_instance(instance)}.env.prev"

    def saved_slot(self, instance: str) -> Path:
        """The rollback slot as it was before the cutover in progress (its bytes; empty when
        there was none), so that recovering a killed cutover puts it back too."""
        return self.state_dir / "cutover" / f"{check_instance(instance)}.slot.prev"

    def canary_record(self, instance: str, side: str) -> Path:
        """The output canary's record of the cutover in progress (``side``: before, after)."""
        return self.state_dir / "canary" / f"{check_instance(instance)}.{side}.json"

    def canary_baseline(self, instance: str) -> Path:
        """The instance's acceptance baseline: its last passing canary record that drafted
        (kept across cutovers, for the one whose old image has no MTP)."""
        return self.state_dir / "canary" / f"{check_instance(instance)}.baseline.json"

    def private_dirs(self, instance: str) -> tuple[Path, ...]:
        """The state directories holding ``instance``'s lock, history, rollback slot, saved env
        file and canary records (model output): root's alone (0700). The metrics folder is not
        one: the node exporter reads it."""
        return tuple(
            p.parent
            for p in (
                self.lock_file(instance),
                self.history_file(instance),
                self.rollback_slot(instance),
                self.saved_env(instance),
                self.canary_record(instance, "before"),
            )
        )

    def require_known(self, instance: str) -> None:
        """Refuse a name this host has never seen: no env file and no history (an uninstalled
        instance's history is kept, and stays readable)."""
        if not (self.env_file(instance).exists() or self.history_file(instance).exists()):
            raise UsageError(
                f"no instance {instance}: no {self.env_file(instance)} and no history",
                fix="`appliance status` lists the installed instances",
            )

    def metrics_textfile(self) -> Path:
        return self.state_dir / "metrics" / "gemma4_appliance.prom"
