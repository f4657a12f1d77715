"""The unit gate's reading of systemd's states between a restart's jobs (fast tier).

A FAKE systemd: the state sequence is the one a multi-node head showed once under load (the
head's engine exited non-zero when its worker went away, before the restart job queued for it
through PartOf= ran), a race that cannot be made to happen on demand under real systemd."""

from __future__ import annotations

import pytest

from appliance.cutover import gates
from appliance.host.systemd import UnitState


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
