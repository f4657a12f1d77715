"""What an operation does to the clients calling an engine: each operation on an idle engine and
under steady traffic, side by side.

Two sets. ``--systemd``: under real systemd, on the systemd tier's booted machine and instance
(tests/bench_traffic_systemd.py, run through pytest for its fixtures): ``systemctl restart``, a
cutover to a good image, ``appliance rollback``, a cutover to a broken image and its way back
(the group's cutover and the fleet roll are the ``traffic`` tests', ``pytest -m traffic``,
which print the same counts). Without it, on the local CPU engine: one ``cpu-tiny-mtp`` engine
with ``max_num_seqs = 1`` (so the queue bound 2, ``--max-num-queued-reqs``: 62 of the shipped
profiles carry a bound, two of them 2) and the stop the unit gives it (``--shutdown-timeout``,
the images' stop gate, SIGTERM to vLLM's API server, as docker-init forwards it):

- ``doctor``: ``appliance instance doctor --url URL --profile FILE`` (its test generation and
  MTP check are the cutover's generation and mtp gates);
- ``canary``: ``appliance canary record`` (the cutover's output canary);
- ``restart``: the stop, then a start of the same engine on the same port.

Traffic is tests/plugins/traffic.py's: six clients (three past the bound), half streaming long
answers. Printed per operation: its exit, its wall seconds, the requests by class (whole,
refused, cut, error) and how long the engine refused traffic. No timed assertion.

Usage: ``.venv/bin/python benchmarks/traffic.py`` (about five minutes on 2 cores), or with
``--systemd`` (as root, about twenty minutes with the images built).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from plugins.traffic import Report, Traffic

from appliance import profiles
from appliance.engine import local

APPLIANCE = str(Path(sys.executable).parent / "appliance")
CLIENTS = 6
DRAIN_S = 50  # the serve program's --shutdown-timeout
# What the serve program gives an image built by the appliance: the drain and the stop gate
# (appliance/engine/stop_gate.py, beside the entry point as the images carry it).
EXTRA = [
    *("--shutdown-timeout", str(DRAIN_S), "--middleware", "stop_gate.StopGate"),
    *("--kv-cache-memory-bytes", str(64 << 20)),
]
ENV = {"PYTHONPATH": str(REPO / "appliance" / "engine")}


def bounded_profile(where: Path) -> Path:
    """cpu-tiny-mtp with max_num_seqs 1 (queue bound 2), as an operator's profile file."""
    text = (REPO / "appliance/profiles/data/cpu-tiny-mtp.toml").read_text()
    text = text.replace('name = "cpu-tiny-mtp"', 'name = "cpu-tiny-mtp-q2"\nmax_num_seqs = 1', 1)
    path = where / "cpu-tiny-mtp-q2.toml"
    path.write_text(text)
    return path


def cli(*args: str) -> int:
    return subprocess.run([APPLIANCE, *args], capture_output=True, check=False).returncode


def restart(engines: contextlib.ExitStack, running: list[local.LocalEngine]) -> int:
    """The unit's stop (SIGTERM to the API server, which drains), then a start on the same
    port, which becomes ``running[0]``. Exit: 0 once the new engine is healthy."""
    old = running[0]
    os.kill(old.process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        old.process.wait(timeout=DRAIN_S + 10)
    old.stop()  # whatever is left
    running[0] = engines.enter_context(
        local.serve(old.profile, port=old.port, extra_args=EXTRA, env=ENV, timeout=900)
    )
    return 0


def run(op: Callable[[], int], url: str, busy: bool) -> tuple[int, float, Report | None]:
    """The operation's exit and wall seconds, and the traffic's report when ``busy``."""
    traffic = Traffic(url, clients=CLIENTS) if busy else None
    if traffic:
        traffic.start().wait_flowing()
    start = time.monotonic()
    code = op()
    seconds = time.monotonic() - start
    return code, seconds, traffic.stop() if traffic else None


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as engines:
        profile = bounded_profile(Path(tmp))
        prof = profiles.lookup(str(profile))
        engine = engines.enter_context(local.serve(prof, extra_args=EXTRA, env=ENV, timeout=900))
        running = [engine]  # the same URL across the restarts
        ops: dict[str, Callable[[], int]] = {
            "doctor": lambda: cli(
                "instance", "doctor", "--url", engine.url, "--profile", str(profile)
            ),
            "canary": lambda: cli(
                *("canary", "record", "--url", engine.url, "--profile", str(profile)),
                *("--out", f"{tmp}/canary.json"),
            ),
            "restart": lambda: restart(engines, running),
        }
        rows = []
        for name, op in ops.items():
            for busy in (False, True):
                code, seconds, report = run(op, engine.url, busy)
                rows.append((name, busy, code, seconds, report))
                if report:
                    print(f"{name} under traffic:\n{report.summary()}", flush=True)
    print_table(prof.queue_bound, rows)


def print_table(bound: int | None, rows: list[tuple[str, bool, int, float, Report | None]]) -> None:
    """The side-by-side table: each operation idle, then under traffic."""
    print(f"\ncpu-tiny-mtp, max_num_seqs 1 (queue bound {bound}), {CLIENTS} clients under traffic")
    print(
        "operation  engine   exit   op s   whole  503  conn refused  cut  error  refusing s  down s"
    )
    for name, busy, code, seconds, report in rows:
        state = "traffic" if busy else "idle"
        row = f"{name:<10} {state:<8} {code:4} {seconds:6.1f}"
        if report is None:
            print(f"{row}   {'-':>5} {'-':>4} {'-':>13} {'-':>4} {'-':>6} {'-':>11} {'-':>7}")
            continue
        c = report.counts()
        refused = c["refused"] - report.shed()
        print(
            f"{row}   {c['whole']:5} {report.shed():4} {refused:13} {c['cut']:4} {c['error']:6}"
            f" {report.refused_seconds:11.1f} {report.down_seconds:7.1f}"
        )
    print("traffic/idle:")
    for (name, _, c0, s0, _), (_, _, c1, s1, _) in zip(rows[::2], rows[1::2], strict=True):
        print(f"  {name:<10} exit {c0} -> {c1}, op seconds {s1 / s0:5.2f}x")


if __name__ == "__main__":
    if sys.argv[1:] == ["--systemd"]:
        pytest = [sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider"]
        sys.exit(subprocess.call([*pytest, "tests/bench_traffic_systemd.py"], cwd=REPO))
    main()
