"""The serve program refuses an image of the other build than the instance's profile runs on
(issue 53 §3): a CPU image for a CUDA profile, or the reverse, is one journal line and exit 78
(EX_CONFIG: the unit does not restart), before any container is started. It reads the image's
labels already; the env file says the build (install writes VLLM_GPUS for a GPU profile only).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from appliance import units
from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.models import EX_CONFIG
from appliance.oci import labels
from appliance.profiles import get

IMAGE = "gemma4-vllm:0.32.0"


def _fake_docker(tmp_path: Path, variant: str | None) -> str:
    """A PATH whose ``docker`` answers ``image inspect`` with an appliance image's labels
    (``variant`` its build) and logs every other call; returns the PATH."""
    found = {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true", labels.VERSION: "1"}
    if variant:
        found[labels.VARIANT] = variant
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "docker.log"
    tool = bin_dir / "docker"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {shlex.quote(str(log))}\n'
        f'if [ "$1" = image ]; then echo {shlex.quote(json.dumps(found))}; exit 0; fi\n'
        "exit 1\n"
    )
    tool.chmod(0o755)
    return str(bin_dir)


def _install(tmp_path: Path, profile: str) -> Path:
    """Instance ``i1`` of ``profile`` under a tree, its model folders there (a folder not there
    yet is exit 75, before the image is read)."""
    root = tmp_path / "root"
    (folder := tmp_path / "models").mkdir()
    opts = units.Options(image=IMAGE, hf_cache_dir=str(folder))
    if get(profile).uses_devmodel:
        opts = units.Options(image=IMAGE, model_dir=str(folder))
    units.install(get(profile), "i1", root=root, options=opts)
    return root


def _serve(root: Path, name: str, command: str, path: str) -> subprocess.CompletedProcess:
    values = envfile.read(Layout(root).env_file(name)).values
    return subprocess.run(
        [str(Layout(root).serve_program), name, command],
        env={**values, "PATH": path, "APPLIANCE_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("profile", "image_build", "runs_on"),
    [("cpu-tiny-mtp", "cuda", "cpu"), ("l4x4-31b-mtp", "cpu", "cuda")],
)
def test_an_image_of_the_other_build_is_refused_in_one_line_exit_78(
    tmp_path, profile, image_build, runs_on
):
    root = _install(tmp_path, profile)
    path = _fake_docker(tmp_path, image_build)
    proc = _serve(root, "i1", "print", path)
    assert proc.returncode == EX_CONFIG, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"gemma4-vllm@i1: image {IMAGE} is a {image_build} build ({labels.VARIANT}="
        f"{image_build}) and this instance's profile runs on {runs_on}"
    ), line
    assert f"cut over to a {runs_on} image" in line
    assert proc.stdout == ""  # no docker command printed
    assert [c.split()[:2] for c in (tmp_path / "docker.log").read_text().splitlines()] == [
        ["image", "inspect"]
    ]  # nothing run, nothing stopped


@pytest.mark.parametrize("variant", ["cpu", None])
def test_the_right_build_or_an_unlabelled_one_goes_on(tmp_path, variant):
    root = _install(tmp_path, "cpu-tiny-mtp")
    proc = _serve(root, "i1", "print", _fake_docker(tmp_path, variant))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("docker run ")
