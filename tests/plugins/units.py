"""Fixtures for the units tests: small labelled images in the real Docker engine.

The images are a few bytes imported with ``docker import`` and the appliance's labels: enough for
the serve script's label reading (``docker image inspect``) and its ``print``/``remove`` paths;
no engine runs from them. Their own repository name keeps other tests' images untouched.
"""

from __future__ import annotations

import subprocess

import pytest

from appliance.oci import labels

from .docker_engine import machine_lock, tiny_rootfs

UNITS_REPO = "gemma4-units-test"

# tag -> labels, as the image builder writes them (ADR 0003).
SERVE_IMAGES = {
    "mtp-0.32": {labels.VERSION: "0.32.0-mtp", labels.VLLM_VERSION: "0.32.0", labels.MTP: "true"},
    "mtp-0.21": {labels.VERSION: "0.21.0-mtp", labels.VLLM_VERSION: "0.21.0", labels.MTP: "true"},
    "pre-mtp": {labels.VERSION: "0.19.0", labels.VLLM_VERSION: "0.19.0", labels.MTP: "false"},
    "nolabels": {},
}


def _docker_answers() -> bool:
    try:
        return (
            subprocess.run(
                ["docker", "version"], capture_output=True, timeout=10, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def serve_images() -> dict[str, str]:
    """tag -> reference of each small labelled image (imported once; reused across sessions)."""
    if not _docker_answers():
        try:
            from .docker_engine import ensure_dockerd
        except ImportError:
            pytest.fail("no Docker engine answers and no docker_engine plugin to start one")
        ensure_dockerd()
    refs = {}
    with machine_lock("test-images"):
        for tag, wanted in SERVE_IMAGES.items():
            ref = refs[tag] = f"{UNITS_REPO}:{tag}"
            have = subprocess.run(
                ["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", ref],
                capture_output=True,
                text=True,
                check=False,
            )
            labelled = all(f'"{k}":"{v}"' in have.stdout for k, v in wanted.items())
            if have.returncode == 0 and labelled:
                continue
            cmd = ["docker", "import"]
            for k, v in wanted.items() or {"unrelated": "1"}.items():
                cmd += ["--change", f'LABEL {k}="{v}"']
            subprocess.run(
                [*cmd, "-", ref],
                input=tiny_rootfs("serve script test image"),
                check=True,
                capture_output=True,
            )
    return refs
