"""S12: a floating tag bypasses the gates. `appliance image build` moves ``latest``, ``mtp`` and
``pre-mtp`` (and their ``-cpu`` forms), so an instance left on one runs a new engine at its next
plain restart, ungated. A cutover to one is refused without ``--force``, naming the version tag
of the image it names now; install without ``--image`` takes that version tag too. Against the
real Docker engine: the suite's real CPU image, and small labelled images imported into it
(tests/plugins/cutover.py). That the rollback goes to the image ID its slot kept once the tag
moved is proven under real systemd (test_cutover_systemd.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import docker.errors
import pytest
from plugins.cli import invoke
from plugins.cutover import TEST_REPO
from plugins.docker_engine import SOCKET, machine_lock

pytestmark = pytest.mark.docker

DOCKER = {"DOCKER_HOST": f"unix://{SOCKET}"}  # the trees' Docker is the host's (host/reach.py)
CPU_MTP = "gemma4-vllm:0.32.0-mtp-cpu"


def _invoke(*argv: str, env: dict[str, str] = DOCKER):
    return invoke(argv, code=None, env=env)


LATEST = ("gemma4-vllm", "latest")
HELD = ("gemma4-vllm-test-held", "latest")  # keeps what LATEST named while a test moves LATEST


@contextlib.contextmanager
def _without_latest(client) -> Iterator[None]:
    """No gemma4-vllm:latest on the host's engine inside; what it named gets it back after."""
    try:
        client.images.get(":".join(LATEST)).tag(*HELD)
        client.images.remove(":".join(LATEST), noprune=True)
    except docker.errors.ImageNotFound:
        pass
    try:
        yield
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(":".join(LATEST), noprune=True)
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.get(":".join(HELD)).tag(*LATEST)
            client.images.remove(":".join(HELD), noprune=True)


@pytest.fixture
def floating(cutover_docker, preflight_images) -> str:
    """The small CPU MTP image also tagged ``mtp-cpu`` in the test repository, as `appliance
    image build` tags it."""
    cutover_docker.images.get(preflight_images["mtp"]).tag(TEST_REPO, "mtp-cpu")
    return f"{TEST_REPO}:mtp-cpu"


def test_a_cutover_to_a_floating_tag_is_refused_naming_the_version_tag(
    restart_refused, mtp_instance, preflight_images, floating
):
    before = mtp_instance.snapshot()
    for argv in ([], ["--check"]):
        result = _invoke(
            "cutover", "i1", floating, "--root", str(mtp_instance.root), *argv, env=restart_refused
        )
        assert result.exit_code == 1, result.output
        assert result.output.startswith(
            f"Error: {floating} is a floating tag: `appliance image build` moves it, and the "
            "next restart would run whatever it names then, without the gates (cut over to "
            f"{preflight_images['mtp']} (what it names now), or pass --force)"
        ), result.output
    assert mtp_instance.snapshot() == before


def test_force_takes_a_floating_tag_all_the_same(restart_refused, mtp_instance, floating):
    argv = ["cutover", "i1", floating, "--check", "--force", "--root", str(mtp_instance.root)]
    result = _invoke(*argv, env=restart_refused)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["image"] == floating


def test_a_floating_tag_without_its_version_tag_here_is_named_by_its_id(
    restart_refused, mtp_instance, preflight_images, cutover_docker
):
    """No tag at all is Docker's ``latest``; the image has no version tag here: the ID then."""
    image = cutover_docker.images.get(preflight_images["novariant"])
    image.tag("gemma4-floating-test")  # latest
    try:
        argv = [
            "cutover",
            "i1",
            "gemma4-floating-test",
            "--check",
            "--root",
            str(mtp_instance.root),
        ]
        result = _invoke(*argv, env=restart_refused)
        assert result.exit_code == 1, result.output
        assert f"(cut over to {image.id} (what it names now), or pass --force)" in result.output
    finally:
        cutover_docker.images.remove("gemma4-floating-test:latest")


def test_the_real_cpu_images_latest_is_refused_for_its_version_tag(
    restart_refused, mtp_instance, appliance_images
):
    assert CPU_MTP in appliance_images["cpu-mtp"].tags
    argv = ["cutover", "i1", "gemma4-vllm:latest-cpu", "--check", "--root", str(mtp_instance.root)]
    result = _invoke(*argv, env=restart_refused)
    assert result.exit_code == 1, result.output
    assert f"(cut over to {CPU_MTP} (what it names now), or pass --force)" in result.output


def test_install_without_image_takes_the_version_tag_of_the_newest_image_of_its_build(
    tmp_path, appliance_images
):
    """The old default was gemma4-vllm:latest whatever the host held: a CPU image's tag (then),
    and a tag the next build moves."""
    assert CPU_MTP in appliance_images["cpu-mtp"].tags
    result = _invoke("instance", "install", "t", "-p", "cpu-tiny-mtp", "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert f"VLLM_IMAGE={CPU_MTP}\n" in (tmp_path / "etc/gemma4-vllm/t.env").read_text()
    assert "warning: no cpu appliance image" not in result.output


def test_install_with_no_image_of_its_build_here_falls_back_to_latest_never_a_cpu_image(
    tmp_path, docker_engine, appliance_images
):
    """No CUDA image on this CPU-only host: the GPU build's latest, with the warning that it
    floats; or, on a host upgraded from the old scheme, where gemma4-vllm:latest still names the
    CPU image, the refusal of that CPU image. Never a CPU image in a GPU profile's env file.
    Both hosts are made here (the tag set, then removed) under a lock on the tag, and whatever
    gemma4-vllm:latest named before is given its tag back."""
    argv = ["instance", "install", "g", "-p", "l4x4-31b-mtp"]
    with machine_lock("tag-gemma4-vllm-latest"), _without_latest(docker_engine):
        docker_engine.images.get(appliance_images["cpu-mtp"].image_id).tag(*LATEST)
        upgraded = tmp_path / "upgraded"
        result = _invoke(*argv, "--root", str(upgraded))
        assert result.exit_code == 1, result.output
        assert "Error: image gemma4-vllm:latest is a cpu build" in result.output
        assert not upgraded.exists()

        docker_engine.images.remove(":".join(LATEST), noprune=True)  # the CPU image, untagged
        result = _invoke(*argv, "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "VLLM_IMAGE=gemma4-vllm:latest\n" in (tmp_path / "etc/gemma4-vllm/g.env").read_text()
    assert (
        "warning: no cuda appliance image on this host for profile l4x4-31b-mtp: "
        "VLLM_IMAGE=gemma4-vllm:latest, a tag `appliance image build` moves"
    ) in result.output
