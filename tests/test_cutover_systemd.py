"""`appliance cutover|rollback|status|history` end to end: real systemd booted in systemd-nspawn,
the host's Docker engine, the real CPU images (``gemma4-vllm:0.19.0-cpu`` = vLLM 0.19,
``gemma4-vllm:0.32.0-mtp-cpu``, and ``gemma4-vllm:0.32.0-mtp-broken-cpu`` whose engine exits at
start),
and an image derived from the MTP one (tests/plugins/docker_engine.py ``canary_images``) with
another chat template (answers change). cpu-tiny-mtp turns the output canary on, so every
cutover here runs it unless the test says ``--no-canary``.

The CLI runs as a subprocess on the host with ``--root`` at the machine's root and
``APPLIANCE_SYSTEMD_PREFIX`` entering the machine, on the one instance the session shares
(tests/plugins/systemd_instance.py). Tests run in file order and each starts from the image it
names with ``ensure`` (a no-op when the previous test left it there), in an order that costs
about seven engine starts, two of them on the slower pre-MTP image (the seed's replay, last, which
leaves the instance there for tests/test_units_systemd.py).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from plugins.systemd_instance import BROKEN_IMAGE, MTP_IMAGE, PRE_MTP_IMAGE, SystemdInstance
from plugins.traffic import LIVE_WINDOW, Traffic

from appliance import canary
from appliance.cutover import history
from appliance.engine_api import specdecode
from appliance.engine_api.vllm_client import VLLMClient
from appliance.host.layout import Layout

# pre_mtp_image: built on first use; the machines stream runs this module after those that need
# no pre-MTP image (tests/conftest.py).
pytestmark = [
    pytest.mark.systemd,
    pytest.mark.docker,
    pytest.mark.engine,
    pytest.mark.usefixtures("pre_mtp_image"),
]

TIMEOUT = "600"
# Every gate of a cutover with the canary on, in order.
GATES = ["unit", "image", "health", "model", "generation", "mtp", "canary"]


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
    inst.ensure(MTP_IMAGE)
    pid, invocation = inst.main_pid(), inst.show("InvocationID")
    env_before, entries_before = inst.env_path.read_bytes(), len(_history(inst))
    r = inst.appliance("cutover", inst.instance, image)
    assert r.returncode == code, r.stderr
    assert message in r.stderr
    assert pid > 0 and inst.main_pid() == pid and inst.show("InvocationID") == invocation
    assert inst.env_path.read_bytes() == env_before
    assert len(_history(inst)) == entries_before  # not even a history entry


@pytest.mark.traffic
def test_cutover_to_a_broken_image_rolls_back_and_the_env_file_is_byte_identical(
    systemd_instance,
):
    """Under steady traffic (tests/plugins/traffic.py): it decides as on an idle engine, and
    no request is cut or errored through the stop, the broken start and the way back."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    before = inst.env_path.read_bytes()
    slot = Layout(inst.root).rollback_slot(inst.instance)
    slot_before = slot.read_bytes() if slot.exists() else None
    with Traffic(inst.url, inst.api_key, label="cutover to a broken image") as traffic:
        r = inst.appliance(
            "cutover", inst.instance, BROKEN_IMAGE, "--timeout", TIMEOUT, *LIVE_WINDOW
        )
        traffic.wait_back()
    assert r.returncode == 1, r.stderr
    assert f"{BROKEN_IMAGE} failed gate" in r.stderr
    assert f"rolled back to {MTP_IMAGE}, which passed the gates and is serving" in r.stderr
    assert (broke := traffic.report.promise(down=True, back=True)) is None, broke
    assert inst.env_path.read_bytes() == before
    # The rollback target is the one from before (the cutover had pointed it at MTP_IMAGE).
    assert (slot.read_bytes() if slot.exists() else None) == slot_before
    assert inst.machine.is_active(inst.unit) == "active"
    # The unit noticed at once that the engine died (not after TimeoutStartSec).
    assert "before vLLM /health answered" in inst.machine.journal(inst.unit, 400)
    _serves(inst, MTP_IMAGE, speculative=True)
    e = _history(inst)[-1]
    assert (e.kind, e.outcome, e.from_image, e.to_image) == (
        "cutover",
        "rolled_back",
        MTP_IMAGE,
        BROKEN_IMAGE,
    )
    assert e.gates and not e.gates[-1].ok
    assert e.rollback_gates and all(g.ok for g in e.rollback_gates)
    h = inst.appliance("history", inst.instance)
    assert f"rolled_back {MTP_IMAGE} -> {BROKEN_IMAGE}" in h.stdout


def test_an_image_that_changes_the_answers_fails_the_canary_and_is_rolled_back(
    systemd_instance, canary_images
):
    """Same vLLM, same labels, MTP working, every other gate passes: only the chat template
    differs, so every greedy answer changes, and the canary rolls the cutover back."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    changed = canary_images["changed-template"]
    before = inst.env_path.read_bytes()
    r = inst.appliance("cutover", inst.instance, changed, "--timeout", TIMEOUT)
    assert r.returncode == 1, r.stderr
    assert f"{changed} failed gate 'canary': canary FAILED: token parity" in r.stderr
    assert "on one vLLM version (0.32.0)" in r.stderr
    assert f"rolled back to {MTP_IMAGE}, which passed the gates and is serving" in r.stderr
    assert inst.env_path.read_bytes() == before
    _serves(inst, MTP_IMAGE, speculative=True)
    e = _history(inst)[-1]
    assert (e.outcome, e.from_image, e.to_image) == ("rolled_back", MTP_IMAGE, changed)
    assert [g.name for g in e.gates] == GATES
    assert all(g.ok for g in e.gates[:-1]) and not e.gates[-1].ok
    assert e.rollback_gates and all(g.ok for g in e.rollback_gates)
    c = e.canary
    print("changed chat template canary:", c["summary"])
    assert c["verdict"] == "fail" and c["version_changed"] is False and c["parity"] < 1.0
    assert c["median_first_divergence"] is not None
    s = inst.appliance("status", inst.instance)
    assert "canary:     canary FAILED: token parity" in s.stdout
    prom = Layout(inst.root).metrics_textfile().read_text()
    assert f'gemma4_appliance_canary_ok{{instance="{inst.instance}"}} 0.0' in prom


def test_an_image_that_drafts_worse_with_the_same_answers_is_rolled_back_on_acceptance(
    systemd_instance, degraded_image
):
    """The degraded image is a deliberate fault (tests/plugins/docker_engine.py): the
    MTP image drafting with a random drafter. Every gate passes, every answer is token-identical,
    and the canary's acceptance judgement rolls the cutover back."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    before = inst.env_path.read_bytes()
    r = inst.appliance("cutover", inst.instance, degraded_image, "--timeout", TIMEOUT)
    assert r.returncode == 1, r.stderr
    assert f"{degraded_image} failed gate 'canary': canary FAILED: draft acceptance fell" in (
        r.stderr
    )
    assert "(the same answers, decoded with fewer accepted drafts)" in r.stderr
    assert f"rolled back to {MTP_IMAGE}, which passed the gates and is serving" in r.stderr
    assert inst.env_path.read_bytes() == before
    _serves(inst, MTP_IMAGE, speculative=True)
    e = _history(inst)[-1]
    assert (e.outcome, e.from_image, e.to_image) == ("rolled_back", MTP_IMAGE, degraded_image)
    assert all(g.ok for g in e.gates[:-1]) and not e.gates[-1].ok  # the mtp gate passed too
    c = e.canary
    print("degraded drafter canary:", c["summary"])
    assert c["verdict"] == "fail" and c["parity"] == 1.0 and c["differing"] == []
    drop = c["acceptance"]
    assert drop["before"]["acceptance"] - drop["after"]["acceptance"] > 0.5, drop
    assert any(f.startswith("draft acceptance fell") for f in c["failures"])
    s = inst.appliance("status", inst.instance)
    assert "canary:     canary FAILED: draft acceptance fell" in s.stdout


def test_rollback_returns_to_the_image_id_the_slot_recorded_when_its_tag_moved(
    systemd_instance, canary_images, docker_engine
):
    """S12: the rollback slot kept only a tag, so once `appliance image build` moved it (here
    `docker tag`, the same move), `appliance rollback` went wherever it named then. The slot and
    the history keep the image ID too, and the rollback goes to that ID when the tag moved."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    mtp = docker_engine.images.get(MTP_IMAGE)
    changed_ref = canary_images["changed-template"]
    changed = docker_engine.images.get(changed_ref)
    repo, tag = "gemma4-rollback-test", "0.32.0-mtp-cpu"  # the test's own: no shared tag moves
    way_back = f"{repo}:{tag}"
    mtp.tag(repo, tag)
    try:
        inst.set_image(way_back)  # the image that runs, by another name: no restart
        r = inst.appliance(
            "cutover", inst.instance, changed_ref, "--no-canary", "--timeout", TIMEOUT, "--json"
        )
        assert r.returncode == 0, r.stderr
        slot = json.loads(Layout(inst.root).rollback_slot(inst.instance).read_text())
        cut = _history(inst)[-1]
        # --json: one object on stdout, the history entry the cutover closed.
        assert _facts(json.loads(r.stdout)) == _facts(vars(cut)), r.stdout
        assert (cut.kind, cut.outcome) == ("cutover", "ok")
        changed.tag(repo, tag)  # the slot's tag now names the image that runs
        r = inst.appliance("rollback", inst.instance, "--timeout", TIMEOUT, "--json")
        assert r.returncode == 0, r.stderr
        shown = json.loads(r.stdout)
        running = docker_engine.containers.get(inst.container).attrs["Image"]
        assert running == mtp.id, "the rollback went where the tag points now"
        assert (
            f"{way_back} names another image ({changed.id}) now: returning to the image it "
            f"named, {mtp.id}"
        ) in r.stderr
        assert inst.image() == mtp.id  # the env file names the ID: no tag can move it
        back = _history(inst)[-1]
        assert (back.kind, back.outcome, back.to_image, back.to_image_id) == (
            "rollback",
            "ok",
            mtp.id,
            mtp.id,
        )
        assert _facts(shown) == _facts(vars(back)), shown
        assert (slot["image"], slot["image_id"]) == (way_back, mtp.id)
        assert (cut.from_image_id, cut.to_image_id) == (mtp.id, changed.id)
    finally:
        docker_engine.images.remove(way_back)
        if inst.image() == mtp.id:
            inst.set_image(MTP_IMAGE)  # what runs, by its tag: the next test's ensure is a no-op


def _facts(entry: dict) -> tuple:
    """What a history entry says of its move (``--json``'s object, or an Entry's fields)."""
    keys = ("id", "kind", "outcome", "from_image", "to_image", "from_image_id", "to_image_id")
    return tuple(entry[k] for k in keys)


def _two_at_once(inst: SystemdInstance, *args: str) -> subprocess.CompletedProcess:
    """Run the same ``appliance ARGS`` twice at once: exactly one proceeds (exit 0, returned),
    the other is refused as busy (exit 3) without touching anything."""
    argv, env = inst.appliance_argv(*args)
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 3], outs
    busy = next(err for p, (_out, err) in zip(procs, outs, strict=True) if p.returncode == 3)
    assert "busy" in busy.lower() or "in progress" in busy.lower(), busy
    out, err = next(o for p, o in zip(procs, outs, strict=True) if p.returncode == 0)
    return subprocess.CompletedProcess(argv, 0, out, err)


@pytest.mark.traffic
def test_editing_vllm_image_and_restarting_the_unit_serves_the_new_image(systemd_instance):
    """The operator's own gesture, no appliance command: edit VLLM_IMAGE in the instance's env
    file, ``systemctl restart gemma4-vllm@NAME``, and the engine that answers is the new image's
    (its vLLM version from /version, its model from /v1/models, MTP off in /metrics). It leaves
    the instance on the pre-MTP image, where the seed's replay below starts. The restart runs
    under steady traffic: the old engine drains, none cut."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    with VLLMClient(inst.url, api_key=inst.api_key) as engine:
        assert engine.version() == "0.32.0"
    assert specdecode.parse(inst.metrics()).speculative
    env = f"/etc/gemma4-vllm/{inst.instance}.env"
    inst.machine.run("sed", "-i", f"s|^VLLM_IMAGE=.*|VLLM_IMAGE={PRE_MTP_IMAGE}|", env)
    assert f"VLLM_IMAGE={PRE_MTP_IMAGE}\n" in (inst.root / env.lstrip("/")).read_text()
    with Traffic(inst.url, inst.api_key, label="systemctl restart") as traffic:
        restarted = inst.machine.systemctl("restart", inst.unit, check=False, timeout=900)
        traffic.wait_back()
    assert restarted.returncode == 0, inst.machine.journal(inst.unit)
    # The promise: nothing cut or errored, a request running at the stop finished whole, and
    # the new engine serves after the refusals.
    assert (broke := traffic.report.promise(down=True, back=True)) is None, broke
    assert inst.container_image() == PRE_MTP_IMAGE
    with VLLMClient(inst.url, api_key=inst.api_key) as engine:
        assert engine.version() == "0.19.0"
        assert [m.id for m in engine.models()] == ["gemma4-tiny"]
    assert not specdecode.parse(inst.metrics()).speculative
    assert inst.chat("after the edit", max_tokens=8).status_code == 200


@pytest.mark.traffic
def test_seed_history_replayed_pre_mtp_to_mtp_and_rollback(systemd_instance):
    """The seed's history: pre-MTP (vLLM 0.19) -> MTP, then the rollback. The cutover is started
    twice at once, as two operators (or an operator and the fleet) would: exactly one proceeds
    and writes one history entry. (Once a test of its own, which cost two more engine starts;
    that MTP on keeps every answer within one vLLM version is tests/test_canary_engine.py's
    lossless tests, on the engine.) The cutover runs under steady traffic: every gate and the
    canary pass as on an idle engine, no request cut."""
    inst = systemd_instance
    inst.ensure(PRE_MTP_IMAGE)
    entries_before = len(_history(inst))
    # The 0.19 engine has no MTP: a token a step, so its long answers are kept within the drain
    # (a 400-token stream begun at the stop outlasted the 50 s drain on a busy host, cut).
    short = (200, 180, 160, 140)
    with Traffic(
        inst.url, inst.api_key, long_tokens=short, label="cutover to a good image"
    ) as traffic:
        r = _two_at_once(inst, "cutover", inst.instance, MTP_IMAGE, "--timeout", TIMEOUT)
        traffic.wait_back()
    assert len(_history(inst)) == entries_before + 1
    assert "generation: ok" in r.stderr and "mtp: ok (drafts +" in r.stderr
    assert f"now on {MTP_IMAGE} (was {PRE_MTP_IMAGE}); gates passed" in r.stdout
    # The promise through vLLM 0.19's stop too: its entry point leaves the SIGTERM to vLLM's
    # drain (appliance/engine/vllm_main.py), so the stop gate turns arrivals away and the
    # requests in flight finish (before that: arrivals unanswered, then reset); and the engine
    # core, which now and then dies in glibc at its SIGTERM (1 of 16 stops), gets that SIGTERM
    # only once they ended (before that: 3 streams cut in one brand-new run, issue 52).
    assert (broke := traffic.report.promise(down=True, back=True)) is None, broke
    _serves(inst, MTP_IMAGE, speculative=True)
    e = _history(inst)[-1]
    assert (e.kind, e.outcome, e.from_image, e.to_image) == (
        "cutover",
        "ok",
        PRE_MTP_IMAGE,
        MTP_IMAGE,
    )
    assert [g.name for g in e.gates] == GATES
    assert all(g.ok for g in e.gates)
    slot = json.loads(Layout(inst.root).rollback_slot(inst.instance).read_text())
    assert slot["image"] == PRE_MTP_IMAGE
    # The canary ran on both engines, with token ids on both (vLLM 0.19 knows return_token_ids),
    # and the version change is in its figures and its line, not hidden.
    c = e.canary
    print("seed replay canary:", c["summary"])
    assert (c["vllm_before"], c["vllm_after"], c["version_changed"]) == ("0.19.0", "0.32.0", True)
    assert c["by_text"] is False and c["outputs"] == 14
    assert c["image_before"] == PRE_MTP_IMAGE and c["image_after"] == MTP_IMAGE
    assert "vLLM 0.19.0 -> 0.32.0" in c["summary"]
    if c["parity"] < 1.0:  # a new engine may move the numerics: a warning, never a failure
        assert c["verdict"] == "warn" and "numerics may legitimately move" in c["summary"]
    else:
        assert c["verdict"] == "pass"
    layout = Layout(inst.root)
    before = canary.load(layout.canary_record(inst.instance, "before"))
    assert before.vllm_version == "0.19.0"
    # The model's answers, the lock and the saved env file: root's alone.
    assert {d.name: d.stat().st_mode & 0o777 for d in layout.private_dirs(inst.instance)} == {
        "locks": 0o700,
        "history": 0o700,
        "rollback": 0o700,
        "cutover": 0o700,
        "canary": 0o700,
    }
    assert all(o.token_ids and len(o.token_ids) == o.completion_tokens for o in before.outputs)
    # Its cost is printed and kept: per prompt and in all, before and after.
    assert f"canary: recording 14 prompts on {PRE_MTP_IMAGE} before the restart" in r.stderr
    assert r.stderr.count("canary: 14 prompts in ") == 2 and "s per prompt" in r.stderr
    assert c["seconds_before"] > 0 and c["seconds_per_prompt_after"] > 0
    assert f"{inst.instance}: canary passed" in r.stdout
    prom = layout.metrics_textfile().read_text()
    assert f'gemma4_appliance_canary_ok{{instance="{inst.instance}"}} 1.0' in prom
    assert 'vllm="0.19.0->0.32.0"' in prom
    # 0.19 drafted nothing, so the MTP image's acceptance is judged against the
    # instance's acceptance baseline (an earlier cutover's, or none yet), and its passing record
    # is the baseline from now on: kept on disk, shown by status, exported with the state.
    judged = c["baseline"]
    assert judged is not None and judged["failures"] == []
    if judged["baseline"] is None:
        assert "this record becomes the instance's baseline" in c["summary"]
    else:
        assert judged["change"]["samples"] > 0
    assert f"canary: the acceptance baseline of {inst.instance} is now acceptance" in r.stderr
    [st] = json.loads(inst.appliance("status", inst.instance, "--json").stdout)["instances"]
    kept = st["baseline"]
    assert kept["image"] == MTP_IMAGE and kept["vllm_version"] == "0.32.0"
    assert kept["acceptance"] > 0.5 and kept["tokens_per_step"] > 1.5  # the copy drafter
    assert f'gemma4_appliance_acceptance_baseline{{instance="{inst.instance}"}}' in (
        layout.metrics_textfile().read_text()
    )

    r = inst.appliance("rollback", inst.instance, "--timeout", TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "mtp: ok (not expected for this image (speculative decoding off))" in r.stderr
    assert "canary: off" in r.stderr  # the way back never waits on a comparison
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
    assert "canary:     not run by the last rollback" in s.stdout
    assert f"baseline:   acceptance {kept['acceptance']:.0%}" in s.stdout  # a rollback keeps it
    assert _history(inst)[-1].canary is None
