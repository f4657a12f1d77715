"""A command given a --root other than / works on that tree only: it never reaches the host's
systemd or Docker unless the operator names the tree's own (APPLIANCE_SYSTEMD_PREFIX,
DOCKER_HOST), and it refuses in one line naming what it would need, before writing anything.

The real Docker engine holds the test's images (a cutover of the tree would find them there:
that is what made the host's engine look like the tree's). This host's systemctl is real too,
without a systemd to answer: a cutover that reached it failed its restart and its way back.
"""

from __future__ import annotations

import pytest
from plugins.cli import invoke

pytestmark = pytest.mark.docker

HOST_ONLY = ("APPLIANCE_SYSTEMD_PREFIX", "DOCKER_HOST", "APPLIANCE_ROOT")


def _invoke(argv: list[str], **env: str):
    """The CLI with none of the variables that name a tree's systemd or Docker, but ``env``."""
    return invoke(argv, env={**dict.fromkeys(HOST_ONLY), **env}, code=None)


def _untouched(tree, env_before: bytes) -> None:
    assert tree.env_path.read_bytes() == env_before
    assert not (tree.root / "var").exists(), "nothing written: not even the lock or history"


def test_a_cutover_of_a_tree_asks_neither_the_hosts_docker_nor_its_systemd(
    mtp_instance, preflight_images
):
    before = mtp_instance.env_path.read_bytes()
    argv = ["cutover", "i1", preflight_images["mtp"], "--root", str(mtp_instance.root)]
    argv += ["--no-canary", "--timeout", "5"]
    result = _invoke(argv)
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: --root {mtp_instance.root} is not this host's /"), line
    assert "set DOCKER_HOST to the tree's own Docker" in line
    _untouched(mtp_instance, before)
    # The tree's Docker named, its systemd not: refused at the first systemd call, untouched,
    # with the same code as Docker's refusal (one code per kind of refusal).
    result = _invoke(argv, DOCKER_HOST="unix:///var/run/docker.sock")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "set APPLIANCE_SYSTEMD_PREFIX to the tree's own systemd" in line, line
    _untouched(mtp_instance, before)


def test_a_cutover_whose_systemd_does_not_answer_is_refused_before_anything_is_written(
    mtp_instance, preflight_images
):
    before = mtp_instance.env_path.read_bytes()
    argv = ["cutover", "i1", preflight_images["mtp"], "--root", str(mtp_instance.root)]
    result = _invoke(
        [*argv, "--no-canary", "--timeout", "5"],
        DOCKER_HOST="unix:///var/run/docker.sock",
        APPLIANCE_SYSTEMD_PREFIX="/nonexistent/appliance-test/no-systemctl",
    )
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert "cannot ask systemd about gemma4-vllm@i1.service" in line, line
    _untouched(mtp_instance, before)


def test_an_image_prune_of_a_tree_never_judges_the_hosts_images(mtp_instance, preflight_images):
    argv = ["image", "prune", "--mode", "all", "--dry-run", "--root", str(mtp_instance.root)]
    result = _invoke(argv)
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "set DOCKER_HOST to the tree's own Docker" in line, line
    listing = _invoke(["image", "list", "--root", str(mtp_instance.root)])
    assert listing.exit_code == 2 and "DOCKER_HOST" in listing.output
