"""What ``OMP_NUM_THREADS`` costs a CPU engine: the same load with it unset and with it at 1.

Two ``cpu-tiny-mtp`` engines per setting (the session's KV cache size), then 40 calls of 48
tokens on one engine, then on both at once. Printed side by side in one run: wall seconds, the
engines' CPU-seconds (their processes' own, from /proc), and the ratios. The reason and the
numbers are in gotchas/cpu-omp-threads.md.

Usage: ``.venv/bin/python benchmarks/cpu_omp_threads.py`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from appliance import profiles
from appliance.engine import local

CALLS = 40
TOKENS = 48
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: set[int]) -> float:
    """User plus system CPU of ``pids`` (every thread of each), now."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def load(url: str) -> None:
    with httpx.Client(timeout=120) as client:
        for i in range(CALLS):
            body = {
                "model": "gemma4-tiny",
                "prompt": f"count {i} apples",
                "max_tokens": TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            client.post(url + "/v1/completions", json=body).raise_for_status()


def measure(omp: str | None) -> dict[int, tuple[float, float]]:
    """engines at once -> (wall s, engines' CPU s) for one setting of OMP_NUM_THREADS."""
    prof = profiles.get("cpu-tiny-mtp")
    env = {
        k: v for k, v in prof.env.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE")
    }
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    prof = dataclasses.replace(prof, env=env)
    extra = ["--kv-cache-memory-bytes", str(64 << 20)]
    out = {}
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(local.serve(prof, extra_args=extra)) for _ in range(2)]
        pids = set().union(*(e.pids() for e in engines))
        for n in (1, 2):
            before, start = cpu_seconds(pids), time.monotonic()
            threads = [threading.Thread(target=load, args=(e.url,)) for e in engines[:n]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[n] = (time.monotonic() - start, cpu_seconds(pids) - before)
    return out


def main() -> None:
    unset, one = measure(None), measure("1")
    print(f"{CALLS} calls x {TOKENS} tokens per engine, cpu-tiny-mtp, {os.cpu_count()} cores")
    print("engines  unset: wall, cpu   OMP_NUM_THREADS=1: wall, cpu   wall ratio  cpu ratio")
    for n in (1, 2):
        (w0, c0), (w1, c1) = unset[n], one[n]
        row = f"{n:7}  {w0:6.1f} s {c0:5.1f} s   {w1:18.1f} s {c1:5.1f} s"
        print(f"{row}   {w0 / w1:9.2f}x {c0 / c1:9.2f}x")


if __name__ == "__main__":
    main()
