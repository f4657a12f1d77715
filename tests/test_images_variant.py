"""An image is the build it says it is: a CPU image is refused for a GPU profile (and a CUDA image
for a CPU profile) wherever an image is chosen, against the real Docker engine.

The CPU image is the real one the suite builds (``cpu-mtp``, labelled
``io.gemma4-appliance.variant=cpu`` by docker/cpu/Dockerfile); the CUDA image, and one that does
not say which build it is, are small labelled images imported into the same engine
(tests/plugins/cutover.py): every check here reads labels, none runs the engine. Each refusal
is one line, exit 1 (a refusal, install and cutover alike), and nothing written.
"""

from __future__ import annotations

import json

import pytest
from plugins.cli import invoke
from plugins.cutover import write_env
from plugins.docker_engine import SOCKET

pytestmark = pytest.mark.docker

GPU = "l4x4-31b-mtp"
CPU_TAG = "gemma4-vllm:0.32.0-mtp-cpu"
DOCKER = {"DOCKER_HOST": f"unix://{SOCKET}"}  # the trees' Docker is the host's (host/reach.py)


def _invoke(*argv: str, env: dict[str, str] = DOCKER):
    return invoke(argv, code=None, env=env)


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def cpu_image(appliance_images) -> str:
    """The real CPU MTP image (built, or found built and tagged), by its version tag."""
    assert CPU_TAG in appliance_images["cpu-mtp"].tags
    return CPU_TAG


def test_the_cpu_image_has_tags_of_its_own_and_says_it_is_a_cpu_build(
    appliance_images, docker_engine, cpu_image
):
    image = docker_engine.images.get(appliance_images["cpu-mtp"].image_id)
    assert image.labels["io.gemma4-appliance.variant"] == "cpu"
    assert {cpu_image, "gemma4-vllm:mtp-cpu", "gemma4-vllm:latest-cpu"} <= set(image.tags)


def test_install_refuses_a_cpu_image_for_a_gpu_profile_and_writes_nothing(tmp_path, cpu_image):
    result = _invoke(
        "instance", "install", "31b", "-p", GPU, "--image", cpu_image, "--root", str(tmp_path)
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(
        f"Error: image {cpu_image} is a cpu build (io.gemma4-appliance.variant=cpu) and profile "
        f"{GPU} runs on cuda (choose a cuda image, e.g. gemma4-vllm:0.32.0-mtp (appliance image "
        "build cuda --vllm-version 0.32.0))"
    ), result.output
    assert len(result.output.strip().splitlines()) == 1
    assert _files(tmp_path) == {}


def test_install_refuses_a_cuda_image_for_a_cpu_profile(tmp_path, preflight_images):
    cuda = preflight_images["cuda-mtp"]
    result = _invoke(
        "instance", "install", "t", "-p", "cpu-tiny-mtp", "--image", cuda, "--root", str(tmp_path)
    )
    assert result.exit_code == 1, result.output
    assert f"Error: image {cuda} is a cuda build" in result.output
    assert "profile cpu-tiny-mtp runs on cpu" in result.output
    assert "gemma4-cutover-test:0.32.0-mtp-cpu (appliance image build cpu-mtp)" in result.output
    assert _files(tmp_path) == {}


def test_install_of_an_image_that_does_not_say_its_build_warns_and_installs(
    tmp_path, preflight_images
):
    ref = preflight_images["novariant"]
    result = _invoke(
        "instance", "install", "t", "-p", "cpu-tiny-mtp", "--image", ref, "--root", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    assert (
        f"warning: image {ref} has no io.gemma4-appliance.variant label (made by hand?): "
        "whether it is a cpu build is not checked"
    ) in result.output
    assert f"VLLM_IMAGE={ref}\n" in (tmp_path / "etc/gemma4-vllm/t.env").read_text()


def test_cutover_preflight_refuses_a_cpu_image_for_a_gpu_profile(
    restart_refused, tmp_path, cpu_image
):
    env = write_env(tmp_path, "31b", "gemma4-vllm:0.32.0-mtp", GPU)
    before = _files(tmp_path)
    result = _invoke(
        "cutover", "31b", cpu_image, "--check", "--root", str(tmp_path), env=restart_refused
    )
    assert result.exit_code == 1, result.output
    assert f"Error: image {cpu_image} is a cpu build" in result.output
    assert f"profile {GPU} runs on cuda" in result.output
    assert _files(tmp_path) == before and env.exists()


def test_cutover_preflight_refuses_a_cuda_image_for_a_cpu_profile(
    restart_refused, mtp_instance, preflight_images
):
    before = mtp_instance.snapshot()
    argv = ["cutover", "i1", preflight_images["cuda-mtp"], "--root", str(mtp_instance.root)]
    result = _invoke(*argv, env=restart_refused)
    assert result.exit_code == 1, result.output
    assert (
        "is a cuda build (io.gemma4-appliance.variant=cuda) and profile cpu-tiny-mtp runs on cpu"
    ) in result.output
    assert mtp_instance.snapshot() == before


def test_cutover_check_of_an_image_that_does_not_say_its_build_carries_the_warning(
    restart_refused, mtp_instance, preflight_images
):
    ref = preflight_images["novariant"]
    result = _invoke(
        "cutover", "i1", ref, "--check", "--root", str(mtp_instance.root), env=restart_refused
    )
    assert result.exit_code == 0, result.output
    [warning] = json.loads(result.output)["warnings"]
    assert warning.startswith(f"image {ref} has no io.gemma4-appliance.variant label")


def test_host_check_blocks_a_cpu_image_for_a_gpu_profile(tmp_path, cpu_image):
    argv = ["host", "check", "--profile", GPU, "--image", cpu_image, "--root", str(tmp_path)]
    result = _invoke(*argv, "--json")
    found = {f["name"]: f for f in json.loads(result.output)["findings"]}
    assert found["docker.image"]["status"] == "blocker", found
    assert found["docker.image"]["message"].startswith(f"image {cpu_image} is a cpu build")
    ok = _invoke("host", "check", "--profile", "cpu-tiny-mtp", "--image", cpu_image, "--json")
    found = {f["name"]: f for f in json.loads(ok.output)["findings"]}
    assert found["docker.image"] == {
        "name": "docker.image",
        "status": "ok",
        "message": f"image {cpu_image} is a cpu build",
        "fix": "",
    }


def test_status_flags_an_instance_whose_image_is_the_other_build(tmp_path, cpu_image):
    write_env(tmp_path, "31b", cpu_image, GPU)
    result = _invoke("status", "31b", "--root", str(tmp_path))
    lines = result.output.splitlines()
    assert "  labels:     vLLM 0.32.0, mtp=yes, build=cpu" in lines, result.output
    assert any(
        line.startswith(f"  WRONG BUILD: image {cpu_image} is a cpu build") for line in lines
    ), result.output
    data = json.loads(_invoke("status", "31b", "--json", "--root", str(tmp_path)).output)
    assert data["instances"][0]["wrong_build"].startswith(f"image {cpu_image} is a cpu build")
