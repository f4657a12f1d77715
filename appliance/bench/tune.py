"""``appliance bench tune``: the k for each batch size from one run, written as vLLM's k schedule.

A running vLLM cannot change ``num_speculative_tokens``, so a sweep over k costs a model load per
k (471 s for 31B NVFP4 in a seed). vLLM's dynamic speculative decoding takes a schedule instead,
``num_speculative_tokens_per_batch_size = [[first, last, k], ...]``, which its scheduler reads
each step by the number of scheduled requests. Tune fills it from one concurrency bench of the
MTP endpoint at the profile's k and of the same model without MTP (the baseline), level by level:

- tokens per step at every k' <= k: from the run at k by prefix acceptance
  (:func:`appliance.bench.schedule.predicted_lengths_of`, per request where the responses carry
  their own figures);
- the step cost: the line through the baseline (k = 0, one token per step) and the run at k
  (:func:`appliance.bench.schedule.step_cost`), so a predicted TPOT per k'
  (:func:`appliance.bench.schedule.predicted_tpot`);
- the k' with the lowest predicted TPOT (ties: the smaller, less drafting work for the same
  speed). Never 0: where the baseline beats every k', the level says MTP does not pay there, and
  the schedule keeps k' >= 1, since vLLM counts prefills in the batch size and a threshold to
  k = 0 thrashes under load (vllm#49548, open).

Each level's k applies from the batch size halfway after the level below it; the first range
starts at 1 (vLLM requires it) and the last runs to the profile's ``max_num_seqs`` (vLLM carries
the last k on past it anyway). Adjacent ranges with the same k are merged.
"""

from __future__ import annotations

import dataclasses
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .. import fsutil
from ..engine_api import specdecode
from ..errors import UsageError
from ..profiles import Profile, from_dict
from ..profiles import validate as profile_validate
from .concurrency import LevelResult, run_level
from .runner import BenchConfig, Endpoint, Progress
from .schedule import ScheduleCheck, check_schedule, predicted_tpot, step_cost

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


@dataclass(frozen=True)
class LevelChoice:
    """What one concurrency level says about k: the measured TPOTs, the predictions per k'
    (index i is k' = i + 1) and the k' chosen."""

    concurrency: int
    k: int  # the k the MTP endpoint ran
    baseline_tpot_s: float
    mtp_tpot_s: float
    tokens_per_step: float  # measured at k
    predicted_tokens_per_step: tuple[float, ...]
    predicted_tpot_s: tuple[float, ...]
    chosen_k: int

    @property
    def mtp_pays(self) -> bool:
        """Whether the chosen k' is predicted faster than serving without MTP."""
        return self.predicted_tpot_s[self.chosen_k - 1] < self.baseline_tpot_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mtp_pays": self.mtp_pays}


def choose(
    concurrency: int,
    lengths: tuple[float, ...],
    mtp_tpot_s: float,
    baseline_tpot_s: float,
) -> LevelChoice:
    """The k' for one level from the run at k = ``len(lengths)`` (its tokens per step at every
    k' <= k) and the two measured median TPOTs."""
    k = len(lengths)
    if k < 1:
        raise UsageError(f"concurrency {concurrency}: no per-position acceptance to predict from")
    cost = step_cost((0, baseline_tpot_s, 1.0), (k, mtp_tpot_s, lengths[-1]))
    assert cost is not None  # k >= 1, never the baseline's 0
    tpots = predicted_tpot(lengths, cost)
    best = min(range(k), key=lambda i: (tpots[i], i))
    return LevelChoice(
        concurrency, k, baseline_tpot_s, mtp_tpot_s, lengths[-1], lengths, tpots, best + 1
    )


def choose_level(mtp: LevelResult, baseline: LevelResult) -> LevelChoice:
    """:func:`choose` from the two endpoints' runs of one level."""
    n = mtp.concurrency
    lengths = mtp.predicted_lengths()
    if lengths is None:
        raise UsageError(
            f"concurrency {n}: the MTP endpoint reported no per-position acceptance",
            fix="give the endpoint that serves the profile with MTP (--url or NAME)",
        )
    mtp_tpot, base_tpot = mtp.tpot_median_s(), baseline.tpot_median_s()
    if mtp_tpot is None or base_tpot is None:
        raise UsageError(f"concurrency {n}: no TPOT measured (--max-tokens must be >= 2)")
    return choose(n, lengths, mtp_tpot, base_tpot)


def schedule(choices: list[LevelChoice], max_num_seqs: int | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``[first, last, k]`` ranges for the chosen k' per level (see the module's text)."""
    levels = sorted(choices, key=lambda c: c.concurrency)
    out: list[list[int]] = []
    start = 1
    for i, c in enumerate(levels):
        if i + 1 < len(levels):
            end = (c.concurrency + levels[i + 1].concurrency) // 2
        else:
            end = max(c.concurrency, max_num_seqs or 0)
        if out and out[-1][2] == c.chosen_k:
            out[-1][1] = end
        else:
            out.append([start, end, c.chosen_k])
        start = end + 1
    return tuple(tuple(e) for e in out)


@dataclass
class TuneResult:
    profile: Profile  # the profile as measured (its k)
    choices: list[LevelChoice]
    mtp_levels: list[LevelResult]
    baseline_levels: list[LevelResult]
    wall_s: float

    @property
    def schedule(self) -> tuple[tuple[int, ...], ...]:
        return schedule(self.choices, self.profile.max_num_seqs)

    def tuned(self, name: str | None = None) -> Profile:
        """The profile with the schedule (and ``name``, when given)."""
        assert self.profile.speculative is not None
        spec = dataclasses.replace(
            self.profile.speculative, num_speculative_tokens_per_batch_size=self.schedule
        )
        return dataclasses.replace(self.profile, name=name or self.profile.name, speculative=spec)

    def to_dict(self) -> dict:
        return {
            "profile": self.profile.name,
            "k": self.profile.speculative.num_speculative_tokens
            if self.profile.speculative
            else None,
            "levels": [c.to_dict() for c in self.choices],
            SCHEDULE_KEY: [list(e) for e in self.schedule],
            "wall_s": self.wall_s,
            "mtp": [lv.to_dict() for lv in self.mtp_levels],
            "baseline": [lv.to_dict() for lv in self.baseline_levels],
        }


def check_profile(profile: Profile | None) -> Profile:
    """The profile tune can measure: MTP at a fixed k (a schedule already there would be what
    the run measures instead of k)."""
    if profile is None:
        raise UsageError(
            "tune needs the profile the MTP endpoint serves",
            fix="give NAME (an installed instance) or --profile NAME|FILE",
        )
    if not profile.mtp or profile.speculative is None:
        raise UsageError(f"profile {profile.name} has no MTP to tune")
    if profile.speculative.num_speculative_tokens_per_batch_size is not None:
        raise UsageError(
            f"profile {profile.name} already has a {SCHEDULE_KEY}: tune measures one fixed k",
            fix="serve the profile without the schedule for the tuning run",
        )
    return profile


def run(
    profile: Profile,
    mtp: Endpoint,
    baseline: Endpoint,
    config: BenchConfig,
    levels: list[int],
    requests: int | None = None,
    progress: Progress | None = None,
) -> TuneResult:
    """Bench both endpoints level by level (MTP then baseline at each, so a drifting host
    weighs on both alike) and choose k per level."""
    profile = check_profile(profile)
    if not mtp.speculative:
        raise UsageError(f"{mtp.url} serves without speculative decoding: not the MTP endpoint")
    if mtp.model != baseline.model:
        raise UsageError(f"the endpoints serve different models ({mtp.model} vs {baseline.model})")
    start = time.monotonic()
    mtp_levels, base_levels, choices = [], [], []
    for n in sorted(levels):
        count = requests or max(4 * n, config.measured_requests)
        m = run_level(mtp, config, n, count, progress)
        b = run_level(baseline, config, n, count, progress)
        c = choose_level(m, b)
        k = profile.speculative.num_speculative_tokens if profile.speculative else 0
        if c.k != k:
            raise UsageError(
                f"{mtp.url} drafts k={c.k}, profile {profile.name} says k={k}",
                fix="give the profile that endpoint serves",
            )
        mtp_levels.append(m)
        base_levels.append(b)
        choices.append(c)
    return TuneResult(profile, choices, mtp_levels, base_levels, time.monotonic() - start)


# --- reading a schedule back from the engine ---------------------------------------------------


def k_at(schedule: tuple[tuple[int, ...], ...], k: int, batch_size: int) -> int:
    """The k vLLM's scheduler drafts at ``batch_size`` under ``schedule`` (a valid one): the
    range's k, carried forward through gaps and past the last range, capped at ``k``
    (``build_dynamic_sd_schedule_lookup`` in vllm/v1/spec_decode/dynamic/utils.py)."""
    chosen = None
    for start, _end, entry_k in sorted(schedule, key=lambda e: e[0]):
        if start > batch_size:
            break
        chosen = entry_k
    if chosen is None:
        raise UsageError(f"the schedule {[list(e) for e in schedule]} does not start at 1")
    return min(k, chosen)


def verify(profile: Profile, levels: list[LevelResult]) -> list[ScheduleCheck]:
    """Each level of a bench of the endpoint serving ``profile`` (its schedule) against what the
    schedule says there: does the drafter draft fewer tokens per step where it should?"""
    spec = profile.speculative
    if spec is None or not spec.num_speculative_tokens_per_batch_size:
        raise UsageError(
            f"profile {profile.name} has no {SCHEDULE_KEY} to verify",
            fix="give the tuned profile the endpoint serves (appliance bench tune --write)",
        )
    schedule, k = spec.num_speculative_tokens_per_batch_size, spec.num_speculative_tokens
    out = []
    for lv in levels:
        n = lv.concurrency
        figures, _source = lv.spec()
        most = max(k_at(schedule, k, b) for b in range(1, n + 1))
        out.append(
            check_schedule(figures or specdecode.Delta("absent"), n, k, k_at(schedule, k, n), most)
        )
    return out


# --- writing the profile copy -----------------------------------------------------------------


def with_schedule_text(source: str, tuned: Profile) -> str:
    """``source`` (the profile's TOML text, any valid TOML: tables, dotted keys, inline tables)
    with ``tuned``'s name and schedule, every other key, comment and the layout kept (tomlkit,
    ADR 0021); checked by parsing it back: the text must load as exactly ``tuned``."""
    import tomlkit
    import tomlkit.exceptions

    assert tuned.speculative is not None and tuned.speculative.num_speculative_tokens_per_batch_size
    fail = "could not write the schedule into the profile's TOML"
    try:
        doc = tomlkit.parse(source)
    except tomlkit.exceptions.TOMLKitError as exc:
        raise UsageError(f"{fail}: {exc}") from None
    if "name" not in doc:
        raise UsageError(f"{fail}: it has no top-level name")
    spec = doc.get("speculative")
    if not isinstance(spec, dict):  # tomlkit's tables and inline tables are dicts
        raise UsageError(f"{fail}: it has no speculative table")
    ranges = tomlkit.array()
    for entry in tuned.speculative.num_speculative_tokens_per_batch_size:
        ranges.append(list(entry))
    ranges.comment("[first batch size, last, k]: written by appliance bench tune")
    doc["name"] = tuned.name
    spec[SCHEDULE_KEY] = ranges
    text = tomlkit.dumps(doc)
    try:
        back = from_dict(tomllib.loads(text), "the tuned profile")
    except (tomllib.TOMLDecodeError, UsageError) as exc:
        raise UsageError(f"{fail}: {exc}") from None
    if back != tuned:
        raise UsageError(
            f"{fail}: it reads back differently",
            fix=f"put {SCHEDULE_KEY} = [...] under [speculative] by hand",
        )
    return text


def check_writable(dest: Path, source: str, profile: Profile, name: str) -> None:
    """Refuse now, before any measurement, a ``--write`` that would fail after it: a
    directory that is not there, or a profile text the schedule cannot go into (tried with a
    stand-in schedule, k from 1 up)."""
    if not dest.parent.is_dir():
        raise UsageError(
            f"cannot write {dest}: the directory {dest.parent} does not exist",
            fix=f"create it first: mkdir -p {dest.parent}",
        )
    if dest.is_dir():
        raise UsageError(f"{dest} is a directory", fix="give the profile's file name")
    assert profile.speculative is not None
    k = profile.speculative.num_speculative_tokens
    stand_in = ((1, max(1, profile.max_num_seqs or 1), k),)
    spec = dataclasses.replace(profile.speculative, num_speculative_tokens_per_batch_size=stand_in)
    with_schedule_text(source, dataclasses.replace(profile, name=name, speculative=spec))


def write(dest: Path, source: str, tuned: Profile) -> list[profile_validate.Finding]:
    """Validate ``tuned`` and write it to ``dest`` (atomically: a failure keeps the file that
    was there); returns the validator's warnings."""
    warnings = profile_validate.require_valid(tuned)
    fsutil.write_atomic(dest, with_schedule_text(source, tuned))
    return warnings
