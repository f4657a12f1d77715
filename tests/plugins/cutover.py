"""Fixtures for the cutover tests: small labelled images in the real Docker engine, and an
instance tree under a temp root.

The images are a few bytes imported with ``docker import`` and the appliance's labels: enough
for every check made before a cutover touches the service (the engine never runs from them).
They live under their own repository name, so no other test's images are touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.oci import labels

from .docker_engine import machine_lock, tiny_rootfs

TEST_REPO = "gemma4-cutover-test"

# name -> labels. "nolabels" is any image not built by the appliance; "badlabels" lies. "mtp" and
# "pre-mtp" stand for the CPU images; "cuda-mtp" for the GPU hosts' image, "novariant" for one
# made by hand that does not say which build it is.
PREFLIGHT_IMAGES = {
    "mtp": {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true", labels.VARIANT: "cpu"},
    "pre-mtp": {labels.VLLM_VERSION: "0.19.0", labels.MTP: "false", labels.VARIANT: "cpu"},
    "nolabels": {},
    "badlabels": {labels.VLLM_VERSION: "0.19.0", labels.MTP: "true"},
    "cuda-mtp": {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true", labels.VARIANT: "cuda"},
    "novariant": {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true"},
}
# The tag each is imported under, where it is not its name: the version tags the scheme gives
# (a cutover to a floating tag such as mtp or pre-mtp is refused without --force).
PREFLIGHT_TAGS = {"mtp": "0.32.0-mtp-cpu", "pre-mtp": "0.19.0-cpu", "cuda-mtp": "0.32.0-mtp"}


@pytest.fixture(scope="session")
def cutover_docker() -> Iterator[object]:
    """A Docker SDK client for the real engine (started by the docker_engine plugin if needed)."""
    import docker

    from .docker_engine import SOCKET, ensure_dockerd

    ensure_dockerd()
    client = docker.DockerClient(base_url=f"unix://{SOCKET}", timeout=600)
    yield client
    client.close()


@pytest.fixture(scope="session")
def preflight_images(cutover_docker) -> dict[str, str]:
    """name -> full reference of each small labelled image (imported once per session)."""
    import docker

    refs = {}
    with machine_lock("test-images"):
        for name, found in PREFLIGHT_IMAGES.items():
            tag = PREFLIGHT_TAGS.get(name, name)
            refs[name] = f"{TEST_REPO}:{tag}"
            try:
                if (cutover_docker.images.get(refs[name]).labels or {}).items() >= found.items():
                    # Imported by an earlier session: re-importing would leave dangling ones.
                    continue
            except docker.errors.ImageNotFound:
                pass
            changes = [f'LABEL {k}="{v}"' for k, v in found.items()] or ["LABEL unrelated=1"]
            cutover_docker.api.import_image_from_data(
                tiny_rootfs("cutover preflight test image"),
                repository=TEST_REPO,
                tag=tag,
                changes=changes,
            )
    return refs


@dataclass
class InstanceTree:
    """A root with ``etc/gemma4-vllm/<instance>.env`` and the state dir below it."""

    root: Path
    instance: str
    env_path: Path

    def snapshot(self) -> dict[str, bytes]:
        """Every regular file under the root and its bytes (to prove nothing was touched)."""
        return {
            str(p.relative_to(self.root)): p.read_bytes()
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }


def write_env(root: Path, instance: str, image: str, profile: str) -> Path:
    path = root / "etc" / "gemma4-vllm" / f"{instance}.env"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"# written by the cutover tests\n"
        + f"VLLM_IMAGE={image}\nAPPLIANCE_PROFILE={profile}\n".encode()
        + b"  # keep me\n"
        + b"VLLM_HOST=127.0.0.1\nVLLM_PORT=8000\n"
    )
    return path


@pytest.fixture
def mtp_instance(tmp_path, preflight_images) -> Iterator[InstanceTree]:
    """Instance ``i1`` with profile cpu-tiny-mtp, on the pre-MTP test image."""
    env = write_env(tmp_path, "i1", preflight_images["pre-mtp"], "cpu-tiny-mtp")
    yield InstanceTree(tmp_path, "i1", env)


# FAKE, and why: the systemd of a tree whose units answer every query but refuse a restart (as
# a masked unit does: "Unit is masked"). The docker tier has no systemd to mask a unit in (real
# systemd is the nspawn tier's), and a systemd that does not answer at all is refused before a
# cutover writes anything, so the restart's own failure, and the way back after it, need this.
RESTART_REFUSED = """#!/bin/sh
# PREFIX systemctl|journalctl ARGS...: answers `show` (the unit is not loaded), refuses the rest.
case "$2" in
  show) echo "LoadState=not-found"; echo "ActiveState=inactive" ;;
  is-active) echo "inactive"; exit 3 ;;
  reset-failed) exit 0 ;;
  *) echo "Failed to $2 unit: Unit is masked." >&2; exit 1 ;;
esac
"""


@pytest.fixture(scope="session")
def restart_refused(tmp_path_factory) -> dict[str, str]:
    """The environment of a CLI call on a test tree: the host's Docker named as the tree's
    (``DOCKER_HOST``) and :data:`RESTART_REFUSED` as its systemd (``APPLIANCE_SYSTEMD_PREFIX``)."""
    script = tmp_path_factory.mktemp("systemd") / "restart-refused"
    script.write_text(RESTART_REFUSED)
    script.chmod(0o755)
    return {"APPLIANCE_SYSTEMD_PREFIX": str(script), "DOCKER_HOST": "unix:///var/run/docker.sock"}
