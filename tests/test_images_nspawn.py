"""The nspawn harness itself, under real systemd: a unit inside picks its image from an env file
and runs it on the host's Docker engine; restarting after an env-file change switches images.

The unit here is a minimal stand-in written by the test (the appliance's real unit is rendered
and tested by the units tests); the container sleeps instead of serving, which is all the
harness needs to show.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.systemd

UNIT = """\
[Unit]
Description=harness check %i
Requires=docker.service
After=docker.service

[Service]
EnvironmentFile=/etc/gemma4-vllm/%i.env
ExecStartPre=-/usr/bin/docker rm -f harness-%i
ExecStart=/usr/bin/docker run --rm --name harness-%i --network none \
  --entrypoint /bin/sleep ${VLLM_IMAGE} 600
ExecStop=/usr/bin/docker rm -f harness-%i
"""


def _running_image(client, name: str, timeout: float = 60) -> str:
    import docker.errors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c = client.containers.get(name)
            if c.status == "running":
                return c.image.id
        except docker.errors.NotFound:
            pass
        time.sleep(0.5)
    raise AssertionError(f"container {name} never ran")


def test_unit_in_nspawn_runs_the_env_files_image_on_the_host_engine(
    nspawn_machine, docker_engine, appliance_images
):
    import docker.errors

    m = nspawn_machine
    mtp, other = appliance_images["cpu-mtp"].image_id, appliance_images["cpu-broken"].image_id
    m.write("/etc/systemd/system/harness@.service", UNIT)
    m.write("/etc/gemma4-vllm/h1.env", "VLLM_IMAGE=gemma4-vllm:mtp-cpu\n")
    m.daemon_reload()
    m.systemctl("start", "harness@h1.service")
    try:
        m.wait_active("harness@h1.service")
        assert _running_image(docker_engine, "harness-h1") == mtp
        # Another image: the broken one serves nothing, but it sleeps as well as any.
        m.write("/etc/gemma4-vllm/h1.env", "VLLM_IMAGE=gemma4-vllm:0.32.0-mtp-broken-cpu\n")
        m.systemctl("restart", "harness@h1.service")
        m.wait_active("harness@h1.service")
        assert _running_image(docker_engine, "harness-h1") == other
        assert "Started" in m.journal("harness@h1.service")
    finally:
        m.systemctl("stop", "harness@h1.service", check=False)
    with pytest.raises(docker.errors.NotFound):
        docker_engine.containers.get("harness-h1")
