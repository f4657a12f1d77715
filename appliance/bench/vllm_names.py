"""Bench figures under ``vllm bench serve``'s result names, beside the appliance's own.

``vllm bench serve --save-result`` writes one JSON object per run (vllm/benchmarks/serve.py,
``benchmark()`` and ``calculate_metrics()``): latencies in milliseconds as mean, median, std and
the ``--metric-percentiles`` (p99 by default) of TTFT, TPOT, ITL and E2EL; counts and throughputs
over the benchmark's duration; the speculative figures as ``spec_decode_*``, the acceptance rate
in percent. The appliance's records keep their own names (seconds, median with p90 or p99,
acceptance 0..1, ``tokens_per_step``). Each also carries the same requests' figures under vLLM's
names, made here: the one mapping from one vocabulary to the other, so that a bench and a
``vllm bench serve`` run compare key by key.

The arithmetic is vLLM's: ``std`` is the population deviation (numpy's default), a percentile
interpolates linearly between ranks, TPOT counts requests of more than one token only, ITL is
every gap between chunks of every request (a step of 1 + accepted tokens under MTP). A figure
with no requests to compute it from is left out (vLLM writes 0 there).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..engine_api import specdecode
from . import stats

if TYPE_CHECKING:
    from .runner import RunRecord

# vLLM's latency metrics and the record field holding each (seconds).
LATENCIES = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2el_s"}
PERCENTILES = (99,)  # vllm bench serve's default --metric-percentiles
MS = 1000.0
# vLLM's speculative result fields: the :meth:`specdecode.Delta.to_dict` figure each one is, and
# the factor from the appliance's unit to vLLM's (the acceptance rate is a percentage there).
SPEC = {
    "spec_decode_acceptance_rate": ("acceptance", 100.0),
    "spec_decode_acceptance_length": ("tokens_per_step", 1.0),
    "spec_decode_num_drafts": ("drafts", 1),
    "spec_decode_draft_tokens": ("draft_tokens", 1),
    "spec_decode_accepted_tokens": ("accepted", 1),
    "spec_decode_per_position_acceptance_rates": ("per_position", 1),
}


def _latency(values: list[float]) -> dict[str, float]:
    """``mean``, ``median``, ``std`` and ``p99`` (ms) of ``values`` (seconds); {} without any."""
    if not values:
        return {}
    out = {
        "mean": statistics.fmean(values) * MS,
        "median": statistics.median(values) * MS,
        "std": statistics.pstdev(values) * MS,
    }
    return out | {f"p{p}": stats.percentile(values, p) * MS for p in PERCENTILES}


def _spec(spec: specdecode.Delta | None) -> dict:
    """The ``spec_decode_*`` fields, which vLLM writes only when tokens were drafted."""
    if spec is None or spec.status != "ok" or not spec.draft_tokens:
        return {}
    figures = spec.to_dict()
    out = {}
    for key, (name, factor) in SPEC.items():
        value = figures[name]
        if value is None:
            continue
        out[key] = [v * factor for v in value] if isinstance(value, list) else value * factor
    return out


def fields(
    records: Sequence[RunRecord],
    spec: specdecode.Delta | None,
    duration_s: float | None = None,
) -> dict:
    """``records``' figures under vLLM's result names; ``spec``: their speculative figures;
    ``duration_s``: the benchmark duration as vLLM times it (first request sent to last one
    done), without which there is no throughput (a bench of one request at a time has none)."""
    out: dict = {"completed": len(records)}
    prompt = [r.prompt_tokens for r in records]
    output = sum(r.output_tokens for r in records)
    if None not in prompt:
        out["total_input_tokens"] = sum(prompt)
    out["total_output_tokens"] = output
    if duration_s:
        out["duration"] = duration_s
        out["request_throughput"] = len(records) / duration_s
        out["output_throughput"] = output / duration_s
        if "total_input_tokens" in out:
            out["total_token_throughput"] = (out["total_input_tokens"] + output) / duration_s
    for metric in LATENCIES:
        for stat, value in _latency(_values(records, metric)).items():
            out[f"{stat}_{metric}_ms"] = value
    return out | _spec(spec)


def _values(records: Sequence[RunRecord], metric: str) -> list[float]:
    """The seconds of ``metric`` over ``records``: one a request, every gap for ITL."""
    if metric == "itl":
        return [x for r in records for x in r.itl_s]
    values = [getattr(r, LATENCIES[metric]) for r in records]
    return [v for v in values if v is not None]  # TPOT: none for one token, as vLLM skips it
