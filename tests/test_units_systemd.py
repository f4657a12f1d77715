"""The installed unit under real systemd (nspawn) with the host's Docker and the real CPU images.

One instance (tests/plugins/systemd_instance.py) serves throughout, installed the operator's way
before the first test (the first test checks that install); the tests run
in file order: the pre-MTP image (vLLM 0.19) first, where tests/test_cutover_systemd.py left the
unit by editing the env file and restarting (the rollback path the image labels make safe), then
the same unit on the MTP image. Why the labels matter (the pre-MTP image given the MTP flag does
not start) is shown without systemd, in tests/test_images_docker.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from plugins.systemd_instance import MTP_IMAGE, PRE_MTP_IMAGE, SystemdInstance

from appliance import profiles, units
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.host.systemd import Systemd
from appliance.units import instance

pytestmark = [pytest.mark.systemd, pytest.mark.docker, pytest.mark.engine]

MODEL = "gemma4-tiny"


def _invocation_journal(inst: SystemdInstance) -> str:
    """The journal of the unit's current start only (serve script and engine output)."""
    inv = inst.show("InvocationID")
    return inst.machine.run(
        "journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={inv}", check=False
    ).stdout


SERVE = "/usr/local/libexec/gemma4-vllm/serve"


def test_an_installed_instance_serves_from_the_one_serve_program(systemd_instance):
    inst = systemd_instance
    # The install says what it wrote and the one next step; it starts nothing itself.
    out = inst.install.stdout
    assert f"wrote     {Layout(inst.root).env_file(inst.instance)}" in out, out
    assert f"systemctl daemon-reload && systemctl enable --now {inst.unit}" in out, out
    env = envfile.read(inst.env_path).values
    assert env["VLLM_IMAGE"] == MTP_IMAGE
    assert (env["APPLIANCE_PROFILE"], env["VLLM_PORT"]) == ("cpu-tiny-mtp", str(inst.port))
    # systemd runs the one serve program for this instance, and it serves with the key.
    assert f"argv[]={SERVE} systest run" in inst.show("ExecStart")
    rec = instance.read(inst.root, inst.instance)
    assert (rec.port, rec.base_url) == (inst.port, inst.url)
    assert inst.machine.is_active(inst.unit) == "active"
    assert inst.chat("after the install", max_tokens=4).status_code == 200
    assert inst.chat("without the key", max_tokens=4, key=None).status_code == 401


# pre_mtp_image: built on first use. The machines stream runs the tests that need it after the
# others (tests/conftest.py): this one after tests/test_cutover_systemd.py, whose seed replay
# leaves the instance on the pre-MTP image by exactly this (no engine start of its own).
@pytest.mark.usefixtures("pre_mtp_image")
def test_the_pre_mtp_image_serves_without_speculative_decoding(systemd_instance):
    """The whole rollback: one line of the env file, and a restart."""
    inst = systemd_instance
    inst.ensure(PRE_MTP_IMAGE)
    assert inst.container_image() == PRE_MTP_IMAGE
    journal = _invocation_journal(inst)
    assert "vLLM 0.19.0, Gemma 4 MTP false" in journal
    assert "serving without speculative decoding" in journal
    assert "Traceback" not in journal and not re.search(r"\bERROR\b", journal), journal[-3000:]
    resp = inst.chat("count with me", max_tokens=12)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 12
    assert not specdecode.parse(inst.metrics()).speculative


def test_the_unit_runs_the_container_of_vllm_image_with_mtp(systemd_instance):
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    assert inst.machine.is_active(inst.unit) == "active"
    assert inst.container_image() == MTP_IMAGE
    journal = _invocation_journal(inst)
    assert f"image {MTP_IMAGE}: version 0.32.0-mtp, vLLM 0.32.0, Gemma 4 MTP true" in journal
    spec = profiles.get("cpu-tiny-mtp").speculative_args(devmodel="/models")
    assert f"serving with Gemma 4 MTP speculative decoding ({' '.join(spec)})" in journal
    assert f"vLLM healthy on 127.0.0.1:{inst.port}" in journal


def test_a_chat_completion_with_the_api_key_moves_the_mtp_counters(systemd_instance):
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    before = specdecode.parse(inst.metrics())
    resp = inst.chat("count with me", max_tokens=16)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 16
    d = specdecode.delta(before, specdecode.parse(inst.metrics()), MODEL)
    assert d.status == "ok" and d.drafts > 0 and d.accepted > 0, d
    # vLLM guards /v1 with the key from the 0600 file: no key, or a wrong one, is refused.
    assert inst.chat(key=None).status_code == 401
    assert inst.chat(key="not-the-key").status_code == 401


def test_the_api_key_is_never_in_the_journal_or_a_command_line(systemd_instance):
    inst = systemd_instance
    key = inst.api_key
    assert len(key) >= 32
    # -o export carries every field of every entry (_CMDLINE, _EXE, ...), not just MESSAGE.
    journal = inst.machine.run(
        "journalctl", "--no-pager", "-o", "export", "-u", inst.unit, check=False
    ).stdout
    assert "vLLM healthy" in journal and key not in journal
    # Every process on the host (the container's engine included) and in the machine.
    cmdlines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdlines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    assert any(f"--port {inst.port}" in c for c in cmdlines)  # the engine is among them
    assert not [c for c in cmdlines if key in c]
    unit_cmds = inst.machine.systemctl("show", inst.unit).stdout
    assert f"{SERVE} systest run" in unit_cmds and key not in unit_cmds
    args = subprocess.run(
        ["docker", "inspect", "--format", "{{json .Path}} {{json .Args}}", inst.container],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--speculative-config" in args and key not in args


def test_uninstall_disables_a_second_instance_and_leaves_the_first_serving(systemd_instance):
    """A second instance, enabled but never started (an engine start costs a minute here):
    uninstall disables it through systemctl and removes its files, not the shared ones."""
    inst = systemd_instance
    units.install("cpu-tiny", "spare", root=inst.root, options=units.Options(port=free_port()))
    inst.machine.daemon_reload()
    inst.machine.systemctl("enable", units.unit_name("spare"))
    assert (
        inst.machine.systemctl("is-enabled", units.unit_name("spare")).stdout.strip() == "enabled"
    )
    result = units.uninstall(
        "spare", root=inst.root, systemd=Systemd(tuple(inst.machine.enter_argv()))
    )
    assert inst.root / "etc/gemma4-vllm/spare.env" in result.removed
    state = inst.machine.systemctl("is-enabled", units.unit_name("spare"), check=False)
    assert state.stdout.strip() == "disabled", state
    assert not list((inst.root / "etc/gemma4-vllm").glob("spare.*"))
    assert Layout(inst.root).serve_program.exists()  # systest still needs it
    assert inst.machine.is_active(inst.unit) == "active"
