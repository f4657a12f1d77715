"""A multi-node group whose nodes run on two hosts, moved by the fleet's play:
deploy/ansible/playbooks/multinode-cutover.yml with real ansible-core over SSH, the head of
``cpu-tiny-mtp-2node`` on ``fleet-a`` and its worker on ``fleet-b`` (tests/plugins/fleet_group.py).

Before, nothing moved such a group: `appliance multinode cutover` on the head refused with
`worker ranks []`, and no playbook moved workers. The tests run in order on one group: a move to
the MTP image (the head stopped, the worker host moved, then the head, gated with the output
canary), a broken image (every node back, on both hosts), a worker host lost during its move
(the play stops with the head stopped and unmoved, and a second run once the host is back brings
the group together), a head host lost during its move. No worker may start while a head runs.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from plugins.fleet import OFF_IMAGE
from plugins.fleet_group import START_TIMEOUT, FleetGroup
from plugins.systemd_instance import BROKEN_IMAGE, MTP_IMAGE
from test_fleet import lost_once

pytestmark = [pytest.mark.fleet, pytest.mark.systemd, pytest.mark.multinode]


def _ok(run) -> None:
    assert run.returncode == 0, run.output[-6000:]


def _image_id(ref: str) -> str:
    out = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", ref],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _on(g: FleetGroup, image: str) -> None:
    """Both nodes' env files name ``image`` and both containers run it."""
    want = _image_id(image)
    for role in ("head", "worker"):
        assert g.env_image(role) == image, role
        assert g.container(role) == want, role
        assert g.container(role, "{{.State.Running}}") == "true", role


def _last(g: FleetGroup, role: str) -> tuple[str, str, str]:
    e = g.history(role)[-1]
    return e["kind"], e["outcome"], e["to_image"]


def test_the_play_moves_the_worker_host_then_the_head(fleet_group: FleetGroup):
    g = fleet_group
    g.generates()  # the group serves before (MTP off: no speculative counters yet)
    started = {r: g.container(r, "{{.State.StartedAt}}") for r in ("head", "worker")}
    mark = g.mark()
    run = g.move(MTP_IMAGE)
    _ok(run)
    _on(g, MTP_IMAGE)
    now = {r: g.container(r, "{{.State.StartedAt}}") for r in ("head", "worker")}
    # Both restarted (RFC 3339 times of one clock compare as text), the worker's host first
    # with the head stopped: a worker started beside the old head joined its finished
    # rendezvous, and hung there once the head restarted (the fleet tier, 2026-12-08).
    assert now["worker"] > started["worker"] and now["head"] > started["head"]
    assert g.starts_beside_a_head(mark) == [], run.output[-4000:]
    assert _last(g, "worker") == ("cutover", "ok", MTP_IMAGE)
    head = g.history("head")[-1]
    assert (head["kind"], head["outcome"], head["to_image"]) == ("cutover", "ok", MTP_IMAGE)
    names = [gate["name"] for gate in head["gates"]]
    assert "generation" in names, head
    # The output canary, last: the head's new answers against those recorded before the worker
    # moved (the old head could not answer once it had).
    # Under traffic the live-acceptance gate (cutover/live.py) follows the canary.
    assert [n for n in names if n != "live-acceptance"][-1] == "canary" and head["canary"][
        "verdict"
    ] == "pass", head
    assert "Record the head's answers" in run.output
    after = g.generates()
    assert after is not None and after.drafts > 0 and after.accepted > 0


def test_a_broken_image_is_rolled_back_on_both_hosts(fleet_group: FleetGroup):
    g = fleet_group
    mark = g.mark()
    # The output canary is the first test's: here the gates fail before it would run.
    run = g.move(BROKEN_IMAGE, multinode_canary=False)
    assert run.returncode != 0, run.output[-6000:]
    assert f"every node is back on {MTP_IMAGE}, gated" in run.output, run.output[-6000:]
    _on(g, MTP_IMAGE)
    # The way back stopped the head (on the broken image) before the worker went back too.
    assert g.starts_beside_a_head(mark) == [], run.output[-4000:]
    # Each host's record ends on its way back, gated (the worker's may be its own, when the
    # broken engine died before its gate; then the play's rollback restarts it once more).
    assert _last(g, "worker") == ("rollback", "ok", MTP_IMAGE)
    assert _last(g, "head") == ("rollback", "ok", MTP_IMAGE)
    assert g.generates() is not None


def test_a_worker_host_lost_mid_move_stops_the_play_then_a_second_run_rejoins(
    fleet_group: FleetGroup,
):
    """fleet-b's sshd goes away once its worker's env file names the new image (its move under
    way): a host gone from the management network, its engine still up. The play stops with
    the head as it left it before the worker moved (stopped, its env file and record untouched),
    since it can no longer make the group whole, and says how to finish; once fleet-b is back,
    the same play with the image the group left brings both nodes onto it."""
    g = fleet_group
    mark = g.mark()
    head_history = g.history("head")
    with lost_once(g.fleet, lambda: g.env_image("worker") == OFF_IMAGE, g.worker) as lost:
        # Without the canary's record first: the host is lost at the worker's first step.
        run = g.move(OFF_IMAGE, multinode_allow_no_mtp=True, multinode_canary=False)
    assert lost.is_set(), run.output[-4000:]
    assert run.returncode != 0, run.output[-4000:]
    assert "stopped: fleet-b became unreachable during its move" in run.output, run.output[-4000:]
    assert f"run this play again with -e multinode_image={MTP_IMAGE}" in run.output
    # The head: stopped, not moved; its env file and record as they were.
    assert g.head.machine.is_active(g.unit("head")) == "inactive"
    assert g.env_image("head") == MTP_IMAGE
    assert g.history("head") == head_history
    # The worker host's own cutover went on without its SSH session; it ends by itself.
    deadline = time.monotonic() + START_TIMEOUT
    while g.history("worker")[-1]["outcome"] == "started":
        assert time.monotonic() < deadline, g.history("worker")[-1]
        time.sleep(1)

    again = g.move(MTP_IMAGE)
    _ok(again)
    _on(g, MTP_IMAGE)
    assert g.starts_beside_a_head(mark) == [], again.output[-4000:]
    assert g.generates() is not None


def test_a_head_host_lost_mid_move_leaves_every_node_as_it_is(fleet_group: FleetGroup):
    """Review S6: fleet-a's sshd goes away once the head's env file names the new image (its
    move under way, --no-rollback: the play's rescue is its way back). The rescue used to move
    the worker back to the old image under the head, which finished its own move without its
    SSH session: a split group, under a stop line saying the other nodes were left as they
    were. Now the worker stays where it moved, the line says so, and the head's move ends by
    itself onto it: the group whole on the new image."""
    g = fleet_group
    worker_before = len(g.history("worker"))
    head_before = len(g.history("head"))
    with lost_once(g.fleet, lambda: g.env_image("head") == OFF_IMAGE, g.head) as lost:
        run = g.move(OFF_IMAGE, multinode_allow_no_mtp=True, multinode_canary=False)
    assert lost.is_set(), run.output[-4000:]
    assert run.returncode != 0, run.output[-4000:]
    out = " ".join(run.output.split())
    assert "stopped: fleet-a became unreachable during its move" in out, out[-4000:]
    assert "the other nodes are left as they are" in out
    # The worker moved once and was not moved back.
    assert [(e["kind"], e["outcome"]) for e in g.history("worker")[worker_before:]] == [
        ("cutover", "ok")
    ]
    assert g.env_image("worker") == OFF_IMAGE
    deadline = time.monotonic() + START_TIMEOUT
    while not g.history("head")[head_before:] or g.history("head")[-1]["outcome"] == "started":
        assert time.monotonic() < deadline, g.history("head")[-1:]
        time.sleep(1)
    assert g.history("head")[-1]["outcome"] == "ok", g.history("head")[-1]
    _on(g, OFF_IMAGE)
    # Whole: the head generates (a 200 with tokens), which needs its worker. The module's last
    # test: no move back (a second run that makes a group whole is the worker-lost test's).
    g.generates()
