"""Benchmark (issue 52): each operation under real systemd on an idle instance and under steady
traffic, side by side. Not part of the suite (its name is not ``test_*``, so pytest collects it
only when named): ``benchmarks/traffic.py --systemd`` runs it on the systemd tier's machine and
instance. No timed assertion; it prints a table.

Per operation: its exit and wall seconds; idle, how long ``/health`` was not 200 (a poller every
0.25 s, nothing else calling); under traffic, tests/plugins/traffic.py's six clients and the
requests by class (whole, 503, connection refused, cut, error) with how long the instance
turned traffic away. The operations, in this order from the MTP image and back to it:
``systemctl restart``; a cutover to a good image (the same image under a version tag of another
repository, so no new image starts cold); ``appliance rollback``; a cutover to a broken image and
its way back. An operation that exits non-zero prints its last line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Self

import httpx
import pytest
from plugins.systemd_instance import BROKEN_IMAGE, MTP_IMAGE, SystemdInstance
from plugins.traffic import Report, Traffic

pytestmark = [pytest.mark.systemd, pytest.mark.bench, pytest.mark.timeout(3600)]

GOOD = "gemma4-vllm-bench:0.32.0-mtp-cpu"  # MTP_IMAGE, tagged in the test
POLL_S = 0.25


class HealthPoller:
    """``/health`` every ``POLL_S`` on its own thread; :attr:`refusing_s` is how long, in all,
    it was not 200 (stretches from the first such poll to the next 200)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + "/health"
        self.polls: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                ok = httpx.get(self.url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.polls.append((t, ok))
            self._stop.wait(POLL_S)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def refusing_s(self) -> float:
        total, since = 0.0, None
        for t, ok in self.polls:
            if not ok and since is None:
                since = t
            elif ok and since is not None:
                total, since = total + t - since, None
        if since is not None:
            total += self.polls[-1][0] - since
        return total


def _operations(inst: SystemdInstance) -> dict[str, Callable[[], int]]:
    def appliance(*args: str) -> int:
        r = inst.appliance(*args)
        if r.returncode:
            print(f"appliance {args[0]} exit {r.returncode}: {r.stderr.strip()[-300:]}")
        return r.returncode

    return {
        "systemctl restart": lambda: (
            inst.machine.systemctl("restart", inst.unit, check=False, timeout=900).returncode
        ),
        "cutover, good image": lambda: appliance(
            "cutover", inst.instance, GOOD, "--timeout", "600"
        ),
        "appliance rollback": lambda: appliance("rollback", inst.instance),
        "cutover, broken image": lambda: appliance(
            "cutover", inst.instance, BROKEN_IMAGE, "--timeout", "600"
        ),
    }


def _run(inst: SystemdInstance, op: Callable[[], int], busy: bool) -> tuple:
    if busy:
        with Traffic(inst.url, inst.api_key, label="benchmark") as traffic:
            start = time.monotonic()
            code = op()
            seconds = time.monotonic() - start
            traffic.wait_back()
        return code, seconds, traffic.report, None
    with HealthPoller(inst.url) as poller:
        start = time.monotonic()
        code = op()
        seconds = time.monotonic() - start
        # Until /health answers 200 again (a restart returns before vLLM listens).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (poller.polls and poller.polls[-1][1]):
            time.sleep(POLL_S)
    return code, seconds, None, poller.refusing_s


def test_each_operation_idle_and_under_traffic(systemd_instance, docker_engine):
    inst = systemd_instance
    docker_engine.images.get(MTP_IMAGE).tag(*GOOD.split(":"))
    rows = []
    try:
        for busy in (False, True):
            inst.ensure(MTP_IMAGE)
            for name, op in _operations(inst).items():
                code, seconds, report, idle_refusing = _run(inst, op, busy)
                rows.append((name, busy, code, seconds, report, idle_refusing))
                if report:
                    print(f"{name} under traffic:\n{report.summary()}", flush=True)
    finally:
        inst.ensure(MTP_IMAGE)
        docker_engine.images.remove(GOOD, noprune=True)  # the tag only: tests list the tags
    print(table(rows))


def table(rows: list[tuple[str, bool, int, float, Report | None, float | None]]) -> str:
    """Each operation idle, then under traffic (rows in any order; paired by name)."""
    title = "cpu-tiny-mtp under systemd; idle: /health polled; traffic: tests/plugins/traffic.py"
    columns = "exit   op s  whole   503  refused  cut  error  refusing s"
    lines = [f"\n{title}", f"{'operation':<22} {'engine':<8} {columns}"]
    for name, busy, code, seconds, report, idle_refusing in sorted(rows, key=lambda r: r[0]):
        head = f"{name:<22} {'traffic' if busy else 'idle':<8} {code:4} {seconds:6.1f}"
        if report is None:
            dashes = f"{'-':>6} {'-':>5} {'-':>8} {'-':>4} {'-':>6}"
            lines.append(f"{head} {dashes} {idle_refusing:11.1f}")
            continue
        c = report.counts()
        lines.append(
            f"{head} {c['whole']:6} {report.shed():5} {c['refused'] - report.shed():8} "
            f"{c['cut']:4} {c['error']:6} {report.refused_seconds:11.1f}"
        )
    return "\n".join(lines)
