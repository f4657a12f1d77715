"""How fast this host runs plain Python right now: one figure to read a suite's time against.

The suite's time moves with the host: on this project's 2-core machine two runs of nearly the
same suite took 23.6 minutes one morning and 39.6 that evening, every tier about 1.5 times as
long, the untouched ones too. ``scripts/test.sh`` prints this figure before any of its work
and again at the end, so two runs' times can be read against their hosts'. A figure, not a
gate.
"""

from __future__ import annotations

import time

LOOPS = 3_000_000


def reference_seconds(repeats: int = 3) -> float:
    """The best of ``repeats`` timings of a fixed pure-Python loop (multiply-adds)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(LOOPS):
            total += i * i
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    print(f"host speed: {reference_seconds():.2f} s for the reference loop (best of 3)")
