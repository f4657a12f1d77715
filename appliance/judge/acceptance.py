"""Draft acceptance after a change against before: the one judgement behind every MTP-aware gate.

MTP's commonest regression keeps every answer and accepts fewer drafts, so decoding is slower
(vLLM PR 49262: 31B acceptance at k=4 fell from 65-77% to 34-46% with outputs unchanged). The
canary (per prompt), the fleet soak (one window of live traffic per side) and the paired bench
(per request) all hand their figures here as paired samples, before and after:

- the statistic is the **median of the per-sample changes** in acceptance (accepted / draft
  tokens): one odd prompt does not decide, and a drop across the set always does; with one sample
  (a soak window) it is that sample's change;
- a median drop beyond ``max_acceptance_drop`` (absolute) fails; so does a fall in tokens per step
  (1 + accepted / drafts) beyond ``max_tokens_per_step_drop`` (a fraction of the old figure) where
  that tolerance is given; a rise is reported, never a failure.

Only samples that drafted on both sides count. The counter arithmetic is :mod:`specdecode`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from ..engine_api import specdecode
from ..errors import UsageError

_EPS = 1e-9  # a float tolerance: a drop of exactly the tolerance passes


@dataclass(frozen=True)
class Tolerance:
    """How much worse drafting may get: acceptance (absolute), tokens per step (a fraction of
    the old figure; None: not judged)."""

    max_acceptance_drop: float = 0.10
    max_tokens_per_step_drop: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_acceptance_drop", "max_tokens_per_step_drop"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise UsageError(f"{name} must be within 0..1, not {value}")


@dataclass(frozen=True)
class Change:
    """Acceptance before and after over ``samples`` paired samples that drafted on both sides."""

    samples: int
    unit: str  # what a sample is: "prompts", "requests", "windows"
    before: specdecode.Delta  # the samples' figures added up
    after: specdecode.Delta
    median_change: float  # of the per-sample acceptance changes (after - before)

    def failures(self, tol: Tolerance) -> tuple[str, ...]:
        """One line per tolerance exceeded; empty when drafting held up."""
        out = []
        if -self.median_change > tol.max_acceptance_drop + _EPS:
            how = (
                f"median drop {-self.median_change:.0%} over {self.samples} {self.unit}"
                if self.samples > 1
                else f"drop {-self.median_change:.0%}"
            )
            out.append(
                f"draft acceptance fell {self.before.acceptance:.0%} -> "
                f"{self.after.acceptance:.0%} ({how}, tolerance {tol.max_acceptance_drop:.0%})"
            )
        tb, ta = self.before.tokens_per_step, self.after.tokens_per_step
        if tol.max_tokens_per_step_drop is not None and tb and ta is not None:
            fall = (tb - ta) / tb
            if fall > tol.max_tokens_per_step_drop + _EPS:
                out.append(
                    f"tokens per step fell {tb:.2f} -> {ta:.2f} (by {fall:.0%}, "
                    f"tolerance {tol.max_tokens_per_step_drop:.0%})"
                )
        return tuple(out)

    def summary(self) -> str:
        """One clause: the acceptance on both sides and the paired change."""
        steps = ""
        tb, ta = self.before.tokens_per_step, self.after.tokens_per_step
        if tb is not None and ta is not None:
            steps = f", tokens per step {tb:.2f} -> {ta:.2f}"
        return (
            f"acceptance {self.before.acceptance:.0%} -> {self.after.acceptance:.0%} over "
            f"{self.samples} {self.unit} (median change {self.median_change:+.0%}{steps})"
        )

    def figures(self) -> dict:
        """Every figure, JSON-serialisable, under stable keys."""

        def side(d: specdecode.Delta) -> dict:
            return {
                "acceptance": round(d.acceptance, 4),
                "tokens_per_step": round(d.tokens_per_step, 4),
                "per_position": [round(p, 4) for p in d.per_position or ()],
            }

        return {
            "samples": self.samples,
            "unit": self.unit,
            "median_change": round(self.median_change, 4),
            "before": side(self.before),
            "after": side(self.after),
        }


def _drafted(d: specdecode.Delta | None) -> bool:
    return d is not None and d.status == "ok" and bool(d.drafts) and bool(d.draft_tokens)


def change(
    pairs: Iterable[tuple[specdecode.Delta | None, specdecode.Delta | None]], unit: str = "samples"
) -> Change | None:
    """The paired change over ``(before, after)`` samples (``unit`` names them); None when no
    sample drafted on both sides (MTP off on a side, or no figures recorded)."""
    both = [(b, a) for b, a in pairs if _drafted(b) and _drafted(a)]
    if not both:
        return None
    changes = [a.acceptance - b.acceptance for b, a in both]
    return Change(
        samples=len(both),
        unit=unit,
        before=specdecode.summed([b for b, _ in both]),
        after=specdecode.summed([a for _, a in both]),
        median_change=statistics.median(changes),
    )
