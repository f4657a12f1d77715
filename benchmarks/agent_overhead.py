"""What the telemetry agent adds to a call, against the bare OpenAI client on the same server.

Starts the real CPU engine twice (per-request metrics on, then off: the ``/metrics`` snapshot
path), sends the same plain chat call alternately through the bare client and the agent, and
prints the median and p99 of the paired differences (agent minus bare), plus how many
``/metrics`` reads the agent made per call. Figures, not assertions:

    .venv/bin/python benchmarks/agent_overhead.py --calls 60
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import openai
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from appliance import agent, profiles, specdecode
from appliance.agent import attribution
from appliance.engine import local


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(url: str, calls: int, max_tokens: int) -> dict:
    bare = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    traced = agent.instrument(
        openai.OpenAI(base_url=url + "/v1", api_key="unused"), role="bench",
        config=agent.AgentConfig(), tracer_provider=TracerProvider(), registry=CollectorRegistry(),
    )
    server = attribution.server_for(url + specdecode.SNAPSHOT_PATH)
    reads = 0
    real_snapshot = server.snapshot

    def counted(*args, **kwargs):
        nonlocal reads
        reads += 1
        return real_snapshot(*args, **kwargs)

    server.snapshot = counted  # counts the agent's /metrics reads; the reads stay real
    kw = {"model": "gemma4-tiny", "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": max_tokens, "temperature": 0}
    for _ in range(3):  # warm both connection pools and the agent's learned state
        bare.chat.completions.create(**kw)
        traced.chat.completions.create(**kw)
    reads = 0
    diffs, bare_s = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        bare.chat.completions.create(**kw)
        t1 = time.perf_counter()
        traced.chat.completions.create(**kw)
        t2 = time.perf_counter()
        bare_s.append(t1 - t0)
        diffs.append((t2 - t1) - (t1 - t0))
    return {
        "bare_median_ms": statistics.median(bare_s) * 1e3,
        "added_median_ms": statistics.median(diffs) * 1e3,
        "added_p99_ms": _pct(diffs, 0.99) * 1e3,
        "metrics_reads_per_call": reads / calls,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    base = profiles.get("cpu-tiny-mtp")
    paths = {
        "per-request metrics": base,
        "/metrics snapshots": dataclasses.replace(base, per_request_spec_decode_metrics=None),
    }
    print(f"{'path':<22} {'bare med ms':>11} {'added med ms':>12} {'added p99 ms':>12} {'reads/call':>10}")
    for name, prof in paths.items():
        with local.serve(prof, drafter="copy", timeout=900) as eng:
            r = measure(eng.url, args.calls, args.max_tokens)
        print(f"{name:<22} {r['bare_median_ms']:>11.2f} {r['added_median_ms']:>12.2f} "
              f"{r['added_p99_ms']:>12.2f} {r['metrics_reads_per_call']:>10.2f}")


if __name__ == "__main__":
    main()
