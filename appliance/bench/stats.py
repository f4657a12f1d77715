"""Summary statistics for bench, with no numpy/scipy dependency.

The paired speedup is the geometric mean of per-pair ratios (MTP over baseline, same prompt,
same output length, same run index), with a Student-t confidence interval computed on the log
ratios: ratios multiply, so their logs are what is roughly symmetric.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95% Student-t quantiles (t_{0.975, df}); beyond the table the normal value is close.
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    21: 2.080,
    22: 2.074,
    23: 2.069,
    24: 2.064,
    25: 2.060,
    26: 2.056,
    27: 2.052,
    28: 2.048,
    29: 2.045,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (table, conservative)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df in _T975:
        return _T975[df]
    # Between table rows take the next smaller df: a slightly wider (conservative) interval.
    smaller = [d for d in _T975 if d < df]
    return _T975[max(smaller)] if df <= 120 else 1.960


def percentile(values: list[float], p: int) -> float:
    """The ``p``-th percentile (an integer 0..100), interpolated linearly between the two
    nearest ranks: numpy's default, the standard library's ``quantiles(method="inclusive")``."""
    if not values:
        raise ValueError("no values")
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 100:
        raise ValueError(f"percentile {p!r} is not an integer in 0..100")
    if len(values) == 1 or p in (0, 100):
        return min(values) if p == 0 else max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


@dataclass(frozen=True)
class Summary:
    """Distribution of one metric over runs."""

    n: int
    mean: float
    median: float
    stdev: float
    p90: float
    min: float
    max: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def summarise(values: list[float]) -> Summary | None:
    """Summary of ``values``; ``None`` when empty."""
    if not values:
        return None
    return Summary(
        n=len(values),
        mean=statistics.fmean(values),
        median=statistics.median(values),
        stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
        p90=percentile(values, 90),
        min=min(values),
        max=max(values),
    )


@dataclass(frozen=True)
class Speedup:
    """Geometric-mean ratio of paired measurements with its 95% confidence interval."""

    n: int
    ratio: float
    low: float | None  # None with a single pair: no interval from one sample
    high: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def paired_speedup(ratios: list[float]) -> Speedup | None:
    """Speedup and 95% CI from per-pair ratios (each > 0); ``None`` when there are none."""
    if not ratios:
        return None
    if any(r <= 0 for r in ratios):
        raise ValueError("ratios must be positive")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return Speedup(1, math.exp(mean), None, None)
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Speedup(len(logs), math.exp(mean), math.exp(mean - half), math.exp(mean + half))


def mean_interval(values: list[float]) -> dict | None:
    """Mean of ``values`` with its 95% Student-t interval (``low``/``high`` None for one value)."""
    if not values:
        return None
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"n": 1, "mean": mean, "low": None, "high": None}
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"n": len(values), "mean": mean, "low": mean - half, "high": mean + half}
