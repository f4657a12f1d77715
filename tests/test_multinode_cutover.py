"""A group's cutover against the real Docker engine, without systemd: what it reads and writes
around the group's lock. The real pair under systemd is
tests/test_multinode_systemd.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import units
from appliance.cutover import flow
from appliance.cutover.context import Context
from appliance.cutover.flow import RollbackFailed
from appliance.fsutil import write_atomic
from appliance.host import envfile
from appliance.host import lock as locks
from appliance.host.layout import Layout, Node
from appliance.host.systemd import Systemd
from appliance.instance import installer

pytestmark = pytest.mark.docker

GROUP = "grp"
PROFILE = "cpu-tiny-mtp-2node"


class _Images:
    def __init__(self, real, first_lookup) -> None:
        self._real = real
        self._first = first_lookup

    def get(self, ref):
        if self._first is not None:
            hook, self._first = self._first, None
            hook()
        return self._real.get(ref)


class _ConcurrentAtFirstLookup:
    """The real Docker client; ``hook`` runs once, at the first image lookup, i.e. after the
    cutover's preflight read its env files and before it takes the lock. Sequencing only: every
    answer is the real engine's."""

    def __init__(self, client, hook) -> None:
        self.images = _Images(client.images, hook)
        self.containers = client.containers


def _install(root: Path, image: str) -> Path:
    opts = units.Options(image=image, model_dir="/srv/tiny")
    node = Node(roles=("head", "worker"))
    installer.install(PROFILE, GROUP, node=node, root=root, options=opts)
    return Layout(root).env_file(GROUP)


def test_the_env_files_are_read_under_the_lock(
    tmp_path, cutover_docker, preflight_images, restart_refused
):
    """An install that runs under the group's lock during the cutover's preflight (after it
    found the group not busy) changed the env file; the cutover's way back writes back THAT
    file, not the bytes it read before the lock."""
    env_path = _install(tmp_path, preflight_images["pre-mtp"])
    layout = Layout(tmp_path)
    changed = envfile.read(env_path).with_value("VLLM_PORT", "8123")

    def finish_the_install() -> None:
        with locks.hold(layout.lock_file(GROUP), GROUP, "install"):
            write_atomic(env_path, changed)

    # The restart is the first gate to fail (the tree's systemd refuses it), so the cutover goes
    # straight to its way back, which fails the same way.
    ctx = Context(
        layout=layout,
        systemd=Systemd((restart_refused["APPLIANCE_SYSTEMD_PREFIX"],)),
        docker_client=_ConcurrentAtFirstLookup(cutover_docker, finish_the_install),
    )
    with pytest.raises(RollbackFailed, match="failed gate 'restart'"):
        # No engine serves here: the output canary could not record the old image.
        flow.cutover(ctx, GROUP, preflight_images["mtp"], timeout=5, canary=False)
    assert env_path.read_bytes() == changed, "the way back wrote the bytes read before the lock"
