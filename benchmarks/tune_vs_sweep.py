"""What ``appliance bench tune`` costs against a restart-per-k sweep, on the CPU engine, in one run.

Both answer "which k at each concurrency level" for the tiny pair with the partial drafter
(acceptance falling by position):

- tune: one MTP engine at k = ``--k`` and one baseline engine, each benched once per level;
  k' <= k predicted from that run (appliance/bench/tune.py);
- the sweep: one engine per k in 1..k (a model load each, as ``bench sweep`` does), each
  benched at every level; the measured fastest k (lowest median TPOT) per level.

Printed side by side: each one's wall time (engine starts included) and their ratio, and per
level the k each picks with the TPOTs behind it. Figures, not assertions; on a CPU a draft costs
about what a token costs, so the k they pick says nothing about a GPU:

    .venv/bin/python benchmarks/tune_vs_sweep.py --k 3 --concurrency 1,4 --requests 8
"""

from __future__ import annotations

import argparse
import time

from appliance import profiles
from appliance.bench import concurrency, prompts, runner, sweep, tune
from appliance.engine import local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--drafter", default="partial")
    a = ap.parse_args()
    levels = concurrency.parse_levels(a.concurrency)
    config = runner.BenchConfig(tuple(prompts.resolve(limit=1)), (a.max_tokens,), 1, 1)
    base_prof = profiles.get("cpu-tiny")
    mtp_prof = sweep.with_k(profiles.get("cpu-tiny-mtp"), a.k)

    t0 = time.monotonic()
    with (
        local.serve(mtp_prof, drafter=a.drafter) as m,
        local.serve(base_prof, drafter=a.drafter) as b,
    ):
        mtp = runner.open_endpoint(m.url, "mtp")
        base = runner.open_endpoint(b.url, "baseline")
        tuned = tune.run(mtp_prof, mtp, base, config, levels, a.requests)
    tune_s = time.monotonic() - t0

    t0 = time.monotonic()
    measured: dict[int, dict[int, float | None]] = {n: {} for n in levels}
    for k in range(1, a.k + 1):
        with local.serve(sweep.with_k(mtp_prof, k), drafter=a.drafter) as eng:
            ep = runner.open_endpoint(eng.url, f"k={k}")
            for lv in concurrency.run_concurrency(ep, config, levels, a.requests).levels:
                measured[lv.concurrency][k] = lv.tpot_median_s()
    sweep_s = time.monotonic() - t0

    print(f"k <= {a.k}, drafter {a.drafter}, levels {levels}, {a.requests} requests per level")
    print(f"{'':24}{'tune':>12}{'sweep':>12}")
    print(f"{'engine starts':24}{2:>12}{a.k:>12}")
    print(f"{'wall time, s':24}{tune_s:>12.1f}{sweep_s:>12.1f}")
    print(f"{'sweep / tune':24}{sweep_s / tune_s:>12.2f}")
    for c in tuned.choices:
        tpots = measured[c.concurrency]
        best = min((t, k) for k, t in tpots.items() if t is not None)[1]
        pred = " ".join(f"{t * 1000:.1f}" for t in c.predicted_tpot_s)
        meas = " ".join(f"{(tpots[k] or 0) * 1000:.1f}" for k in sorted(tpots))
        print(
            f"concurrency {c.concurrency}: k tune {c.chosen_k}, sweep {best}; TPOT ms per k "
            f"predicted {pred} | measured {meas}"
        )
    print(f"schedule: {[list(e) for e in tuned.schedule]}")


if __name__ == "__main__":
    main()
