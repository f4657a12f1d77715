"""Is the new side's mean draft acceptance worse than the old side's? A bootstrap
non-inferiority rule with three answers: ``worse``, ``not worse``, ``not enough calls yet``.

The samples are per-call (or per-window) acceptances of two independent stretches of traffic
(before and after a cutover), not pairs: the calls differ. ``judge`` resamples each side with
replacement ``resamples`` times (a fixed seed: the same samples always get the same answer),
takes the difference of the means (after - before) each time, and reads the two-sided
``confidence`` percentile interval ``[low, high]`` of those differences. With ``margin`` the
absolute drop in acceptance that is tolerated:

- **not worse**: ``low >= -margin``: even the pessimistic end of the interval is within the
  margin (the Gemma-4-31B-MTP-vLLM-Server project's own gate: ``_non_inferiority_report``,
  1000 bootstrap samples, a 95% interval, fail when its low end is under the margin);
- **worse**: ``high < -margin``: even the optimistic end is beyond it;
- **not enough calls yet**: fewer than ``min_samples`` samples or ``min_calls`` calls on a side,
  or an interval that straddles ``-margin``. That project's runs are fixed in size and call
  "not shown non-inferior" a failure; a live gate can wait for more traffic instead, and noise
  alone (a wide interval) must never roll a good image back (ADR 0019).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import UsageError

Decision = Literal["worse", "not worse", "not enough calls yet"]
WORSE: Decision = "worse"
NOT_WORSE: Decision = "not worse"
NOT_ENOUGH: Decision = "not enough calls yet"


@dataclass(frozen=True)
class Rule:
    """The margin (absolute acceptance), the interval's confidence, the least evidence per
    side, and the bootstrap's size and seed."""

    margin: float = 0.05
    confidence: float = 0.95
    min_samples: int = 10
    min_calls: int = 10
    resamples: int = 1000
    seed: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and 0.0 <= self.margin <= 1.0):
            raise UsageError(f"the acceptance margin must be within 0..1, not {self.margin}")
        if not (math.isfinite(self.confidence) and 0.5 <= self.confidence < 1.0):
            raise UsageError(
                f"the confidence must be within 0.5..1 (1 excluded), not {self.confidence}"
            )
        if self.min_samples < 2 or self.min_calls < 1:
            raise UsageError("the rule needs at least 2 samples and 1 call per side")
        if self.resamples < 100:
            raise UsageError(f"at least 100 bootstrap resamples, not {self.resamples}")


@dataclass(frozen=True)
class Side:
    """One side's samples (acceptance in 0..1 each) and the calls they span (``None``: one
    call per sample, as when the samples are per call)."""

    values: tuple[float, ...]
    calls: int | None = None

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in self.values):
            raise ValueError("an acceptance sample is not a finite number")

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def n_calls(self) -> int:
        return self.n if self.calls is None else self.calls

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None


@dataclass(frozen=True)
class Judgement:
    """The decision and every number behind it."""

    decision: Decision
    rule: Rule
    before: Side
    after: Side
    unit: str
    low: float | None = None  # the interval of mean(after) - mean(before); None: not computed
    high: float | None = None
    why: str = ""  # for "not enough calls yet": what is missing

    @property
    def difference(self) -> float | None:
        b, a = self.before.mean, self.after.mean
        return None if a is None or b is None else a - b

    def summary(self) -> str:
        """One line: the decision, the means, the bound, n on both sides, margin, confidence."""
        r, b, a = self.rule, self.before, self.after
        means = f"mean acceptance {_pct(b.mean)} -> {_pct(a.mean)}"
        counts = (
            f"n {b.n} {self.unit} ({b.n_calls} calls) before, {a.n} {self.unit} "
            f"({a.n_calls} calls) after"
        )
        bound = (
            f"{r.confidence:.0%} interval of the change [{_signed(self.low)}, {_signed(self.high)}]"
            if self.low is not None and self.high is not None
            else "no interval"
        )
        tail = f" ({self.why})" if self.why else ""
        return (
            f"{self.decision}{tail}: {means}, {bound} against margin -{r.margin:.3f}, {counts}, "
            f"{r.resamples} bootstrap resamples"
        )

    def figures(self) -> dict:
        """Every figure, JSON-serialisable, under stable keys."""

        def side(s: Side) -> dict:
            return {"n": s.n, "calls": s.n_calls, "mean": _round(s.mean)}

        return {
            "decision": self.decision,
            "unit": self.unit,
            "before": side(self.before),
            "after": side(self.after),
            "difference": _round(self.difference),
            "low": _round(self.low),
            "high": _round(self.high),
            "margin": self.rule.margin,
            "confidence": self.rule.confidence,
            "resamples": self.rule.resamples,
            "seed": self.rule.seed,
            "min_samples": self.rule.min_samples,
            "min_calls": self.rule.min_calls,
            "why": self.why,
        }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _signed(v: float) -> str:
    # Sums of equal floats differ in the last bit: a change of -1e-17 reads +0.000, not -0.000.
    return f"{round(v, 6) + 0.0:+.3f}"


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def settled(side: Side, rule: Rule) -> bool:
    """Whether one side holds the rule's least evidence and its mean is known to within a
    quarter of the margin (the half-width of a normal interval at the rule's confidence): more
    samples would narrow a comparison with it little. Steady traffic settles at the least
    evidence; traffic whose acceptance varies from window to window does not."""
    if side.n < rule.min_samples or side.n_calls < rule.min_calls:
        return False
    z = statistics.NormalDist().inv_cdf(0.5 + rule.confidence / 2)
    return z * statistics.stdev(side.values) / math.sqrt(side.n) <= rule.margin / 4


def judge(before: Side, after: Side, rule: Rule = Rule(), unit: str = "calls") -> Judgement:
    """The rule's decision on ``after`` against ``before`` (see the module docstring)."""
    short = [
        f"{name} has {s.n} of {rule.min_samples} {unit}"
        for name, s in (("before", before), ("after", after))
        if s.n < rule.min_samples
    ] + [
        f"{name} spans {s.n_calls} of {rule.min_calls} calls"
        for name, s in (("before", before), ("after", after))
        if s.n_calls < rule.min_calls
    ]
    if short:
        return Judgement(NOT_ENOUGH, rule, before, after, unit, why="; ".join(short))
    low, high = interval(before.values, after.values, rule)
    if low >= -rule.margin:
        decision, why = NOT_WORSE, ""
    elif high < -rule.margin:
        decision, why = WORSE, ""
    else:
        decision, why = NOT_ENOUGH, "the interval straddles the margin"
    return Judgement(decision, rule, before, after, unit, low, high, why)


def interval(
    before: Sequence[float], after: Sequence[float], rule: Rule = Rule()
) -> tuple[float, float]:
    """The ``rule.confidence`` percentile bootstrap interval of ``mean(after) - mean(before)``
    (each side resampled on its own; the same seed, the same interval)."""
    if not before or not after:
        raise ValueError("both sides need samples")
    rng = random.Random(rule.seed)
    b, a = list(before), list(after)
    nb, na = len(b), len(a)
    diffs = sorted(
        sum(rng.choices(a, k=na)) / na - sum(rng.choices(b, k=nb)) / nb
        for _ in range(rule.resamples)
    )
    tail = (1.0 - rule.confidence) / 2
    return percentile(diffs, tail), percentile(diffs, 1.0 - tail)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted ``ordered``, linear between neighbours."""
    rank = (len(ordered) - 1) * q
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)
