"""The unit gate's reading of systemd's states between a restart's jobs, the gates' default
deadline and their progress lines (fast tier).

A FAKE systemd: the state sequence is the one a multi-node head showed once under load (the
head's engine exited non-zero when its worker went away, before the restart job queued for it
through PartOf= ran), a race that cannot be made to happen on demand under real systemd."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from appliance.cutover import flow, gates, recovery
from appliance.host.systemd import UnitState
from appliance.units import timing

ROLE_DEFAULTS = (
    Path(__file__).resolve().parent.parent
    / "deploy/ansible/roles/gemma4_appliance/defaults/main.yml"
)


class ScriptedSystemd:
    """Answers ``state`` from a script (its last state repeats); counts the reads."""

    def __init__(self, *states: UnitState) -> None:
        self.states = list(states)
        self.reads = 0

    def restarts(self, unit: str) -> int:
        return 0

    def state(self, unit: str) -> UnitState:
        self.reads += 1
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


EXPECT = gates.Expect(
    unit="gemma4-vllm-head@g.service",
    base_url="http://127.0.0.1:9",
    served_model="gemma4-tiny",
    previous_invocation="old",
)


def test_a_failed_unit_with_its_restart_job_queued_is_waited_for():
    systemd = ScriptedSystemd(
        # The restart job is still queued (read by the gate's probe, then its liveness check).
        UnitState("failed", "failed", "4711", 0, "old"),
        UnitState("failed", "failed", "4711", 0, "old"),
        UnitState("failed", "failed", "", 0, "old"),  # no job left: a real failure
    )
    with pytest.raises(gates.GateFailed) as failed:
        gates.wait(systemd, EXPECT, timeout=60)
    assert failed.value.gate == "unit" and "is failed (failed)" in failed.value.detail
    assert systemd.reads == 4  # the state with a job pending was not taken for the failure


def test_a_failed_unit_with_no_job_fails_the_gate_at_once():
    systemd = ScriptedSystemd(UnitState("failed", "failed", "", 0, "old"))
    with pytest.raises(gates.GateFailed) as failed:
        gates.wait(systemd, EXPECT, timeout=60)
    assert failed.value.gate == "unit" and systemd.reads == 2


def test_a_start_whose_engine_exited_fails_the_gate_before_systemd_starts_it_again():
    """A broken image: the engine exits, systemd holds the unit in auto-restart (no job) for
    RestartSec. The gate fails on that state, not one RestartSec and a second start later (when
    NRestarts moves). The old engine's auto-restart before our start counts for nothing."""
    systemd = ScriptedSystemd(
        # Read by the gate's probe, then its liveness check, at each poll.
        UnitState("activating", "auto-restart", "", 0, "old"),  # before our restart ran
        UnitState("activating", "auto-restart", "", 0, "old"),
        UnitState("activating", "start", "4711", 0, "I1"),
        UnitState("activating", "start", "4711", 0, "I1"),
        UnitState("activating", "auto-restart", "", 0, "I1"),
    )
    with pytest.raises(gates.GateFailed) as failed:
        gates.wait(systemd, EXPECT, timeout=30)
    assert failed.value.gate == "unit" and systemd.reads == 6
    assert (
        failed.value.detail == "the engine exited and systemd will restart the unit (auto-restart)"
    )


def test_a_restart_merged_into_a_running_start_is_not_taken_for_a_crash():
    """The race of a gated restart queued while an earlier restart job still runs: systemd
    re-runs the merged job as a restart, so the start just begun (I1) is stopped and the next one
    (I2) is ours. Neither start counts while a job is pending; I2, settled, passes the gate."""
    systemd = ScriptedSystemd(
        UnitState("active", "running", "", 0, "old"),
        UnitState("activating", "start", "4711", 0, "I1"),
        UnitState("activating", "start", "4711", 0, "I1"),
        UnitState("deactivating", "stop-sigterm", "4711", 0, "I1"),
        UnitState("deactivating", "stop-sigterm", "4711", 0, "I1"),
        UnitState("activating", "start", "4711", 0, "I2"),
        UnitState("activating", "start", "4711", 0, "I2"),
        UnitState("active", "running", "", 0, "I2"),
        UnitState("active", "running", "", 0, "I2"),
        # Then the engine dies while /health is awaited: the next gate fails on it at once.
        UnitState("failed", "failed", "", 0, "I2"),
    )
    with pytest.raises(gates.GateFailed) as failed:
        gates.wait(systemd, EXPECT, timeout=60)
    assert [(g.name, g.ok) for g in failed.value.gates] == [("unit", True), ("health", False)]
    assert "is failed (failed)" in failed.value.detail


def test_the_default_deadline_covers_the_restart_the_unit_allows(cli_run):
    """A healthy slow start (a new vLLM version's cold compile cache) must not be rolled back:
    the default covers the old engine's stop and the new one's whole start budget, and the
    fleet role's default is the same."""
    assert gates.DEFAULT_TIMEOUT >= timing.STOP_TIMEOUT_S + timing.START_TIMEOUT_S
    assert flow.DEFAULT_TIMEOUT == recovery.rollback.__kwdefaults__["timeout"]
    assert flow.DEFAULT_TIMEOUT == gates.DEFAULT_TIMEOUT
    for command in ("cutover", "rollback"):
        shown = " ".join(cli_run([command, "--help"]).output.split())
        assert f"[default: {gates.DEFAULT_TIMEOUT:.0f}]" in shown
    role = ROLE_DEFAULTS.read_text()
    assert yaml.safe_load(role)["rollout_timeout"] == gates.DEFAULT_TIMEOUT


def test_a_waiting_gate_says_how_far_it_is_into_the_deadline():
    systemd = ScriptedSystemd(
        UnitState("activating", "start", "4711", 0, "new"),  # the start job still runs
        UnitState("activating", "start", "4711", 0, "new"),
        UnitState("failed", "failed", "", 0, "new"),
    )
    lines: list[str] = []
    with pytest.raises(gates.GateFailed):
        gates.wait(systemd, EXPECT, timeout=1234, progress=lines.append)
    waiting = [ln for ln in lines if "waiting for" in ln]
    assert len(waiting) == 1  # at once, then not again within NOTE_EVERY_S
    assert re.fullmatch(
        r"\[ *\d+\.\ds\] waiting for gemma4-vllm-head@g\.service to be active \.\.\. "
        r"\d+ s of 1234 s",
        waiting[0],
    ), waiting
