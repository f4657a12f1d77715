"""Shared fixtures: real engines, started once per session and shared by every test.

Each area of the suite keeps its own fixtures in ``tests/plugins/<area>.py``; they are listed in
``pytest_plugins`` below. A skipped test fails the run when ``APPLIANCE_NO_SKIP`` is set (CI):
the suite must never go green by skipping the real-engine tiers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from appliance import profiles
from appliance.engine import local

# Plugins that others import come first, so pytest registers (and assert-rewrites) them itself.
pytest_plugins: list[str] = [
    "plugins.docker_engine",
    "plugins.nspawn",
    "plugins.http_servers",
    "plugins.cutover",
    "plugins.units",
    "plugins.observability",
    "plugins.agent",
    "plugins.systemd_instance",
    "plugins.hub",
    "plugins.multinode",
    "plugins.fleet",
]


def pytest_report_header(config) -> list[str]:
    import vllm

    return [f"vllm {vllm.__version__} (CPU build)"]


# The session's engines live for the whole run, beside the other stream's engines (scripts/test.sh
# runs two at once): 64 MiB of KV cache each (thousands of tokens of the tiny model) instead of the
# profile's 1 GiB, which vLLM's CPU worker touches at start. VLLM_CPU_KVCACHE_SPACE would override
# the flag, so it goes.
SESSION_KV_CACHE_BYTES = 64 << 20


def _engine(profile, **kwargs) -> Iterator[local.LocalEngine]:
    prof = profiles.get(profile) if isinstance(profile, str) else profile
    env = {k: v for k, v in prof.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    with local.serve(
        dataclasses.replace(prof, env=env),
        extra_args=["--kv-cache-memory-bytes", str(SESSION_KV_CACHE_BYTES)],
        timeout=900,
        **kwargs,
    ) as eng:
        yield eng


@pytest.fixture(scope="session")
def mtp_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp with the copy drafter (acceptance ~1), per-request metrics on."""
    yield from _engine("cpu-tiny-mtp", drafter="copy")


@pytest.fixture(scope="session")
def mtp_random_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp with the random drafter (acceptance ~0)."""
    yield from _engine("cpu-tiny-mtp", drafter="random")


@pytest.fixture(scope="session")
def mtp_counters_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp, copy drafter, per-request metrics OFF: only /metrics counters (0.21-style)."""
    prof = dataclasses.replace(profiles.get("cpu-tiny-mtp"), per_request_spec_decode_metrics=None)
    yield from _engine(prof, drafter="copy")


@pytest.fixture(scope="session")
def baseline_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny: the same target, no speculative decoding."""
    yield from _engine("cpu-tiny")


# Two streams (scripts/test.sh runs both at once, one pytest each: `--stream machines`, `--stream
# host`). Each process has its own session fixtures, so a fixture must live in ONE stream or it
# starts twice: the booted systemd machines (the shared instance, the multi-node pair) in one;
# the local engines, the Docker tier and the fleet's two hosts in the other, about as long.
STREAMS = ("machines", "host")


def stream(item: pytest.Item) -> str:
    """The stream of a test: ``machines`` for systemd tests except the fleet's, else ``host``."""
    if "systemd" in item.keywords and "fleet" not in item.keywords:
        return "machines"
    return "host"


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--stream",
        choices=STREAMS,
        help="run only this stream's tests (scripts/test.sh runs the two side by side)",
    )


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    only = config.getoption("--stream")
    if only:
        theirs = {i.nodeid for i in items if stream(i) != only}
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in theirs])
        items[:] = [i for i in items if i.nodeid not in theirs]
    # Within a stream: what needs no image first (the other stream may be building them), the
    # fleet last. sort() is stable: collection order within each rank.
    rank = {"fleet": 2, "docker": 1}
    items.sort(key=lambda i: next((r for k, r in rank.items() if k in i.keywords), 0))


# The slowest tier a test belongs to, for the wall-time table printed at the end of a run.
TIERS = ("fleet", "multinode", "systemd", "docker", "soak", "engine", "bench")
_tier_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    tier = next((t for t in TIERS if t in report.keywords), "fast")
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _tier_seconds:
        return
    terminalreporter.section("wall time by tier (setup + call + teardown)")
    for tier in (*TIERS, "fast"):
        if tier in _tier_seconds:
            terminalreporter.write_line(f"{tier:>8}: {_tier_seconds[tier] / 60:5.1f} min")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if not os.environ.get("APPLIANCE_NO_SKIP"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped:
        reporter.write_line(
            f"APPLIANCE_NO_SKIP: {skipped} test(s) skipped; failing the run", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
