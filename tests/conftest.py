"""Shared fixtures: real engines, started once per session and shared by every test.

Each area of the suite keeps its own fixtures in ``tests/plugins/<area>.py``; they are listed in
``pytest_plugins`` below. A skipped test fails the run when ``APPLIANCE_NO_SKIP`` is set (CI):
the suite must never go green by skipping the real-engine tiers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable, Iterator

import hypothesis
import pytest

from appliance import profiles
from appliance.engine import local
from appliance.models import token

# Property tests run beside engines on 2 cores: hypothesis' 200 ms deadline per example failed
# them by timing alone. The examples and their shrinking stay the same.
hypothesis.settings.register_profile("suite", deadline=None)
hypothesis.settings.load_profile("suite")

# Plugins that others import come first, so pytest registers (and assert-rewrites) them itself.
pytest_plugins: list[str] = [
    "plugins.cli",
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
    "plugins.fleet_group",
    "plugins.traffic",
]


def pytest_report_header(config) -> list[str]:
    import vllm

    return [f"vllm {vllm.__version__} (CPU build)"]


# The session's engines run beside the other stream's engines (scripts/test.sh runs two at once):
# 64 MiB of KV cache each (thousands of tokens of the tiny model) instead of the profile's 1 GiB,
# which vLLM's CPU worker touches at start. VLLM_CPU_KVCACHE_SPACE would override the flag, so it
# goes.
SESSION_KV_CACHE_BYTES = 64 << 20


def _profile(name: str, per_request: bool = True) -> profiles.Profile:
    prof = profiles.get(name)
    env = {k: v for k, v in prof.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    prof = dataclasses.replace(prof, env=env)
    if not per_request:
        prof = dataclasses.replace(prof, per_request_spec_decode_metrics=None)
    return prof


def _api_key_args() -> list[str]:
    from plugins.http_servers import API_KEY  # a plugin: imported once pytest registered it

    return ["--api-key", API_KEY]


# fixture name -> how that engine is started: its profile, drafter and extra arguments.
SESSION_ENGINES: dict[str, Callable[[], tuple[profiles.Profile, str, list[str]]]] = {
    "mtp_engine": lambda: (_profile("cpu-tiny-mtp"), "copy", []),
    "mtp_random_engine": lambda: (_profile("cpu-tiny-mtp"), "random", []),
    "mtp_counters_engine": lambda: (_profile("cpu-tiny-mtp", per_request=False), "copy", []),
    "baseline_engine": lambda: (_profile("cpu-tiny"), "copy", []),
    "api_key_engine": lambda: (_profile("cpu-tiny-mtp"), "copy", _api_key_args()),
}


class SessionEngines:
    """The session's engines: each started by its first test, stopped right after its last.

    Held to the end of the session, five idle engines (about 2.5 GiB each) sat beside the Docker
    tier's, the fleet's and the other stream's engines on a 24 GiB machine. The users of each
    are counted once the run's tests are known; tests that reach an engine another way than by
    naming its fixture (or a fixture that needs it) would find it stopped, so there are none."""

    def __init__(self) -> None:
        self.users: collections.Counter[str] = collections.Counter()
        self.running: dict[str, contextlib.ExitStack] = {}

    def count(self, items: list[pytest.Item]) -> None:
        self.users = collections.Counter(
            name for item in items for name in SESSION_ENGINES if name in item.fixturenames
        )

    def serve(self, name: str) -> Iterator[local.LocalEngine]:
        """Start engine ``name``, yield it, stop it (unless its last user already did)."""
        prof, drafter, extra = SESSION_ENGINES[name]()
        extra = [*extra, "--kv-cache-memory-bytes", str(SESSION_KV_CACHE_BYTES)]
        with contextlib.ExitStack() as stack:
            self.running[name] = stack
            yield stack.enter_context(
                local.serve(prof, drafter=drafter, extra_args=extra, timeout=900)
            )
            self.running.pop(name, None)

    def release(self, item: pytest.Item) -> None:
        """After ``item`` (and what only it needed) is torn down: stop engines it was last of."""
        for name in SESSION_ENGINES:
            if name in item.fixturenames:
                self.users[name] -= 1
                if self.users[name] <= 0 and name in self.running:
                    self.running.pop(name).close()


_engines = SessionEngines()


def pytest_collection_finish(session) -> None:
    _engines.count(session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # After the wrapped teardown, every fixture that nextitem does not need is already gone.
    try:
        return (yield)
    finally:
        _engines.release(item)


@pytest.fixture(scope="session")
def mtp_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp with the copy drafter (acceptance ~1), per-request metrics on."""
    yield from _engines.serve("mtp_engine")


@pytest.fixture(scope="session")
def mtp_random_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp with the random drafter (acceptance ~0)."""
    yield from _engines.serve("mtp_random_engine")


@pytest.fixture(scope="session")
def mtp_counters_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp, copy drafter, per-request metrics OFF: only /metrics counters (0.21-style)."""
    yield from _engines.serve("mtp_counters_engine")


@pytest.fixture(scope="session")
def baseline_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny: the same target, no speculative decoding."""
    yield from _engines.serve("baseline_engine")


@pytest.fixture(scope="session")
def api_key_engine() -> Iterator[local.LocalEngine]:
    """cpu-tiny-mtp (copy drafter) guarding /v1 with ``API_KEY``, like an installed instance."""
    yield from _engines.serve("api_key_engine")


# Two streams (scripts/test.sh runs both at once, one pytest each: `--stream machines`, `--stream
# host`). Each process has its own session fixtures, so a fixture must live in ONE stream or it
# starts twice: the booted systemd machines (the shared instance, the one-host multi-node pair)
# in one; the session's local engines, the Docker tier and the fleet's two hosts (with the group
# across them) in the other. The soak and the tests that start engines of their own only go with
# the machines, early, so that both take about as long. The fleet runs last and mostly alone:
# with it in the machines stream beside the one-host pair and the session's engines (ci13, ci14)
# its tier took 11-14 minutes instead of 8.6, and the whole run longer.
STREAMS = ("machines", "host")


def stream(item: pytest.Item) -> str:
    """The stream of a test: ``machines`` for systemd tests except the fleet's, for the soak tier
    and for tests with engines of their own only, else ``host``."""
    kw = item.keywords
    alone = "soak" in kw or "own_engines" in kw
    return "machines" if ("systemd" in kw and "fleet" not in kw) or alone else "host"


def stream_ports(name: str, whole: tuple[int, int]) -> tuple[int, int]:
    """The half of the engines' port range ``whole`` that stream ``name`` picks ports from."""
    low, high = whole
    mid = (low + high) // 2
    return (low, mid) if name == STREAMS[1] else (mid, high)


def pytest_configure(config) -> None:
    # Every test has a deadline (TIMEOUTS): without the plugin the marks below would not exist.
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError(
            "pytest-timeout is not installed (the dev extra has it: scripts/setup.sh)"
        )
    # scripts/test.sh starts each stream in the background, where the shell sets SIGINT to
    # ignored, and stops a stream with SIGINT so that it tears its machines and engines down:
    # KeyboardInterrupt it is, as in a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Each stream picks ports from its own half of the engines' range: a port one stream holds
    # for minutes while its container is down between two starts (no retry can follow a unit's
    # restart) is never handed out by the other stream's free_port().
    # A developer's exported hub token would add the pull's "set but not used" line to output
    # the tests compare whole; the tests about that line set it themselves.
    for name in token.HUB_ENV:
        os.environ.pop(name, None)
    only = config.getoption("--stream")
    if only:
        local.PORT_RANGE = stream_ports(only, local.PORT_RANGE)
        # The commands the tests start (`appliance demo`, the CLI) pick from the same half.
        os.environ[local.PORT_RANGE_ENV] = "-".join(map(str, local.PORT_RANGE))


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--stream",
        choices=STREAMS,
        help="run only this stream's tests (scripts/test.sh runs the two side by side)",
    )


# Tests whose proof the systemd tier repeats on the same image under the real unit, and the tests
# that repeat it: with one of those selected in this run (either stream), these are deselected;
# a docker-only run keeps them. Each costs an engine start in a container (60 s and 46 s in the
# CI baseline of 2026-12-06).
_EDITED_IMAGE = (
    "tests/test_cutover_systemd.py::"
    + "test_editing_vllm_image_and_restarting_the_unit_serves_the_new_image"
)
_CORE_DIES = (
    "tests/test_units_faults_systemd.py::"
    + "test_an_engine_core_that_dies_is_restarted_and_serves_again"
)
REPROVEN_BY_SYSTEMD: dict[str, tuple[str, ...]] = {
    # MTP image serves, the drafts counter moves: under the unit before the engine core dies.
    "tests/test_images_docker.py::test_mtp_image_serves_gemma4_mtp_and_the_counters_move": (
        _CORE_DIES,
        _EDITED_IMAGE,
    ),
    # The 0.19 image serves (version, model, a chat) without speculative decoding in /metrics.
    "tests/test_images_docker.py::test_pre_mtp_image_serves_without_speculative_decoding": (
        _EDITED_IMAGE,
    ),
}


def reproven(items: list[pytest.Item]) -> set[str]:
    """The node ids in ``items`` that REPROVEN_BY_SYSTEMD retires: their prover is in ``items``."""
    ids = {i.nodeid for i in items}
    return {t for t, provers in REPROVEN_BY_SYSTEMD.items() if t in ids and ids & set(provers)}


# The slowest tier a test belongs to, for the wall-time table printed at the end of a run.
TIERS = ("fleet", "multinode", "systemd", "docker", "soak", "engine", "bench")


# Every test has a deadline: a hung read fails its test instead of waiting for CI's limit. Per
# tier (its slowest marker, TIERS), above three times the slowest item of that tier in the CI
# baseline of 2026-12-06 (setup + call, beside a full run): fast 36 s (10.6 s on a quiet machine),
# engine 88 s + its call (a session engine's start), soak 186 s. The tiers that use the appliance
# images may first wait for the prefetch to build them (789 s on a brand-new machine), then run
# their slowest: systemd 146 s + a 48 s boot, docker 61 s, fleet 133 s + a 63 s install,
# multinode 236 s (the pair's start) + its call. A test's own timeout mark, or --timeout on the
# command line, wins. The signal method raises in the test, so fixtures still tear down.
TIMEOUTS = {
    "fleet": 1500,
    "multinode": 1500,
    "systemd": 1500,
    "docker": 1500,
    "soak": 600,
    "engine": 600,
    "bench": 600,
    "fast": 120,
}


def tier(keywords) -> str:
    """The slowest tier among ``keywords`` (a test's or a report's), else ``fast``."""
    return next((t for t in TIERS if t in keywords), "fast")


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselected theirs
def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    retired = reproven(items)
    if retired:
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in retired])
        items[:] = [i for i in items if i.nodeid not in retired]
    if config.getoption("timeout") is None:
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIMEOUTS[tier(item.keywords)]))
    only = config.getoption("--stream")
    if only:
        theirs = {i.nodeid for i in items if stream(i) != only}
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in theirs])
        items[:] = [i for i in items if i.nodeid not in theirs]
    # Within a stream: what needs no image and no booted machine first (on a new machine the
    # prefetch is still building them: the first systemd test waited 98 s in its setup there
    # while the stream's own-engine tests, which need neither, came after it), the fleet last;
    # tests that need the pre-MTP image (the last one built) after the others. sort() is
    # stable: collection order within each rank.
    items.sort(key=lambda i: (rank(i.keywords), "pre_mtp_image" in i.fixturenames))


def rank(keywords) -> int:
    """0 first, 2 last: the fleet last, tests of the images or of a booted machine in between.
    The one-host multi-node pair keeps its early place: later it ran beside the fleet's hosts."""
    if "fleet" in keywords:
        return 2
    if "docker" in keywords or ("systemd" in keywords and "multinode" not in keywords):
        return 1
    return 0


# Wall time per tier, printed at the end of a run.
_tier_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    name = tier(report.keywords)
    _tier_seconds[name] = _tier_seconds.get(name, 0.0) + report.duration


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    if _tier_seconds:
        terminalreporter.section("wall time by tier (setup + call + teardown)")
        for tier in (*TIERS, "fast"):
            if tier in _tier_seconds:
                terminalreporter.write_line(f"{tier:>8}: {_tier_seconds[tier] / 60:5.1f} min")
    # Last, where nobody scrolls past them: a run green with skips is not a full run.
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        terminalreporter.section(f"{len(skipped)} skipped (CI fails on any)", red=True)
        for rep in skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            terminalreporter.write_line(f"SKIPPED {rep.nodeid}: {reason}")


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
