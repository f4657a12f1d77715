"""A profile's canary policy: on or off by default, thresholds, run settings, the operator's set.

The profile's optional ``[canary]`` table (:class:`appliance.profiles.Canary`) holds it; the MTP
profiles turn the canary on. This module turns that table into the typed pieces the canary uses
and checks its values, naming the profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..profiles import Profile
from .cases import CanarySet, resolve
from .compare import Policy
from .record import Settings

# Where a relative ``prompts`` path is found: beside the instances' env files.
OPERATOR_DIR = Path("etc/gemma4-vllm")


@dataclass(frozen=True)
class Plan:
    """Everything the canary needs for one profile: the set, the run settings, the policy."""

    profile: str
    enabled: bool
    cases: CanarySet | None  # None when the canary is off: its files are not even read
    settings: Settings
    policy: Policy
    batched: bool = False  # also the batched pass (vLLM #46088 shows only under batching)
    at_once: int | None = None  # the most the engine batches (the profile's max_num_seqs)


def plan(
    profile: Profile,
    *,
    root: Path = Path("/"),
    enabled: bool | None = None,
    files: tuple[Path, ...] = (),
    replace: bool | None = None,
) -> Plan:
    """The canary plan for ``profile``; ``enabled``/``files``/``replace`` override the profile.

    When the canary is on, its set is read and validated here, so a malformed line is refused
    before anything runs.
    """
    c = profile.canary
    where = f"profile {profile.name} [canary]"
    try:
        settings = Settings(max_tokens=c.max_tokens, seed=c.seed)
        policy = Policy.of(c)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc.message}", fix=exc.fix) from exc
    on = c.enabled if enabled is None else enabled
    if not files and c.prompts:
        p = Path(c.prompts)
        files = (root / (p.relative_to("/") if p.is_absolute() else OPERATOR_DIR / p),)
    cases = resolve(files, replace=c.replace if replace is None else replace) if on else None
    return Plan(
        profile=profile.name,
        enabled=on,
        cases=cases,
        settings=settings,
        policy=policy,
        batched=c.batched,
        at_once=profile.max_num_seqs,
    )
