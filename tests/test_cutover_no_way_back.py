"""A failed cutover that cannot roll back says why: no previous image, or --no-rollback.

The images are the small labelled imports of the preflight tests (real Docker engine). The
restart is refused by the tree's systemd (tests/plugins/cutover.py ``restart_refused``, a
stand-in: it says why), so the gates never pass. The rollback to a previous image under real
systemd is test_cutover_systemd.py's.
"""

from __future__ import annotations

import json

import pytest
from plugins.cli import invoke

from appliance.cutover import history
from appliance.host.layout import Layout

pytestmark = pytest.mark.docker


def _cutover(tree, env: dict[str, str], image: str, *extra: str):
    # No engine serves here, so the output canary could not record the old image: off.
    args = ["cutover", tree.instance, image, "--root", str(tree.root), "--timeout", "5"]
    args += ["--no-canary", *extra]
    return invoke(args, env=env, code=None)


def test_without_a_previous_image_it_says_so_not_no_rollback(
    mtp_instance, preflight_images, restart_refused
):
    env = mtp_instance.env_path
    # No VLLM_IMAGE: nothing to return to.
    env.write_text("APPLIANCE_PROFILE=cpu-tiny-mtp\nVLLM_HOST=127.0.0.1\nVLLM_PORT=8000\n")
    result = _cutover(mtp_instance, restart_refused, preflight_images["mtp"])
    assert result.exit_code == 4, result.output
    error = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1, result.output
    assert "failed gate 'restart'" in error[0]
    assert f"NOT rolled back: {env} named no previous VLLM_IMAGE to return to" in error[0]
    assert "--no-rollback" not in result.output
    assert f"`appliance cutover i1 IMAGE --root {mtp_instance.root}` to a working one" in error[0]
    # What it says is what happened: the new image stays in the env file, the entry failed.
    assert f"VLLM_IMAGE={preflight_images['mtp']}" in env.read_text()
    [entry] = history.entries(Layout(mtp_instance.root).history_file("i1"))
    assert (entry.outcome, entry.from_image) == ("failed", None)


def test_with_no_rollback_it_names_the_flag(mtp_instance, preflight_images, restart_refused):
    result = _cutover(mtp_instance, restart_refused, preflight_images["mtp"], "--no-rollback")
    assert result.exit_code == 4, result.output
    assert "NOT rolled back (--no-rollback)" in result.output
    fix = f"`appliance rollback i1 --root {mtp_instance.root}` returns to"
    assert f"{fix} {preflight_images['pre-mtp']}" in result.output


def test_rollback_goes_ahead_when_the_image_it_leaves_is_gone(
    mtp_instance, preflight_images, restart_refused, cli_run
):
    """The emergency a rollback exists for: the current image was removed (or is broken).

    The old code refused, naming `--no-rollback`, an option `rollback` does not have.
    """
    layout = Layout(mtp_instance.root)
    gone = "gemma4-vllm:removed-by-accident"
    env = mtp_instance.env_path
    env.write_text(env.read_text().replace(preflight_images["pre-mtp"], gone))
    slot = {"image": preflight_images["pre-mtp"], "recorded": 0, "entry": "e0"}
    layout.rollback_slot("i1").parent.mkdir(parents=True, exist_ok=True)
    layout.rollback_slot("i1").write_text(json.dumps(slot) + "\n")
    args = ["rollback", "i1", "--root", str(mtp_instance.root), "--timeout", "5"]
    result = cli_run(args, env=restart_refused, code=None)
    # It went ahead: the env file names the rollback target, and the restart was attempted
    # (it fails here only because the tree's systemd refuses it).
    assert f"VLLM_IMAGE={preflight_images['pre-mtp']}" in env.read_text()
    assert "--no-rollback" not in result.output
    assert f"the current image {gone} cannot be inspected" in result.output
    error = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1, result.output
    assert "failed gate 'restart'" in error[0]
    assert f"NOT rolled back: the image it left, {gone}, cannot be inspected" in error[0]
    assert result.exit_code == 4, result.output
    [entry] = history.entries(layout.history_file("i1"))
    assert (entry.kind, entry.outcome, entry.from_image) == ("rollback", "failed", gone)
