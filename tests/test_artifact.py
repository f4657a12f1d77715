"""One artifact carries everything: the wheel built from this checkout,
installed into an empty environment outside any checkout, builds the CPU image, writes the
observability plane and installs an instance, with no repository in reach.

The wheel is built from a copy of the source tree (the checkout stays clean) and installed with
uv into a new venv that sees only the package's declared dependencies (linked from this
environment: tests/test_packaging.py's link_dependencies).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml
from test_packaging import link_dependencies

from appliance import assets

REPO = Path(__file__).resolve().parents[1]
PROMTOOL = os.environ.get("APPLIANCE_PROMTOOL", "/usr/bin/promtool")
# What the wheel is built from: the package's own source, nothing of the developer's.
SOURCE_IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "*.egg-info", "__pycache__", "*.pyc", "tests", "benchmarks"
)


class Installed:
    """The installed artifact: its python, its `appliance` script and a folder outside the
    checkout to run them in."""

    def __init__(self, root: Path) -> None:
        self.python = root / "venv" / "bin" / "python"
        self.appliance = root / "venv" / "bin" / "appliance"
        self.cwd = root / "work"
        self.cwd.mkdir()

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        res = subprocess.run(
            [str(self.appliance), *argv],
            cwd=self.cwd,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        if check:
            assert res.returncode == 0, res.stdout + res.stderr
        return res


def build_wheel(root: Path) -> Path:
    """The appliance's wheel, built from a copy of this checkout's sources under ``root``
    (the copy is gone afterwards: nothing of the source stays in reach)."""
    src = root / "src"
    shutil.copytree(REPO, src, ignore=SOURCE_IGNORED)
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
        cwd=root,
    )
    shutil.rmtree(src)
    [wheel] = wheels.glob("gemma4_appliance-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("artifact")
    wheel = build_wheel(root)
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    uv = Path(sys.executable).with_name("uv")
    subprocess.run(
        [str(uv), "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--python", str(root / "venv/bin/python"), str(wheel)],
        check=True,
        capture_output=True,
    )
    link_dependencies(root / "venv/bin/python", root / "site")
    return Installed(root)


def _where(installed: Installed, expr: str) -> Path:
    code = f"import appliance, appliance.assets, appliance.images.build as b; print({expr})"
    out = subprocess.run(
        [installed.python, "-c", code],
        cwd=installed.cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def test_the_installed_package_carries_the_checkouts_run_time_folders(installed):
    package = _where(installed, "appliance.__file__").parent
    assert not package.is_relative_to(REPO), package
    assert _where(installed, "b.docker_folder()") == package / "_assets" / "docker"
    assert _where(installed, "appliance.assets.root()") == package / "_assets"
    for folder in assets.FOLDERS:
        ours, theirs = REPO / folder, package / "_assets" / folder
        files = sorted(
            p.relative_to(ours)
            for p in ours.rglob("*")
            if p.is_file() and "tests" not in p.relative_to(ours).parts
        )
        assert files, folder
        shipped = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
        assert shipped == files, folder
        _, mismatch, errors = filecmp.cmpfiles(ours, theirs, [str(f) for f in files], False)
        assert (mismatch, errors) == ([], []), folder


def test_the_installed_package_writes_the_plane_and_installs_an_instance(installed, tmp_path):
    out = tmp_path / "plane"
    res = installed.run("observability", "write", "--out", str(out))
    compose = out / "deploy" / "observability" / "compose.yaml"
    assert f"docker compose -f {compose} up -d" in res.stdout
    for name, service in yaml.safe_load(compose.read_text())["services"].items():
        for volume in service.get("volumes", []):
            src = volume.split(":", 1)[0]
            if src.startswith("."):
                assert (compose.parent / src).exists(), (name, volume)
    check = subprocess.run(
        [PROMTOOL, "check", "config", "prometheus.yml"],
        cwd=out / "prometheus",
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # A second write replaces the plane; a folder it did not write is refused, untouched.
    installed.run("observability", "write", "--out", str(out))
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep").write_text("mine")
    refused = installed.run("observability", "write", "--out", str(other), check=False)
    assert refused.returncode == 2 and "is not a plane" in refused.stderr, refused.stderr
    assert [p.name for p in other.iterdir()] == ["keep"]

    root = tmp_path / "host"
    installed.run("instance", "install", "i1", "--profile", "cpu-tiny-mtp", "--root", str(root))
    assert (root / "etc/systemd/system/gemma4-vllm@.service").is_file()
    assert (root / "etc/gemma4-vllm/i1.env").is_file()
    assert (root / "usr/local/libexec/gemma4-vllm/serve").is_file()


@pytest.mark.docker
def test_the_installed_package_builds_the_cpu_image(installed, appliance_images):
    """The image build from the installed files hashes to the same content key as the
    checkout's: it finds the image the suite built, and would build the same one."""
    built = appliance_images["cpu-mtp"]
    res = installed.run("image", "build", "cpu-mtp")
    assert f"identical image {built.image_id[7:19]} already built" in res.stdout + res.stderr
