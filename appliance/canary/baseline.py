"""An instance's acceptance baseline: its last passing canary record that drafted.

A cutover from an image without MTP (the seed's vLLM 0.19 -> MTP) has nothing to judge the new
image's draft acceptance against: the old image drafted nothing, so its record has no figures.
So every cutover whose canary passes with figures keeps its after-record as the instance's
baseline (:meth:`appliance.host.layout.Layout.canary_baseline`, the record's own JSON), and a
cutover whose before-record has no figures judges the after-record against that baseline
instead: per prompt, cases matched by id, by :mod:`appliance.judge.acceptance` with the profile's
``max_acceptance_drop``. The first such cutover has no baseline yet: it passes on its answers and
its record becomes the baseline.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from ..engine_api import specdecode
from ..errors import UsageError
from ..judge import acceptance
from . import record as records
from .compare import Policy
from .record import Record


def drafted(rec: Record) -> specdecode.Delta | None:
    """``rec``'s figures added up over its prompts; None when no prompt drafted."""
    total = specdecode.summed([o.spec.delta for o in rec.outputs if o.spec is not None])
    if total is None or not total.drafts or not total.draft_tokens:
        return None
    return total


@dataclass(frozen=True)
class Baseline:
    """A kept record and its figures, summed over the prompts that drafted."""

    record: Record
    figures: specdecode.Delta

    @classmethod
    def of(cls, rec: Record) -> Baseline | None:
        """``rec`` as a baseline; None when it drafted nothing (it cannot be one)."""
        figures = drafted(rec)
        return None if figures is None else cls(rec, figures)

    @property
    def acceptance(self) -> float:
        return self.figures.acceptance or 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.figures.tokens_per_step or 1.0

    def name(self) -> str:
        """Which baseline: its image and when it was recorded."""
        when = dt.datetime.fromtimestamp(self.record.started, dt.UTC)
        return f"{self.record.image or self.record.url} of {when:%Y-%m-%dT%H:%M:%SZ}"

    def describe(self) -> str:
        """Its figures, for a progress line and ``appliance status``."""
        return (
            f"acceptance {self.acceptance:.0%}, tokens per step {self.tokens_per_step:.2f} "
            f"({self.name()}, vLLM {self.record.vllm_version})"
        )

    def to_dict(self) -> dict:
        """The figures under stable keys (history, ``status --json``)."""
        return {
            "image": self.record.image,
            "vllm_version": self.record.vllm_version,
            "recorded": self.record.started,
            "acceptance": round(self.acceptance, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "prompts": sum(o.spec is not None for o in self.record.outputs),
        }


@dataclass(frozen=True)
class Check:
    """A record without figures before the cutover: the after-record's acceptance judged against
    the instance's baseline, or, with none yet, the note that the after-record becomes it."""

    baseline: Baseline | None  # None: the instance has none yet
    after: specdecode.Delta | None  # the after-record's summed figures; None: it drafted nothing
    change: acceptance.Change | None = None  # None: not compared
    failures: tuple[str, ...] = ()

    def summary(self, passed: bool) -> str:
        """One clause; ``passed``: the canary passed, so the after-record is kept."""
        kept = passed and self.after is not None
        if self.baseline is None:
            if self.after is None:
                return "no acceptance baseline yet, and this image drafted nothing to keep as one"
            if not kept:
                return "no acceptance baseline yet (a failed record does not become one)"
            return (
                "no acceptance baseline yet: this record becomes the instance's baseline "
                f"(acceptance {self.after.acceptance:.0%}, tokens per step "
                f"{self.after.tokens_per_step:.2f})"
            )
        name = self.baseline.name()
        if self.change is None:
            what = f"acceptance baseline {name} not compared (no prompt drafted on both)"
        else:
            what = f"against the acceptance baseline {name}: {self.change.summary()}"
        return f"{what}; this record becomes the new baseline" if kept else what

    def figures(self) -> dict:
        """The baseline's figures, the change and the failures (stable keys)."""
        return {
            "baseline": None if self.baseline is None else self.baseline.to_dict(),
            "change": None if self.change is None else self.change.figures(),
            "failures": list(self.failures),
        }


def judge(after: Record, baseline: Baseline | None, policy: Policy) -> Check:
    """``after``'s acceptance against ``baseline``, per prompt (cases matched by id), failing a
    median drop beyond ``policy.max_acceptance_drop``; with no baseline, nothing to judge."""
    figures = drafted(after)
    if baseline is None:
        return Check(None, figures)
    kept = {o.id: o.spec for o in baseline.record.outputs}
    pairs = [
        (kept[o.id].delta if kept[o.id] else None, o.spec.delta if o.spec else None)
        for o in after.outputs
        if o.id in kept
    ]
    change = acceptance.change(pairs, "prompts")
    if change is None:
        return Check(baseline, figures)
    lines = change.failures(acceptance.Tolerance(policy.max_acceptance_drop))
    failures = tuple(f"{line} against the acceptance baseline {baseline.name()}" for line in lines)
    return Check(baseline, figures, change, failures)


def _fix(path: Path) -> str:
    return f"remove {path}: the next cutover whose canary passes with MTP keeps a new one"


def load(path: Path) -> Baseline | None:
    """The baseline kept at ``path``; None when there is none. A file that is not one is a
    UsageError naming it (and the field)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"cannot read the acceptance baseline {path}: {exc}", fix=_fix(path)
        ) from exc
    where = f"acceptance baseline {path}"
    try:
        rec = records.from_dict(json.loads(text), where)
    except ValueError as exc:
        raise UsageError(f"{where}: not JSON: {exc}", fix=_fix(path)) from None
    except UsageError as exc:
        raise UsageError(exc.message, fix=_fix(path)) from None
    kept = Baseline.of(rec)
    if kept is None:
        raise UsageError(f"{where}: no prompt has speculative-decoding figures", fix=_fix(path))
    return kept


def keep(rec: Record, path: Path) -> Baseline | None:
    """Save ``rec`` at ``path`` as the baseline (atomically, owner-only) when it drafted; None
    when it did not, and the baseline already there stays."""
    kept = Baseline.of(rec)
    if kept is not None:
        records.save(rec, path)
    return kept
