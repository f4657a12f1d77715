"""`appliance cutover|rollback|status|history` end to end: real systemd booted in systemd-nspawn,
the host's Docker engine, the real CPU images (``gemma4-vllm:pre-mtp`` = vLLM 0.19,
``gemma4-vllm:0.32.0-mtp``, and ``gemma4-vllm:0.32.0-mtp-broken`` whose engine exits at start).

The CLI runs as a subprocess on the host with ``--root`` at the machine's root and
``APPLIANCE_SYSTEMD_PREFIX`` entering the machine, on the one instance the session shares
(tests/plugins/systemd_instance.py). Tests run in file order and each starts from the image it
names with ``ensure`` (a no-op when the previous test left it there), so the whole file costs
about six engine starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from plugins.systemd_instance import BROKEN_IMAGE, MTP_IMAGE, PRE_MTP_IMAGE, SystemdInstance

from appliance import specdecode
from appliance.cutover import history
from appliance.cutover.paths import Layout

pytestmark = [pytest.mark.systemd, pytest.mark.docker, pytest.mark.engine]

TIMEOUT = "600"


def _history(inst: SystemdInstance) -> list[history.Entry]:
    return history.entries(Layout(inst.root).history_file(inst.instance))


def _serves(inst: SystemdInstance, image: str, speculative: bool) -> None:
    """The running container is ``image``, it answers a chat, with or without MTP counters."""
    assert inst.container_image() == image
    resp = inst.chat("cutover check", max_tokens=8)
    assert resp.status_code == 200, resp.text
    assert specdecode.parse(inst.metrics()).speculative is speculative


@pytest.mark.parametrize(
    ("image", "code", "message"),
    [
        ("gemma4-vllm:does-not-exist", 1, "image gemma4-vllm:does-not-exist is not on this host"),
        ("gemma4-vllm:mtp;reboot", 2, "gemma4-vllm:mtp;reboot"),
    ],
    ids=["missing-image", "invalid-reference"],
)
def test_refused_before_the_service_is_touched(systemd_instance, image, code, message):
    inst = systemd_instance
    inst.ensure(PRE_MTP_IMAGE)
    pid, invocation = inst.main_pid(), inst.show("InvocationID")
    env_before, entries_before = inst.env_path.read_bytes(), len(_history(inst))
    r = inst.appliance("cutover", inst.instance, image)
    assert r.returncode == code, r.stderr
    assert message in r.stderr
    assert pid > 0 and inst.main_pid() == pid and inst.show("InvocationID") == invocation
    assert inst.env_path.read_bytes() == env_before
    assert len(_history(inst)) == entries_before  # not even a history entry


def test_cutover_to_a_broken_image_rolls_back_and_the_env_file_is_byte_identical(
    systemd_instance,
):
    inst = systemd_instance
    inst.ensure(PRE_MTP_IMAGE)
    before = inst.env_path.read_bytes()
    r = inst.appliance("cutover", inst.instance, BROKEN_IMAGE, "--timeout", TIMEOUT)
    assert r.returncode == 1, r.stderr
    assert f"{BROKEN_IMAGE} failed gate" in r.stderr
    assert f"rolled back to {PRE_MTP_IMAGE}, which passed the gates and is serving" in r.stderr
    assert inst.env_path.read_bytes() == before
    assert inst.machine.is_active(inst.unit) == "active"
    # The unit noticed at once that the engine died (not after TimeoutStartSec).
    assert "before vLLM /health answered" in inst.machine.journal(inst.unit, 400)
    _serves(inst, PRE_MTP_IMAGE, speculative=False)
    e = _history(inst)[-1]
    assert (e.kind, e.outcome, e.from_image, e.to_image) == (
        "cutover",
        "rolled_back",
        PRE_MTP_IMAGE,
        BROKEN_IMAGE,
    )
    assert e.gates and not e.gates[-1].ok
    assert e.rollback_gates and all(g.ok for g in e.rollback_gates)
    h = inst.appliance("history", inst.instance)
    assert f"rolled_back {PRE_MTP_IMAGE} -> {BROKEN_IMAGE}" in h.stdout


def test_seed_history_replayed_pre_mtp_to_mtp_and_rollback(systemd_instance):
    inst = systemd_instance
    inst.ensure(PRE_MTP_IMAGE)
    r = inst.appliance("cutover", inst.instance, MTP_IMAGE, "--timeout", TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "generation: ok" in r.stderr and "mtp: ok (drafts +" in r.stderr
    assert f"now on {MTP_IMAGE} (was {PRE_MTP_IMAGE}); gates passed" in r.stdout
    _serves(inst, MTP_IMAGE, speculative=True)
    e = _history(inst)[-1]
    assert (e.kind, e.outcome, e.from_image, e.to_image) == (
        "cutover",
        "ok",
        PRE_MTP_IMAGE,
        MTP_IMAGE,
    )
    assert [g.name for g in e.gates] == ["unit", "health", "model", "generation", "mtp"]
    assert all(g.ok for g in e.gates)
    slot = json.loads(Layout(inst.root).rollback_slot(inst.instance).read_text())
    assert slot["image"] == PRE_MTP_IMAGE

    r = inst.appliance("rollback", inst.instance, "--timeout", TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "mtp: ok (not expected for this image (speculative decoding off))" in r.stderr
    _serves(inst, PRE_MTP_IMAGE, speculative=False)
    e = _history(inst)[-1]
    assert (e.kind, e.outcome, e.from_image, e.to_image) == (
        "rollback",
        "ok",
        MTP_IMAGE,
        PRE_MTP_IMAGE,
    )
    s = inst.appliance("status", inst.instance)
    assert s.returncode == 0, s.stderr
    assert f"image:      {PRE_MTP_IMAGE}" in s.stdout
    assert "labels:     vLLM 0.19.0, mtp=no" in s.stdout
    assert "health:     200" in s.stdout and "MTP:        off" in s.stdout


def test_two_concurrent_cutovers_exactly_one_proceeds(systemd_instance):
    inst = systemd_instance
    inst.ensure(PRE_MTP_IMAGE)
    entries_before = len(_history(inst))
    argv, env = inst.appliance_argv("cutover", inst.instance, MTP_IMAGE, "--timeout", TIMEOUT)
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 3], outs
    busy = next(err for p, (_out, err) in zip(procs, outs, strict=True) if p.returncode == 3)
    assert "busy" in busy.lower() or "in progress" in busy.lower(), busy
    entries = _history(inst)
    assert len(entries) == entries_before + 1 and entries[-1].outcome == "ok"
    _serves(inst, MTP_IMAGE, speculative=True)


def test_killing_the_appliance_mid_cutover_leaves_old_or_new_and_status_says_which(
    systemd_instance,
):
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    old, invocation = inst.env_path.read_bytes(), inst.show("InvocationID")
    argv, env = inst.appliance_argv(
        "cutover", inst.instance, PRE_MTP_IMAGE, "--allow-no-mtp", "--timeout", TIMEOUT
    )
    p = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stderr:  # kill while the gates wait, after the env file was written
        seen.append(line)
        if "restarting" in line:
            break
    # ... and once systemd has the restart (so the unit is really mid-way, not untouched).
    deadline = time.monotonic() + 60
    while inst.show("InvocationID") == invocation and inst.show("ActiveState") == "active":
        assert time.monotonic() < deadline, "the cutover never restarted the unit"
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert any("restarting" in line for line in seen), seen
    now = inst.env_path.read_bytes()
    new = old.replace(f"VLLM_IMAGE={MTP_IMAGE}".encode(), f"VLLM_IMAGE={PRE_MTP_IMAGE}".encode())
    assert new != old and now in (old, new)
    side = "new" if now == new else "old"
    s = inst.appliance("status", inst.instance)
    assert s.returncode == 0, s.stderr
    assert f"INTERRUPTED cutover; env file is the {side}:" in s.stdout
    assert _history(inst)[-1].outcome == "interrupted"
    # The restart the killed process queued still happens: the unit serves what the file says.
    inst.wait_restarted(invocation)
    _serves(inst, PRE_MTP_IMAGE if side == "new" else MTP_IMAGE, speculative=side == "old")
