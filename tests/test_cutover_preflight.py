"""Refusals before anything is touched, against the real Docker engine.

Each refused cutover leaves every file under the instance's root byte-identical (no env write,
no history line, no rollback slot). That the engine's PID is unchanged too is proven under real
systemd in test_cutover_systemd.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from plugins.cli import invoke

pytestmark = pytest.mark.docker


def _cutover(tree, image: str, *extra: str):
    args = ["cutover", tree.instance, image, "--root", str(tree.root), *extra]
    return invoke(args, code=None)


@pytest.mark.parametrize("image", ["gemma4-vllm:mtp; rm -rf /", "Gemma4-VLLM:mtp", "gemma4-vllm:"])
def test_invalid_reference_is_refused_and_nothing_written(mtp_instance, image):
    before = mtp_instance.snapshot()
    result = _cutover(mtp_instance, image)
    assert result.exit_code == 2, result.output
    assert f"Error: invalid image reference {image!r}" in result.output
    assert mtp_instance.snapshot() == before


def test_missing_image_is_refused_never_pulled(mtp_instance, cutover_docker):
    before = mtp_instance.snapshot()
    result = _cutover(mtp_instance, "gemma4-cutover-test:not-built")
    assert result.exit_code == 1, result.output
    assert "image gemma4-cutover-test:not-built is not on this host" in result.output
    assert "never pulls" in result.output
    assert mtp_instance.snapshot() == before
    assert not cutover_docker.images.list(name="gemma4-cutover-test:not-built")


def test_mtp_profile_and_image_without_mtp_names_both(mtp_instance, preflight_images):
    # The instance is on the pre-MTP image; point it at another reference of the same image.
    before = mtp_instance.snapshot()
    result = _cutover(mtp_instance, preflight_images["pre-mtp"])
    assert result.exit_code == 1, result.output
    assert (
        f"profile cpu-tiny-mtp requests Gemma 4 MTP but image {preflight_images['pre-mtp']} "
        "(vLLM 0.19.0) does not support it"
    ) in result.output
    assert mtp_instance.snapshot() == before


def test_image_without_appliance_labels_is_refused(mtp_instance, preflight_images):
    before = mtp_instance.snapshot()
    result = _cutover(mtp_instance, preflight_images["nolabels"])
    assert result.exit_code == 1, result.output
    assert "has no io.gemma4-appliance.vllm.version label" in result.output
    assert mtp_instance.snapshot() == before


def test_image_claiming_mtp_on_an_old_vllm_is_refused(mtp_instance, preflight_images):
    before = mtp_instance.snapshot()
    result = _cutover(mtp_instance, preflight_images["badlabels"])
    assert result.exit_code == 1, result.output
    assert "labelled io.gemma4-appliance.mtp=true but its vLLM 0.19.0 has no Gemma 4 MTP" in (
        result.output
    )
    assert mtp_instance.snapshot() == before


def test_current_image_missing_means_no_way_back(mtp_instance, preflight_images):
    mtp_instance.env_path.write_text(
        mtp_instance.env_path.read_text().replace(preflight_images["pre-mtp"], "gone:1")
    )
    before = mtp_instance.snapshot()
    result = _cutover(mtp_instance, preflight_images["mtp"])
    assert result.exit_code == 1, result.output
    assert "the current image cannot be the way back: image gone:1 is not on this host" in (
        result.output
    )
    assert "--no-rollback" in result.output
    assert mtp_instance.snapshot() == before


class _ConcurrentCutoverEnds:
    """The real Docker client, except that the first look at ``seen`` (the preflight's look at
    the new image) is where another cutover ends and leaves ``left`` in the env file instead of
    ``was``: that interleaving (between this cutover's preflight and its lock) cannot be
    produced on demand with two real processes."""

    def __init__(self, client, seen: str, env_path: Path, was: str, left: str) -> None:
        self.images = self
        self._client, self._seen, self._env = client, seen, env_path
        self._was, self._left = was, left

    def get(self, ref: str):
        image = self._client.images.get(ref)
        if ref == self._seen and self._left:
            self._env.write_text(self._env.read_text().replace(self._was, self._left))
            self._left = ""
        return image


def test_the_way_back_is_the_image_the_env_file_names_under_the_lock(
    mtp_instance, preflight_images, cutover_docker, tmp_path
):
    """The old code inspected the way back before the lock: a cutover that ended meanwhile left
    ``gone:1`` in the env file, and this one went ahead with no image to return to."""
    from appliance.cutover import flow
    from appliance.cutover.context import Context, PreflightError
    from appliance.host.layout import Layout
    from appliance.host.systemd import Systemd

    new, was = preflight_images["mtp"], preflight_images["pre-mtp"]
    client = _ConcurrentCutoverEnds(cutover_docker, new, mtp_instance.env_path, was, "gone:1")
    ctx = Context(
        layout=Layout(mtp_instance.root),
        systemd=Systemd(prefix=(str(tmp_path / "no-systemctl"),)),
        docker_client=client,
    )
    with pytest.raises(PreflightError, match="cannot be the way back: image gone:1 is not"):
        flow.cutover(ctx, mtp_instance.instance, new, canary=False)
    assert not Layout(mtp_instance.root).history_file(mtp_instance.instance).exists()
    assert "VLLM_IMAGE=gone:1" in mtp_instance.env_path.read_text()


def test_unknown_instance_says_install_first(tmp_path, preflight_images, cli_run):
    result = cli_run(["cutover", "nope", preflight_images["mtp"], "--root", str(tmp_path)], code=2)
    assert f"no instance nope: no {tmp_path}/etc/gemma4-vllm/nope.env" in result.output
    assert "`appliance instance install nope --profile PROFILE` installs it" in result.output
    assert not any(tmp_path.iterdir())


def test_rollback_without_a_recorded_target_is_refused(mtp_instance, cli_run):
    before = mtp_instance.snapshot()
    result = cli_run(["rollback", "i1", "--root", str(mtp_instance.root)], code=1)  # a refusal
    assert "instance i1 has no rollback target" in result.output
    assert mtp_instance.snapshot() == before


_HOLD = """
import sys, time
from pathlib import Path
from appliance.host import lock
from appliance.host.layout import Layout
layout = Layout(Path(sys.argv[1]))
with lock.hold(layout.lock_file("i1"), "i1", "cutover to gemma4-vllm:mtp"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_cutover_while_one_holds_the_lock_is_refused(mtp_instance, preflight_images):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(mtp_instance.root)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout.readline() == b"held\n"
        before = mtp_instance.snapshot()
        result = _cutover(mtp_instance, preflight_images["mtp"])
        assert result.exit_code == 3, result.output
        assert f"instance i1 is busy: a cutover or rollback is in progress (pid {proc.pid}" in (
            result.output
        )
        assert mtp_instance.snapshot() == before
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
