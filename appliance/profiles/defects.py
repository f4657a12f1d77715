"""Published Gemma 4 MTP defects of vLLM: which apply to a profile on a given vLLM version.

The table is data (``defects.toml`` beside this module), one entry per defect with its link,
the affected versions (a ``packaging`` specifier), what the profile must run for it to apply
and the fix. :func:`applicable` is the one decision; ``profiles validate`` (a finding per
defect) and ``doctor`` (a check per defect, against the running engine's version) both call it.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from .. import records
from ..engine_api import versions
from ..errors import UsageError
from . import Profile

DATA = "defects.toml"
UNKNOWN = "unknown"  # fixed_in when no release is known to carry the fix
NOT_A_BUG = "n/a"  # fixed_in of an entry a validator rule checks (checked_by)
# Operators that bound a range from above: such a defect is not assumed of an unknown version.
_UPPER = {"<", "<=", "==", "===", "~="}


@dataclass(frozen=True)
class Needs:
    """What a profile must run for a defect to apply (an empty value: any)."""

    mtp: bool = True
    device: str = ""  # "cuda" or "cpu"
    compute_capability: tuple[str, ...] = ()  # any of these
    kv_cache_fp8: bool = False
    kv_cache_auto: bool = False  # the KV cache in the model's dtype (no FP8 kv_cache_dtype)
    concurrent: bool = False  # more than one sequence at a time
    k_schedule: bool = False  # a num_speculative_tokens_per_batch_size schedule
    pipeline_parallel: bool = False  # pipeline_parallel_size > 1
    default_attention_backend: bool = False  # vLLM picks the backend (no --attention-backend)

    def met_by(self, c: Conditions) -> bool:
        """True when ``c`` has everything this asks for."""
        return (
            (not self.mtp or c.mtp)
            and (not self.device or c.device == self.device)
            and (not self.compute_capability or c.compute_capability in self.compute_capability)
            and (not self.kv_cache_fp8 or c.kv_cache_fp8)
            and (not self.kv_cache_auto or not c.kv_cache_fp8)
            and (not self.concurrent or c.concurrent)
            and (not self.k_schedule or c.k_schedule)
            and (not self.pipeline_parallel or c.pipeline_parallel)
            and (not self.default_attention_backend or not c.attention_backend)
        )


@dataclass(frozen=True)
class Conditions:
    """What a profile runs, as far as the defects care."""

    mtp: bool
    device: str = "cuda"
    compute_capability: str = ""
    kv_cache_fp8: bool = False
    concurrent: bool = True
    k_schedule: bool = False
    pipeline_parallel: bool = False
    attention_backend: bool = False  # the profile chooses vLLM's attention backend itself

    @classmethod
    def of(cls, profile: Profile) -> Conditions:
        """The conditions of ``profile``."""
        return cls(
            mtp=profile.mtp,
            device=profile.hardware.device,
            compute_capability=_capability(profile),
            kv_cache_fp8=(profile.kv_cache_dtype or "").startswith("fp8"),
            # vLLM's default max_num_seqs runs many sequences at once.
            concurrent=profile.max_num_seqs is None or profile.max_num_seqs > 1,
            k_schedule=profile.speculative is not None
            and profile.speculative.num_speculative_tokens_per_batch_size is not None,
            pipeline_parallel=profile.pipeline_parallel_size > 1,
            attention_backend=any(
                a.split("=", 1)[0] == "--attention-backend" for a in profile.extra_args
            ),
        )


def _capability(profile: Profile) -> str:
    # A defect is the GPU's (SM 10.0, SM 8.9): the table's GPU the profile names, where it knows
    # one; else the profile's compute_capability, which is its precision's floor.
    from . import catalog

    hw = profile.hardware
    gpu = catalog.gpu_of(hw.gpu_name, hw.gpu_memory_gib)
    return gpu.capability if gpu is not None else hw.compute_capability


@dataclass(frozen=True)
class Defect:
    """One published defect: its code, what goes wrong, where it is reported, the versions it
    affects, what it needs and the fix."""

    id: str
    title: str
    link: str
    affected: str
    fixed_in: str
    level: Literal["error", "warning"]
    fix: str
    note: str = ""
    checked_by: str = ""
    # The output canary's batched pass (answers under concurrency against answers alone) is
    # the check this defect's fix asks for: a profile that runs it is told at info level.
    canary_checks: bool = False
    needs: Needs = field(default_factory=Needs)

    @property
    def specifier(self) -> SpecifierSet:
        return SpecifierSet(self.affected)

    def affects(self, vllm_version: str | None) -> bool:
        """True when ``vllm_version`` is in the affected range (by its release numbers, so
        ``0.25.1+cpu`` is a 0.25.1). ``None`` (no version known): only a range without an
        upper bound, since no release is known to be free of it."""
        spec = self.specifier
        if vllm_version is None:
            return not any(s.operator in _UPPER for s in spec)
        release = Version(".".join(map(str, versions.parse(vllm_version).release)))
        return spec.contains(release, prereleases=True)

    def summary(self) -> str:
        """The defect in one line: title, link, versions and fix state."""
        return f"{self.title} ({self.link}; vLLM {self.affected}, fixed in: {self.fixed_in})"


def applicable(vllm_version: str | None, conditions: Conditions) -> list[Defect]:
    """The defects that apply to a profile with ``conditions`` on ``vllm_version`` (``None``:
    not known), in the table's order. Entries a validator rule checks are left out."""
    return [
        d
        for d in table()
        if not d.checked_by and d.needs.met_by(conditions) and d.affects(vllm_version)
    ]


@functools.cache
def table() -> tuple[Defect, ...]:
    """The shipped table."""
    text = resources.files(__package__).joinpath(DATA).read_text()
    return load(text, DATA)


def load(text: str, where: str) -> tuple[Defect, ...]:
    """The defects of a table's TOML ``text``; a wrong entry is one UsageError naming the entry
    and the field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where}: {exc}") from None
    unknown = sorted(set(data) - {"defect"})
    if unknown:
        raise UsageError(f"{where}: unknown table(s) {', '.join(unknown)}")
    entries = data.get("defect", [])
    if not isinstance(entries, list):
        raise UsageError(f"{where}: defect must be an array of tables ([[defect]])")
    out: list[Defect] = []
    for n, entry in enumerate(entries, 1):
        name = entry.get("id") if isinstance(entry, dict) else None
        at = f"{where} [[defect]] {name if isinstance(name, str) else f'#{n}'}"
        out.append(_entry(entry, at))
    ids = [d.id for d in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise UsageError(f"{where}: id {dup[0]} is used twice")
    return tuple(out)


def _entry(entry, at: str) -> Defect:
    if isinstance(entry, dict) and "needs" in entry:
        needs = dict(entry["needs"]) if isinstance(entry["needs"], dict) else entry["needs"]
        if isinstance(needs, dict) and isinstance(needs.get("compute_capability"), list):
            needs["compute_capability"] = tuple(needs["compute_capability"])
        entry = {**entry, "needs": records.build(Needs, needs, f"{at} [needs]")}
    d = records.build(Defect, entry, at)
    try:
        SpecifierSet(d.affected)
    except InvalidSpecifier:
        raise UsageError(f"{at}: affected = {d.affected!r}: not a version specifier") from None
    if d.fixed_in not in (UNKNOWN, NOT_A_BUG):
        try:
            versions.parse(d.fixed_in)
        except UsageError:
            raise UsageError(
                f"{at}: fixed_in = {d.fixed_in!r}: not a version, {UNKNOWN!r} or {NOT_A_BUG!r}"
            ) from None
    if (d.fixed_in == NOT_A_BUG) != bool(d.checked_by):
        raise UsageError(f"{at}: fixed_in = {NOT_A_BUG!r} goes with checked_by, and only with it")
    if not d.link.startswith("https://github.com/vllm-project/vllm/"):
        raise UsageError(f"{at}: link = {d.link!r}: not a vllm-project/vllm issue or PR")
    if "\n" in d.title or not d.title.strip():
        raise UsageError(f"{at}: title must be one line")
    return d
