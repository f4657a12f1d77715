"""What an engine start costs with the garbage collector as the serve program sets it, and as
Python leaves it.

The image's serve program (appliance/engine/vllm_main.py) loads vLLM with the collector off and
freezes what the load built (``load_frozen``). Each round starts the same image twice, one way
then the other, on the session's tiny copy-drafter pair: the container's CPU-seconds (its
cgroup's, engine core included) and wall seconds until ``/health`` answers, then one chat call
to show it serves. "collector on" is the same image and entry point with ``gc.disable`` and
``gc.freeze`` made no-ops (a ``sitecustomize`` on its ``PYTHONPATH``). Printed side by side in
one run, with the medians' ratio; never asserted.

Measured on 2 cores (2026-12-07), the vLLM 0.32 CPU image, 3 rounds: 22.0-25.2 s of CPU with
the collector on, 15.7-17.2 s as set (medians' ratio 0.69; wall 0.72).

Usage: ``.venv/bin/python benchmarks/engine_start.py [IMAGE] [ROUNDS]`` (root, Docker, cgroup
v1's cpuacct, the images built: ``python tests/prefetch.py venv``). Default: the MTP image, 3.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from appliance.engine import devmodel
from appliance.engine.local import free_port

# "collector on": Python imports sitecustomize at its start, before the serve program runs.
UNDO = "import gc\n\ngc.disable = gc.freeze = lambda: None\n"
CGROUP = Path("/sys/fs/cgroup/cpuacct/docker")


def start(image: str, undo: Path | None, model: devmodel.DevModel) -> tuple[float, float, int]:
    """One start: (CPU-seconds, wall seconds) until /health, and the chat call's status."""
    port = free_port()
    spec = {"method": "mtp", "model": "/models/drafter", "num_speculative_tokens": 2}
    argv = ["docker", "run", "-d", "--rm", "--init", "--shm-size", "1g"]
    argv += ["-p", f"127.0.0.1:{port}:8000"]
    if undo is not None:
        argv += ["-v", f"{undo}:/undo:ro", "-e", "PYTHONPATH=/undo"]
    argv += ["-v", f"{model.target}:/models/target:ro", "-v", f"{model.drafter}:/models/drafter:ro"]
    for env in ("HF_HUB_OFFLINE=1", "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind"):
        argv += ["-e", env]
    argv += [image, "/models/target"]
    argv += ["--served-model-name", "gemma4-tiny", "--dtype", "float32", "--max-model-len", "512"]
    argv += ["--enforce-eager", "--speculative-config", json.dumps(spec), "--port", "8000"]
    t0 = time.monotonic()
    cid = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 600:
                raise SystemExit(f"{image}: no /health within 600 s")
            time.sleep(0.2)
        wall = time.monotonic() - t0
        cpu = int((CGROUP / cid / "cpuacct.usage").read_text()) / 1e9
        chat = {"model": "gemma4-tiny", "messages": [{"role": "user", "content": "hi"}]}
        chat["max_tokens"] = 8
        status = httpx.post(f"{url}/v1/chat/completions", json=chat).status_code
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, check=False)
    return cpu, wall, status


def main(image: str, rounds: int) -> None:
    model = devmodel.cached("copy")
    undo = Path(tempfile.mkdtemp(prefix="engine-start-"))
    (undo / "sitecustomize.py").write_text(UNDO)
    got: dict[str, list[tuple[float, float]]] = {"as set": [], "on": []}
    print(f"{image}: {rounds} rounds, CPU-seconds and wall seconds until /health")
    for r in range(rounds):
        for label, where in (("as set", None), ("on", undo)):
            cpu, wall, status = start(image, where, model)
            got[label].append((cpu, wall))
            print(
                f"round {r + 1}: collector {label:6} {cpu:6.1f} s CPU {wall:6.1f} s, chat {status}"
            )
    med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in got.items()}
    for label, (cpu, wall) in med.items():
        print(f"median, collector {label:6}: {cpu:6.1f} s CPU {wall:6.1f} s")
    print(f"ratio as set / on: CPU {med['as set'][0] / med['on'][0]:.2f}, wall "
          f"{med['as set'][1] / med['on'][1]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "gemma4-vllm:0.32.0-mtp-cpu",
        int(sys.argv[2]) if len(sys.argv) > 2 else 3,
    )
