"""The k sweep: run the same bench at several num_speculative_tokens and recommend one.

A running vLLM cannot change ``num_speculative_tokens`` per request, so every k needs its own
server. On the local CPU engine ``sweep_local`` starts one per k in turn; on a GPU host start
one server (or unit instance) per k and hand their URLs to ``sweep_urls``.
The recommendation is the k with the lowest median TPOT (vLLM's definition); ties go to the
smaller k (less drafting work for the same speed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import local
from ..errors import UsageError
from ..profiles import Profile, get
from . import schedule, stats
from .runner import (
    BenchConfig,
    EndpointResult,
    Progress,
    open_endpoint,
    parse_distinct_ints,
    run_endpoint,
)


@dataclass
class SweepRow:
    """The figures for one k."""

    k: int
    result: EndpointResult

    @property
    def tpot_median_s(self) -> float | None:
        s = stats.summarise([r.tpot_s for r in self.result.records if r.tpot_s is not None])
        return s.median if s else None

    def to_dict(self) -> dict:
        spec = self.result.spec_totals()
        tpots = [r.tpot_s for r in self.result.records if r.tpot_s is not None]
        tps = [r.output_tps for r in self.result.records]
        return {
            "k": self.k,
            "tpot_median_s": self.tpot_median_s,
            "output_tps_median": stats.summarise(tps).median,
            # 95% intervals of the means, for the report's figures against k.
            "tpot_mean_ci_s": stats.mean_interval(tpots),
            "output_tps_mean_ci": stats.mean_interval(tps),
            "tokens_per_step": spec["tokens_per_step"],
            "acceptance": spec["acceptance"],
            "per_position": spec["per_position"],
            "result": self.result.to_dict(),
        }


@dataclass
class SweepResult:
    rows: list[SweepRow]

    @property
    def recommended(self) -> int | None:
        """The k with the best (lowest) median TPOT."""
        scored = [(r.tpot_median_s, r.k) for r in self.rows if r.tpot_median_s is not None]
        return min(scored)[1] if scored else None

    def prediction(self) -> dict | None:
        """From the largest k's run: tokens per step (and TPOT, when a second k gives the step
        cost) at every k' <= k, beside what the sweep measured at each k'."""
        rows = [r for r in self.rows if r.tpot_median_s is not None]
        if not rows:
            return None
        top = max(rows, key=lambda r: r.k)
        lengths = schedule.predicted_lengths_of([r.spec for r in top.result.records])
        if lengths is None:
            return None
        points = {
            r.k: (r.k, r.tpot_median_s, r.result.spec_totals()["tokens_per_step"]) for r in rows
        }
        low = min(rows, key=lambda r: r.k)
        cost = None
        if low.k != top.k and points[low.k][2] and points[top.k][2]:
            cost = schedule.step_cost(points[low.k], points[top.k])
        tpots = schedule.predicted_tpot(lengths, cost) if cost else None
        return {
            "from_k": top.k,
            "step_cost_from_k": None if cost is None else [low.k, top.k],
            "rows": [
                {
                    "k": i + 1,
                    "predicted_tokens_per_step": length,
                    "measured_tokens_per_step": points[i + 1][2] if i + 1 in points else None,
                    "predicted_tpot_s": None if tpots is None else tpots[i],
                    "measured_tpot_s": points[i + 1][1] if i + 1 in points else None,
                }
                for i, length in enumerate(lengths)
            ],
        }

    def to_dict(self) -> dict:
        return {
            "recommended_k": self.recommended,
            "prediction": self.prediction(),
            "criterion": "lowest median TPOT = (E2EL - TTFT) / (output_tokens - 1)",
            "rows": [r.to_dict() for r in self.rows],
        }


def parse_ks(text: str) -> list[int]:
    """``"1,2,3,4"`` -> ``[1, 2, 3, 4]``; each k between 1 and 16, no repeats."""
    return parse_distinct_ints(text, "--k", "1,2,3,4", 16)


def with_k(profile: Profile, k: int) -> Profile:
    """``profile`` with its speculative config's ``num_speculative_tokens`` set to ``k``."""
    if profile.speculative is None:
        raise UsageError(f"profile {profile.name} has no speculative decoding to sweep")
    spec = dataclasses.replace(profile.speculative, num_speculative_tokens=k)
    return dataclasses.replace(profile, speculative=spec)


def sweep_local(
    profile: str | Profile,
    ks: list[int],
    config: BenchConfig,
    *,
    drafter: str = "copy",
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    timeout_s: float = 900.0,
) -> SweepResult:
    """Start the local CPU engine once per k (in turn), bench it, stop it."""
    prof = get(profile) if isinstance(profile, str) else profile
    rows = []
    for k in ks:
        if on_start:
            on_start(k)
        with local.serve(with_k(prof, k), drafter=drafter, timeout=timeout_s) as eng:
            ep = open_endpoint(eng.url, f"k={k}")
            rows.append(SweepRow(k, run_endpoint(ep, config, progress)))
    return SweepResult(rows)


def sweep_urls(
    urls: dict[int, str],
    config: BenchConfig,
    progress: Progress | None = None,
    api_key: str | None = None,
) -> SweepResult:
    """Bench servers that are already running, one per k (the GPU-host path)."""
    eps = {k: open_endpoint(u, f"k={k}", api_key) for k, u in sorted(urls.items())}
    return SweepResult([SweepRow(k, run_endpoint(ep, config, progress)) for k, ep in eps.items()])
