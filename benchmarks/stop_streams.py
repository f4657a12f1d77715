"""Streams in flight at an image's stop: does each one finish, and how long does the stop take?

The image is run as its unit runs it (the serve program's ``run``, under a temporary root, the
session's tiny copy-drafter models); six streams of 200-400 tokens start, and ``docker stop``
comes once each has its first token. Per round: the stop's seconds, and each stream whole (its
finish reason and ``[DONE]``), refused (503 from the stop gate: a client retries) or cut (its
tokens, and when the last one came). A stream that gets no further token until docker's kill
at the end of the grace (60 s) is what vLLM 0.19's engine core did when it exited with its last
outputs still queued (appliance/engine/vllm_main.py).

Measured on 2 cores (2026-12-06), the 0.19 image: before its entry point sent the last outputs,
4 of 8 stops ran to docker's kill, each with one stream cut a few tokens short of its end;
after, none of 19 that way (one other stop of 16: the engine core died in glibc at the SIGTERM,
open). The figures are printed, never asserted.

Usage: ``.venv/bin/python benchmarks/stop_streams.py [IMAGE] [ROUNDS]`` (root, Docker, the
images built: ``python tests/prefetch.py venv``). Default: the pre-MTP image, 8 rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from appliance import units
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.host import envfile
from appliance.host.layout import Layout

NAME = "stopbench"
LENGTHS = (400, 300, 200, 400, 300, 200)


def stream(url: str, key: str, tokens: int, rec: dict, flowing: threading.Event) -> None:
    """One streamed chat completion of exactly ``tokens`` tokens; what came, into ``rec``;
    ``flowing`` set at its first token (or its end)."""
    t0 = time.monotonic()
    rec.update(status=None, tokens=0, done=False, finish=None, last=None, error=None)
    body = {
        "model": "gemma4-tiny",
        "messages": [{"role": "user", "content": "tell a long story"}],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": True,
    }
    try:
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=body,
            timeout=httpx.Timeout(120, connect=5),
        ) as r:
            rec["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    rec["done"] = True
                elif line.startswith("data: "):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    rec["tokens"] += 1
                    rec["last"] = round(time.monotonic() - t0, 2)
                    rec["finish"] = choices[0].get("finish_reason") or rec["finish"]
                    flowing.set()
    except httpx.HTTPError as exc:
        rec["error"] = type(exc).__name__
    flowing.set()
    rec["end"] = round(time.monotonic() - t0, 2)


def main(image: str, rounds: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="stop-streams-"))
    port = free_port()
    opts = units.Options(port=port, image=image, model_dir=str(devmodel.cached("copy").root))
    units.install("cpu-tiny-mtp", NAME, root=root, options=opts)
    layout = Layout(root)
    env = {
        **os.environ,
        **envfile.read(layout.env_file(NAME)).values,
        "APPLIANCE_ROOT": str(root),
    }
    key = layout.api_key_file(NAME).read_text().strip()
    url = f"http://127.0.0.1:{port}"
    container = layout.shape(NAME).container
    print(f"{image}: {rounds} rounds, streams of {LENGTHS} tokens, stopped in flight")
    slow = 0
    for n in range(rounds):
        serve = subprocess.Popen(
            [str(layout.serve_program), NAME, "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"{image} did not become healthy within 300 s")
            time.sleep(0.5)
        recs = [{} for _ in LENGTHS]
        flowing = [threading.Event() for _ in LENGTHS]
        threads = [
            threading.Thread(target=stream, args=(url, key, t, r, f))
            for t, r, f in zip(LENGTHS, recs, flowing)
        ]
        for t in threads:
            t.start()
        for f in flowing:  # every stream generating: the stop comes in flight, whatever the load
            f.wait(60)
        t0 = time.monotonic()
        subprocess.run(["docker", "stop", "-t", "60", container], capture_output=True, check=False)
        took = time.monotonic() - t0
        for t in threads:
            t.join(130)
        serve.wait(60)
        refused = [r for r in recs if r["status"] == 503]  # the stop gate: a client retries
        cut = [r for r in recs if not r["done"] and r not in refused]
        slow += took > 30
        whole = len(recs) - len(cut) - len(refused)
        print(
            f"  round {n}: stop {took:5.1f} s, {whole} whole, {len(refused)} refused (503), "
            f"{len(cut)} cut"
        )
        for r in cut:
            print(f"    cut after {r['tokens']} chunks, the last at {r['last']} s ({r['error']})")
    print(f"{image}: {slow} of {rounds} stops ran to docker's kill")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "gemma4-vllm:0.19.0-cpu",
        int(sys.argv[2]) if len(sys.argv) > 2 else 8,
    )
