"""The fleet playbooks (deploy/ansible) with real ansible-core against two real hosts.

Two systemd machines reached over SSH (tests/plugins/fleet.py), each serving its own instance of
cpu-tiny-mtp on the real CPU images through the host's Docker engine. The tests run in order
and share the hosts: install (twice: the second run changes nothing), roll the MTP image out
over both (starting with MTP off; the canary soaked against its own figures), roll the broken
image out (stops at the canary, which the appliance rolls back; the other host untouched),
roll the fleet back, bring both hosts' engines to a central Prometheus through an agent on each
host (the engines on loopback), then two rollouts stopped after the canary moved (a soak
regression; the other host's sshd gone), each rolling the canary back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from plugins.fleet import OFF_IMAGE, Fleet, FleetHost
from plugins.observability import PROMETHEUS
from plugins.systemd_instance import BROKEN_IMAGE, MTP_IMAGE
from plugins.traffic import Traffic

from appliance.cutover import history
from appliance.host.layout import Layout

pytestmark = [pytest.mark.fleet, pytest.mark.systemd]

AGENT_UNIT = "gemma4-prometheus-agent.service"


def _ok(run) -> None:
    assert run.returncode == 0, run.output[-6000:]


def _on(fleet: Fleet, name: str, image: str) -> None:
    h = fleet.host(name)
    assert h.env_image() == image
    assert h.container() == image
    assert h.container("{{.State.Running}}") == "true"


@contextlib.contextmanager
def lost_once(
    fleet: Fleet, when: Callable[[], bool], *hosts: FleetHost
) -> Iterator[threading.Event]:
    """For the block: the sshd of ``hosts`` goes away as soon as ``when()`` holds (a host gone
    from the management network, its engine still up), and comes back after the block. The
    event says it happened."""
    lost = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if when():
                for h in hosts:
                    h.ssh_off()
                lost.set()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield lost
    finally:
        done.set()
        watcher.join(timeout=30)
        for h in hosts:
            h.ssh_on()
        fleet.wait_reachable()


def test_install_twice_second_run_changes_nothing(fleet: Fleet):
    first = fleet.playbook("install")
    _ok(first)
    for h in fleet.hosts:
        assert first.changed(h.name) > 0
        assert first.recap[h.name]["failed"] == 0
        _on(fleet, h.name, OFF_IMAGE)
        assert h.machine.is_active(f"gemma4-vllm@{h.instance}.service") == "active"
        assert (
            h.machine.systemctl("is-enabled", f"gemma4-vllm@{h.instance}.service").stdout.strip()
            == "enabled"
        )
    second = fleet.playbook("install")
    _ok(second)
    assert {h: second.changed(h) for h in second.recap} == {"fleet-a": 0, "fleet-b": 0}


def _until(done: Callable[[], bool], timeout: float = 1800) -> None:
    """Poll ``done`` every half second until it holds (a test failure after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _cutover_ended(h: FleetHost, image: str) -> bool:
    """Whether the last line of the host's history file ends a cutover to ``image`` (read on
    the host's tree: `appliance history` in the machine costs a Python start per poll)."""
    last = history.lines(Layout(h.root).history_file(h.instance), strict=False)[-1:]
    return bool(last) and last[0].to_image == image and last[0].outcome != "started"


def _traffic(h: FleetHost) -> Traffic:
    """Steady traffic on the host's instance, with its key (four clients: two hosts' engines
    share this machine's cores)."""
    key = Layout(h.root).api_key_file(h.instance).read_text().strip()
    return Traffic(f"http://127.0.0.1:{h.vllm_port}", key, clients=4, label=h.name)


@pytest.mark.traffic
def test_rollout_of_the_mtp_image_canary_first(fleet: Fleet):
    """The roll runs under steady traffic on both hosts: each host's cutover decides as on an
    idle engine, and no request on either is cut or errored."""
    if not all(Layout(h.root).env_file(h.instance).exists() for h in fleet.hosts):
        _ok(fleet.playbook("install"))  # run alone (pytest -m traffic): the first test's install
    a, b = fleet.host("fleet-a"), fleet.host("fleet-b")
    # Each host is under traffic from before its own move until the next one begins: fleet-b's
    # from the end of fleet-a's cutover (through fleet-a's soak, so that fleet-b's live
    # acceptance has its before-windows), fleet-a's until fleet-b's cutover writes its env file
    # (fleet-a's soak passed by then). An engine under traffic takes a core; one that is not
    # moving only slowed the other host's move.
    with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as b_side:
        with _traffic(a) as ta:
            play = pool.submit(fleet.playbook, "rollout", rollout_image=MTP_IMAGE)
            _until(lambda: play.done() or _cutover_ended(a, MTP_IMAGE))
            tb = b_side.enter_context(_traffic(b))
            _until(lambda: play.done() or b.env_image() == MTP_IMAGE)
            ta.wait_back()
        run = play.result()
        tb.wait_back()
    traffic = [ta, tb]
    _ok(run)
    # The drain must be seen on one host at least, not on each: a host whose requests in
    # flight at its stop all ended before its first refusal shows nothing drained (a
    # brand-new run's fleet-a, once: four 503s in 0.8 s, nothing running across them, nothing
    # cut). Whether a request runs across a refusal is timing; cut 0 and error 0 are not.
    for t in traffic:
        assert (broke := t.report.promise(down=True, back=True, drain=False)) is None, broke
    assert any(t.report.drained() for t in traffic), "\n".join(
        f"{t.label}: {t.report.summary()}\n{t.report.around_first_refusal()}" for t in traffic
    )
    for h in fleet.hosts:
        _on(fleet, h.name, MTP_IMAGE)
    a, b = fleet.host("fleet-a").history(), fleet.host("fleet-b").history()
    assert [(e["kind"], e["outcome"], e["from_image"], e["to_image"]) for e in a] == [
        ("cutover", "ok", OFF_IMAGE, MTP_IMAGE)
    ]
    assert [(e["kind"], e["outcome"]) for e in b] == [("cutover", "ok")]
    # Canary first, soaked, and only then the next batch.
    assert a[0]["finished"] <= b[0]["started"]
    assert "fleet-a: soak passed" in run.output
    assert "no pre-cutover MTP figures to compare (MTP was off)" in run.output
    assert "soak passed" not in run.output.split("fleet-b")[-1]
    # The status playbook: env and running image, MTP on and accepted.
    out = fleet.workdir / "status.json"
    _ok(fleet.playbook("status", fleet_status_file=str(out)))
    status = json.loads(out.read_text())
    for name in ("fleet-a", "fleet-b"):
        s = status[name]
        assert (s["env_image"], s["container_image"], s["mtp"]) == (MTP_IMAGE, MTP_IMAGE, True)
        assert s["unit_state"] == "active"
        assert s["rollback_image"] == OFF_IMAGE
    # The copy drafter is accepted almost always; the canary served the soak's probes.
    assert status["fleet-a"]["acceptance"] > 0.5
    again = fleet.playbook("rollout", rollout_image=MTP_IMAGE)
    _ok(again)
    assert {h: again.changed(h) for h in again.recap} == {"fleet-a": 0, "fleet-b": 0}


def test_rollout_of_a_broken_image_stops_at_the_canary(fleet: Fleet):
    b = fleet.host("fleet-b")
    b_started = b.container("{{.State.StartedAt}}")
    b_history = b.history()
    run = fleet.playbook("rollout", rollout_image=BROKEN_IMAGE)
    assert run.returncode != 0, run.output[-4000:]
    assert f"rollout of {BROKEN_IMAGE} stopped at fleet-a" in run.output
    # The canary: the appliance's own way back put it on its old image, through the gates.
    _on(fleet, "fleet-a", MTP_IMAGE)
    last = fleet.host("fleet-a").history()[-1]
    assert (last["kind"], last["outcome"], last["to_image"]) == (
        "cutover",
        "rolled_back",
        BROKEN_IMAGE,
    )
    # The other host: never touched (same container, same history), and never tried.
    _on(fleet, "fleet-b", MTP_IMAGE)
    assert b.container("{{.State.StartedAt}}") == b_started
    assert b.history() == b_history
    assert "fleet-b" not in run.recap or run.recap["fleet-b"]["changed"] == 0


def test_fleet_rollback_to_the_previous_image(fleet: Fleet):
    # Both hosts in one batch: two gated restarts at once, one rollback's wait instead of two.
    run = fleet.playbook("rollback", rollout_batch_size=2)
    _ok(run)
    for h in fleet.hosts:
        _on(fleet, h.name, OFF_IMAGE)
        last = h.history()[-1]
        assert (last["kind"], last["outcome"], last["to_image"]) == (
            "rollback",
            "ok",
            OFF_IMAGE,
        )


def _listening(port: int) -> list[str]:
    """The local addresses listening on TCP ``port`` (the hosts share this network namespace)."""
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        address, _, p = line.split()[3].rpartition(":")
        if p == str(port):
            found.append(address)
    return found


def test_monitoring_agents_bring_both_hosts_to_the_central_server_engines_on_loopback(
    fleet: Fleet, prometheus_server
):
    """Each host's Prometheus agent scrapes its own loopback and remote-writes, labelled host, to
    a central server that scrapes nothing itself: both hosts' engines reach it while no engine
    listens beyond loopback (the targets playbook's ansible_host:port needed them exposed)."""
    central = prometheus_server(
        "global:\n  scrape_interval: 15s\n", {}, ("--web.enable-remote-write-receiver",)
    )
    extra = {
        "monitoring_remote_write_url": central.url + "/api/v1/write",
        # The hosts have no package mirror: this machine's Prometheus (Debian's 2.42), copied.
        "monitoring_agent_binary": PROMETHEUS,
        "monitoring_scrape_interval": "1s",
    }
    try:
        _ok(fleet.playbook("monitoring", **extra))
        again = fleet.playbook("monitoring", **extra)
        _ok(again)
        assert {h: again.changed(h) for h in again.recap} == {"fleet-a": 0, "fleet-b": 0}
        deadline = time.monotonic() + 120
        found: list[dict] = []
        while time.monotonic() < deadline:
            found = central.query("vllm:num_requests_running")
            if len({r["metric"].get("host") for r in found}) == 2:
                break
            time.sleep(0.5)
        # The dashboards' host and instance variables (label_values(vllm:num_requests_running,
        # host), then instance) list both hosts; the series carry the engine job's labels.
        assert sorted((r["metric"].get("host"), r["metric"]["instance"]) for r in found) == [
            ("fleet-a", "fleet-a"),
            ("fleet-b", "fleet-b"),
        ], central.log_path.read_text()[-3000:]
        assert {r["metric"]["job"] for r in found} == {"vllm"}
        inventory = json.loads(fleet.inventory.read_text())["all"]["children"]["gemma4"]
        for h in fleet.hosts:
            agent_port = inventory["hosts"][h.name]["monitoring_agent_port"]
            for p in (h.vllm_port, agent_port):
                listening = _listening(p)
                assert listening, f"{h.name}: nothing listens on {p}"
                assert set(listening) <= {"127.0.0.1", "[::1]"}, (h.name, p, listening)
            sec = h.machine.run("systemd-analyze", "security", AGENT_UNIT).stdout
            score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec)
            assert score and float(score.group(1)) <= 2.5, sec[-2000:]
    finally:
        # The agents must not outlive this test (the later tests' hosts, the central server).
        for h in fleet.hosts:
            h.machine.systemctl("disable", "--now", AGENT_UNIT, check=False)


def test_a_soak_regression_rolls_the_canary_back_and_stops(fleet: Fleet):
    """The soak judges the canary after a cutover that passed every gate; a verdict of "no"
    rolls back every host the rollout moved. The regression here is the soak's own rule that
    too little traffic is no evidence (min_requests above what its probes send): the one
    regression a healthy CPU engine can be made to show for real."""
    b = fleet.host("fleet-b")
    b_started = b.container("{{.State.StartedAt}}")
    b_history = b.history()
    run = fleet.playbook("rollout", rollout_image=MTP_IMAGE, rollout_min_requests=1000)
    assert run.returncode != 0, run.output[-4000:]
    assert "the soak found a regression: too little traffic" in run.output
    assert f"rollout of {MTP_IMAGE} stopped at fleet-a" in run.output
    a_entries = [(e["kind"], e["outcome"], e["to_image"]) for e in fleet.host("fleet-a").history()]
    assert a_entries[-2:] == [("cutover", "ok", MTP_IMAGE), ("rollback", "ok", OFF_IMAGE)]
    _on(fleet, "fleet-a", OFF_IMAGE)
    _on(fleet, "fleet-b", OFF_IMAGE)
    assert b.container("{{.State.StartedAt}}") == b_started
    assert b.history() == b_history


def test_a_host_lost_mid_rollout_rolls_back_every_host_moved(fleet: Fleet):
    """A host whose sshd goes away while the canary cuts over is a failure like any other: the
    rescue rolls the canary back. Ansible runs no rescue for an unreachable host by itself, so
    without the role's own check the rollout ended with the canary moved and the other not."""
    a, b = fleet.host("fleet-a"), fleet.host("fleet-b")
    b_started = b.container("{{.State.StartedAt}}")
    b_history = b.history()
    a_before = len(a.history())
    # fleet-a's env file names the new image from the cutover's first step; fleet-b's turn
    # comes after fleet-a's gates, canary and soak.
    with lost_once(fleet, lambda: a.env_image() == MTP_IMAGE, b) as lost:
        run = fleet.playbook("rollout", rollout_image=MTP_IMAGE)
    assert lost.is_set(), run.output[-4000:]
    assert run.returncode != 0, run.output[-4000:]
    gone = f"rollout of {MTP_IMAGE} stopped at fleet-b: fleet-b is unreachable"
    assert gone in run.output, run.output[-4000:]
    assert run.recap["fleet-b"]["rescued"] == 1, run.output[-4000:]
    # The canary had passed every gate and its soak: it went back through the rescue.
    a_entries = [(e["kind"], e["outcome"], e["to_image"]) for e in a.history()[a_before:]]
    assert a_entries == [("cutover", "ok", MTP_IMAGE), ("rollback", "ok", OFF_IMAGE)]
    _on(fleet, "fleet-a", OFF_IMAGE)
    # fleet-b: never reached, never moved.
    _on(fleet, "fleet-b", OFF_IMAGE)
    assert b.container("{{.State.StartedAt}}") == b_started
    assert b.history() == b_history


def test_a_moved_host_unreachable_at_the_rollback_is_named_in_the_stop_line(fleet: Fleet):
    """Review N2: fleet-a (the canary) moved and passed its soak; both hosts' sshd go away
    while fleet-b cuts over. The rescue's rollback of fleet-a cannot reach it: without
    ignore_unreachable that ended the play at once, with no stop line, fleet-a moved and
    nothing saying so. Now the stop line names both hosts and what to run once they are back."""
    a, b = fleet.host("fleet-a"), fleet.host("fleet-b")
    b_before = len(b.history())
    with lost_once(fleet, lambda: b.env_image() == MTP_IMAGE, a, b) as lost:
        run = fleet.playbook("rollout", rollout_image=MTP_IMAGE)
    assert lost.is_set(), run.output[-4000:]
    assert run.returncode != 0, run.output[-4000:]
    out = " ".join(run.output.split())
    assert f"rollout of {MTP_IMAGE} stopped at fleet-b" in out, out[-4000:]
    assert "but NOT fleet-a (unreachable; once it is reachable: playbooks/rollback.yml -l " in out
    assert "fleet-b (lost during its cutover or soak;" in out
    # Both hosts end on the new image by themselves (fleet-b's cutover went on without its
    # SSH session); the fleet goes back as the line says.
    deadline = time.monotonic() + 900
    while not b.history()[b_before:] or b.history()[-1]["outcome"] == "started":
        assert time.monotonic() < deadline, b.history()[-1:]
        time.sleep(1)
    _on(fleet, "fleet-a", MTP_IMAGE)
    _ok(fleet.playbook("rollback", rollout_batch_size=2, rollback_image=OFF_IMAGE))
    for h in fleet.hosts:
        _on(fleet, h.name, OFF_IMAGE)


def test_an_install_that_changes_files_restarts_the_instance_through_the_gates(fleet: Fleet):
    """Review N8: an install whose files changed (here fleet-a's unit, as an older release
    wrote it) restarts the serving instance onto them through `appliance cutover` on the image
    it runs (gated), never a bare restart; a host whose files did not change is not touched."""
    a, b = fleet.host("fleet-a"), fleet.host("fleet-b")
    unit = a.root / "etc/systemd/system/gemma4-vllm@.service"
    unit.write_text(unit.read_text() + "# as an older appliance wrote it\n")
    a_started, b_started = a.container("{{.State.StartedAt}}"), b.container("{{.State.StartedAt}}")
    a_before, b_history = len(a.history()), b.history()
    run = fleet.playbook("install")
    _ok(run)
    assert run.changed("fleet-a") > 0 and run.changed("fleet-b") == 0
    assert "# as an older appliance wrote it" not in unit.read_text()
    entries = [(e["kind"], e["outcome"], e["from_image"], e["to_image"]) for e in a.history()]
    assert entries[a_before:] == [("cutover", "ok", OFF_IMAGE, OFF_IMAGE)]
    assert a.container("{{.State.StartedAt}}") != a_started
    _on(fleet, "fleet-a", OFF_IMAGE)
    assert b.container("{{.State.StartedAt}}") == b_started
    assert b.history() == b_history
