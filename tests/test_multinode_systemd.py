"""A multi-node group for real: head + worker units under real systemd in
nspawn, each running the CPU image through the serve script, vLLM's own multi-node with
tensor parallelism 2 across the two "nodes" (tests/plugins/multinode.py).

One group, moved by every test in file order, until the purge removes it: a test that needs the
group goes before the purge; after it only N6, on a pair of its own."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time

import httpx
import pytest
from plugins.multinode import (
    GROUP,
    MTP_IMAGE,
    PROFILE,
    START_TIMEOUT,
    VLLM_CACHE,
    remove_group,
)
from plugins.systemd_instance import APPLIANCE, REPO
from plugins.traffic import LIVE_WINDOW, Traffic

import docker
from appliance import profiles, units
from appliance.cutover import history
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.host import envfile
from appliance.host.layout import Layout, Node
from appliance.host.names import node_container, node_unit
from appliance.instance import installer
from appliance.observability import state_metrics

pytestmark = [pytest.mark.systemd, pytest.mark.multinode]


def _serves_with_mtp(group) -> None:
    before = group.counters()
    resp = group.chat("the pair answers", max_tokens=24)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] > 0
    after = group.counters()
    assert before is not None and after is not None
    assert after.drafts > before.drafts
    assert after.accepted > before.accepted


def test_the_worker_starts_first_and_the_head_serves_with_mtp(multinode_group):
    g = multinode_group
    m = g.machine
    assert m.is_active(g.worker) == "active" and m.is_active(g.head) == "active"
    # Start order: the worker's engine started before the head's (After= in the drop-in).
    assert 0 < g.started_at(g.worker) < g.started_at(g.head)
    # One engine across two processes: the head is rank 0 of 2, the worker headless.
    head_cmd = g.docker.containers.get(node_container(GROUP, "head")).attrs["Args"]
    worker_cmd = g.docker.containers.get(node_container(GROUP, "worker")).attrs["Args"]
    assert "--headless" in worker_cmd and "--headless" not in head_cmd
    assert head_cmd[head_cmd.index("--node-rank") + 1] == "0"
    assert worker_cmd[worker_cmd.index("--node-rank") + 1] == "1"
    assert head_cmd[head_cmd.index("--tensor-parallel-size") + 1] == "2"
    # Both containers as hardened as an instance's, and meeting through the host's IPC.
    for role in ("head", "worker"):
        host = g.docker.containers.get(node_container(GROUP, role)).attrs["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"], role
        assert (host["Init"], host["IpcMode"]) == (True, "host"), role
        assert f"{VLLM_CACHE}/torchinductor:/tmp/torchinductor_root" in host["Binds"], role
    _serves_with_mtp(g)
    # With tensor parallelism torch.compile builds a C++ kernel at the first forward
    # (vocab_parallel_embedding.py): it is kept in the mounted compile cache, not the
    # container's /tmp, so the next start loads it instead of compiling for ~10 s a rank.
    kept = VLLM_CACHE / "torchinductor"
    assert (kept / "fxgraph").is_dir() and (kept / "precompiled_headers").is_dir()


def test_status_and_the_state_metrics_read_the_groups_real_units(
    multinode_group, monkeypatch, cli_run
):
    """`appliance status GROUP --write-metrics` reads the head and worker units,
    not gemma4-vllm@GROUP (no such unit: it read `inactive`), so the state textfile carries the
    head's real state and Gemma4InstanceFailed can fire for a failed head."""
    g = multinode_group
    for key, value in g.machine.tree_env().items():
        monkeypatch.setenv(key, value)
    argv = ["status", GROUP, "--json", "--write-metrics", "--root", str(g.machine.root)]
    result = cli_run(argv)
    text = Layout(g.machine.root).metrics_textfile().read_text()
    state = rf'{state_metrics.UNIT_STATE}{{instance="{GROUP}",result="[a-z-]*",state="(\w+)"}} 1\.0'
    assert re.findall(state, text) == ["active"], text
    [st] = json.loads(result.stdout)["instances"]
    assert st["units"] == {g.head: "active", g.worker: "active"}
    assert st["running_id"] == g.container_image_id("head")


def test_a_hangup_during_the_gates_rolls_every_node_back(multinode_group):
    """SIGHUP (an SSH session gone) while the group's cutover waits for its gates: the
    cutover's way back, as for an instance."""
    g = multinode_group
    m = g.machine
    env_path = Layout(m.root).env_file(GROUP)
    before, old_id = env_path.read_bytes(), g.container_image_id("head")
    env = dict(os.environ, **m.tree_env())
    # The canary is the cutover test's (below); here it would only delay the restart.
    argv = [APPLIANCE, "cutover", GROUP, g.derived_image, "--no-canary"]
    argv += ["--root", str(m.root)]
    proc = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the progress lines: the signal lands once the restart began
            seen.append(line)
            if "restarting" in line:
                break
        assert any("restarting" in ln for ln in seen), "".join(seen)
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + err
    assert proc.returncode != 0, out + err
    assert "interrupted by SIGHUP during the gates" in err, err
    assert env_path.read_bytes() == before
    assert g.container_image_id("head") == g.container_image_id("worker") == old_id
    last = history.entries(Layout(m.root).history_file(GROUP))[-1]
    assert (last.outcome, last.interrupted) == ("rolled_back", "SIGHUP"), last
    _serves_with_mtp(g)


@pytest.mark.traffic
def test_cutover_moves_both_nodes_and_a_killed_rollback_is_recovered(multinode_group):
    """A group moves through the instance's own commands and state machine: `appliance cutover
    GROUP IMAGE` (the output canary gates it), then `appliance rollback GROUP` killed outright
    (SIGKILL, as a power loss would) leaves a state that `appliance status GROUP` names with its
    one recovery command, which brings every node back and closes the killed entry. The cutover
    runs under steady traffic on the head: none cut or errored while both nodes move."""
    g = multinode_group
    m = g.machine
    ctx = g.context()
    old_id = g.container_image_id("head")
    env_vars = dict(os.environ, **m.tree_env())
    run = {"env": env_vars, "cwd": REPO, "capture_output": True, "text": True}
    cut = [APPLIANCE, "cutover", GROUP, g.derived_image, "--timeout", "900", *LIVE_WINDOW]
    with Traffic(g.url, g.api_key, label="group cutover") as traffic:
        moved = subprocess.run([*cut, "--root", str(m.root)], check=False, **run)
        traffic.wait_back()
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert f"{GROUP}: now on {g.derived_image} (was {MTP_IMAGE}); gates passed" in moved.stdout
    assert (broke := traffic.report.promise(down=True, back=True)) is None, broke
    entry = history.entries(ctx.layout.history_file(GROUP))[-1]
    assert entry.outcome == "ok", entry
    names = [gate.name for gate in entry.gates]
    assert {"unit", "image", "health", "generation"} <= set(names) and "worker rank 1" in names
    # Under traffic the live-acceptance gate (cutover/live.py) follows the canary.
    assert [n for n in names if n != "live-acceptance"][-1] == "canary" and entry.canary[
        "verdict"
    ] == "pass", entry.canary
    env = envfile.read(Layout(m.root).env_file(GROUP))
    assert env.get(envfile.IMAGE_KEY) == g.derived_image
    new_id = g.docker.images.get(g.derived_image).id
    assert new_id != old_id
    assert g.container_image_id("head") == g.container_image_id("worker") == new_id
    _serves_with_mtp(g)

    argv = [APPLIANCE, "rollback", GROUP, "--root", str(m.root)]
    proc = subprocess.Popen(
        argv, env=env_vars, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the env files are written once the restart begins
            seen.append(line)
            if "restarting" in line:
                break
        assert any("restarting" in ln for ln in seen), "".join(seen)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    status = [APPLIANCE, "status", GROUP, "--json", "--root", str(m.root)]
    out = subprocess.run(status, check=False, **run)
    [st] = json.loads(out.stdout)["instances"]
    recovery = f"appliance rollback {GROUP} --root {shlex.quote(str(m.root))}"
    assert st["recovery"] == recovery, st
    killed = history.entries(ctx.layout.history_file(GROUP))[-1]
    assert (killed.kind, killed.outcome) == ("rollback", "interrupted"), killed

    back = subprocess.run([APPLIANCE, *shlex.split(recovery)[1:]], check=False, **run)
    assert back.returncode == 0, back.stdout + back.stderr
    assert "recovered the interrupted rollback" in back.stdout, back.stdout
    last = history.entries(ctx.layout.history_file(GROUP))[-1]
    assert (last.id, last.outcome, last.interrupted) == (killed.id, "ok", "killed"), last
    assert last.to_image == MTP_IMAGE
    assert g.container_image_id("head") == g.container_image_id("worker") == old_id
    entries = history.entries(ctx.layout.history_file(GROUP))
    assert [(e.kind, e.outcome) for e in entries][-2:] == [("cutover", "ok"), ("rollback", "ok")]
    _serves_with_mtp(g)


def test_a_dead_worker_takes_the_head_down_and_both_come_back_in_order(multinode_group):
    g = multinode_group
    m = g.machine
    head_inv = g.show(g.head, "InvocationID")
    worker_inv = g.show(g.worker, "InvocationID")
    # The worker's engine dies, as a crashed node would: SIGKILL from the host to the container's
    # first process (the others die with its PID namespace). Not `docker kill`: on a loaded host
    # dockerd gives up waiting for the exit of a process that holds GBs ("did not receive an exit
    # event") and answers 500, though the signal went out.
    worker = g.docker.containers.get(node_container(GROUP, "worker"))
    os.kill(worker.attrs["State"]["Pid"], signal.SIGKILL)
    # Without unit dependencies the head would keep answering /health 200 here (the trap this
    # guards against); with BindsTo=/PartOf= systemd takes it down and restarts both.
    g.wait_new_start(g.worker, worker_inv)
    g.wait_new_start(g.head, head_inv)
    assert m.is_active(g.worker) == "active" and m.is_active(g.head) == "active"
    assert 0 < g.started_at(g.worker) < g.started_at(g.head)
    _serves_with_mtp(g)


def test_uninstall_purge_of_the_group_leaves_the_machine_as_found(multinode_group):
    """`appliance uninstall GROUP --purge`, the instance's command: the group's units stopped
    and disabled, its containers gone, and the machine's /etc, /usr/local and /var/lib as they
    were before its install (the bare host's comparison). After it only N6 runs, its own pair
    in the room the group leaves (the group is not started again for this test to stop)."""
    g = multinode_group
    m = g.machine
    env = dict(os.environ, **m.tree_env())
    argv = [APPLIANCE, "uninstall", GROUP, "--purge", "--root", str(m.root)]
    gone = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert {m.is_active(g.head), m.is_active(g.worker)} <= {"inactive", "unknown"}
    for role in ("head", "worker"):
        with pytest.raises(docker.errors.NotFound):
            g.docker.containers.get(node_container(GROUP, role))
    left, lost = m.compare(g.before)
    assert (left, lost) == ([], []), f"left behind: {left}; removed: {lost}"


def _files_of(m, group: str) -> list:
    """What `multinode install` laid for ``group`` alone (not the shared unit templates)."""
    etc = m.root / "etc/gemma4-vllm"
    units_dir = m.root / "etc/systemd/system"
    return [*etc.glob(f"{group}.*"), *etc.glob(f"{group}-*"), *units_dir.glob(f"*@{group}.*")]


def test_a_worker_waits_out_its_heads_outage_and_the_group_comes_back_unaided(multinode_group):
    """Review N6: a worker started while its head's host is down. Its engine waited for the
    rendezvous, exited at torch's timeout and was restarted until the start limit left it
    `failed`: the group then needed `reset-failed` once the head was back. Now the serve
    program waits for the rendezvous first (one start, no container yet).

    A second group on this machine, its worker installed alone (the head's host, down, is
    nowhere), with the rendezvous timeout at 90 s instead of 30 min so that the old behaviour
    shows within minutes (the head waits as long for the worker to join: a worker's container
    takes tens of seconds to start here); the head comes back by being installed and started
    here."""
    g = multinode_group
    m = g.machine
    group = "n6"
    worker, head = node_unit(group, "worker"), node_unit(group, "head")
    prof = profiles.get(PROFILE)
    prof = dataclasses.replace(
        prof,
        extra_args=(*prof.extra_args, "--distributed-timeout-seconds", "90"),
        multinode=dataclasses.replace(prof.multinode, master_port=free_port()),
    )
    port = free_port()
    opts = units.Options(
        image=MTP_IMAGE,
        port=port,
        model_dir=str(devmodel.cached("copy").root),
        vllm_cache_dir=str(VLLM_CACHE),
    )

    def lay(roles) -> None:
        installer.install(prof, group, node=Node(roles, 1), root=m.root, options=opts)
        for role in roles:  # no key files on 127.0.0.1, as the fixture's group (see there)
            Layout(m.root).node_api_key_file(group, role).unlink(missing_ok=True)
        m.daemon_reload()

    try:
        lay(("worker",))
        m.systemctl("start", worker)
        deadline = time.monotonic() + START_TIMEOUT
        while "waiting for the head's rendezvous" not in m.journal(worker, 200):
            state = (m.is_active(worker), g.show(worker, "Result"), g.show(worker, "NRestarts"))
            assert state[0] != "failed", (state, m.journal(worker, 60))
            assert time.monotonic() < deadline, (state, m.journal(worker, 60))
            time.sleep(1)
        assert m.is_active(worker) == "active" and g.show(worker, "NRestarts") == "0"
        # The head's host is back.
        lay(("head", "worker"))
        started = m.systemctl("start", head, check=False, timeout=START_TIMEOUT)  # generates
        assert started.returncode == 0, m.journal(head, 80) + m.journal(worker, 40)
        assert m.is_active(worker) == "active" and g.show(worker, "NRestarts") == "0"
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "gemma4-tiny", "prompt": "back", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
    finally:
        m.systemctl("stop", worker, check=False, timeout=180)
        m.systemctl("reset-failed", worker, head, check=False)
        for path in _files_of(m, group):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        m.daemon_reload()
        remove_group(group)
