"""One CPU instance of ``gemma4-vllm@.service`` installed and running under real systemd.

Shared by the units' systemd test and the cutover's: a container engine
start costs about a minute on a 2-core machine, so the session boots ONE systemd-nspawn machine
(tests/plugins/nspawn.py: real systemd 252, the host's Docker engine bound in) and serves ONE
instance of ``cpu-tiny-mtp``, and every test moves that one instance between images. Tests that
need a given image call :meth:`SystemdInstance.ensure`, which restarts only when the instance is
not already serving that image.

The fixture installs it the operator's way (``appliance instance install``, ``daemon-reload``,
a start) and keeps what the install printed in :attr:`SystemdInstance.install`, which the first
test of tests/test_units_systemd.py checks.

Paths the host's Docker engine resolves are host paths: the tiny model pair is bound into the
machine at the SAME path (the serve script checks ``MODEL_DIR`` inside the machine, dockerd
mounts it from the host), and the vLLM compile cache is a host directory kept across runs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance import units
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.fsutil import write_atomic
from appliance.host import envfile
from appliance.host.layout import Layout

from . import nspawn
from .docker_engine import machine_lock

INSTANCE = "systest"
PROFILE = "cpu-tiny-mtp"
MTP_IMAGE = "gemma4-vllm:0.32.0-mtp-cpu"
PRE_MTP_IMAGE = "gemma4-vllm:0.19.0-cpu"
BROKEN_IMAGE = "gemma4-vllm:0.32.0-mtp-broken-cpu"
START_TIMEOUT = 600.0
REPO = Path(__file__).resolve().parents[2]
VLLM_CACHE = nspawn.vllm_cache_dir("systest")
APPLIANCE = str(Path(sys.executable).parent / "appliance")


@dataclass
class SystemdInstance:
    """The installed instance: its machine, names, port and API key, and a few actions."""

    machine: nspawn.Machine
    instance: str
    port: int
    model_dir: Path
    install: subprocess.CompletedProcess | None = None  # `appliance instance install`'s run

    @property
    def root(self) -> Path:
        return self.machine.root

    @property
    def unit(self) -> str:
        return units.unit_name(self.instance)

    @property
    def container(self) -> str:
        return units.container_name(self.instance)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env_path(self) -> Path:
        return Layout(self.root).env_file(self.instance)

    @property
    def api_key(self) -> str:
        return Layout(self.root).api_key_file(self.instance).read_text().strip()

    def image(self) -> str:
        return envfile.read(self.env_path).get(envfile.IMAGE_KEY) or ""

    def set_image(self, image: str) -> None:
        """Point the env file at ``image`` (what an operator's edit does; atomic)."""
        env = envfile.read(self.env_path)
        write_atomic(self.env_path, env.with_value(envfile.IMAGE_KEY, image))

    def show(self, prop: str) -> str:
        return self.machine.systemctl("show", "-p", prop, "--value", self.unit).stdout.strip()

    def main_pid(self) -> int:
        return int(self.show("MainPID") or 0)

    def restart(self, timeout: float = START_TIMEOUT) -> None:
        """``systemctl restart`` and wait until a new start is active (= /health 200,
        ExecStartPost): the first ``active`` after the restart could still be the old start."""
        previous = self.show("InvocationID")
        self.machine.systemctl("reset-failed", self.unit, check=False)
        self.machine.systemctl("restart", "--no-block", self.unit)
        self.wait_restarted(previous, timeout=timeout)

    def wait_restarted(self, previous_invocation: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until a start newer than ``previous_invocation`` is active (serving)."""
        deadline = time.monotonic() + timeout
        while self.show("InvocationID") == previous_invocation:
            if time.monotonic() > deadline:
                raise nspawn.NspawnError(
                    f"{self.unit} was not restarted:\n{self.machine.journal(self.unit)}"
                )
            time.sleep(0.5)
        self.machine.wait_active(self.unit, timeout=max(1.0, deadline - time.monotonic()))

    def ensure(self, image: str) -> None:
        """Serve ``image``, restarting only when the instance is not already serving it."""
        if self.image() == image and self.machine.is_active(self.unit) == "active":
            return
        self.set_image(image)
        self.restart()

    def container_image(self) -> str:
        """The image reference the running container was started from (host's Docker)."""
        return subprocess.run(
            ["docker", "inspect", "--format", "{{.Config.Image}}", self.container],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    def chat(
        self, content: str = "hello", max_tokens: int = 12, key: str | None = ""
    ) -> httpx.Response:
        """One chat completion; ``key=""`` sends the instance's key, ``None`` sends none."""
        key = self.api_key if key == "" else key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            json={
                "model": "gemma4-tiny",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            headers=headers,
            timeout=120,
        )

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def systemd_prefix(self) -> str:
        """``APPLIANCE_SYSTEMD_PREFIX`` that runs systemctl/journalctl inside the machine."""
        return shlex.join(self.machine.enter_argv())

    def appliance_argv(self, *args: str) -> tuple[list[str], dict[str, str]]:
        """The real CLI's argv and environment: systemd inside the machine, files under its root."""
        env = dict(os.environ, **self.machine.tree_env(), APPLIANCE_ROOT=str(self.root))
        return [APPLIANCE, *args], env

    def appliance(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
        """Run ``appliance ARGS`` (subprocess) against this machine; output captured."""
        argv, env = self.appliance_argv(*args)
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False
        )


def _install(inst: SystemdInstance) -> subprocess.CompletedProcess:
    """Install the instance the operator's way and start it on the MTP image."""
    install = inst.appliance(
        "instance", "install", inst.instance, "--profile", PROFILE, "--image", MTP_IMAGE,
        "--port", str(inst.port), "--model-dir", str(inst.model_dir),
        "--vllm-cache-dir", str(VLLM_CACHE),
    )  # fmt: skip
    if install.returncode != 0:
        raise nspawn.NspawnError(f"appliance instance install failed:\n{install.stderr}")
    key_path = Layout(inst.root).api_key_file(inst.instance)
    key_path.write_bytes(key_path.read_bytes().strip() + b"\r\n")
    inst.machine.daemon_reload()
    inst.restart()
    return install


@pytest.fixture(scope="session")
def systemd_instance(appliance_images) -> Iterator[SystemdInstance]:
    """Instance ``systest`` of cpu-tiny-mtp in a booted nspawn machine, installed by
    ``appliance instance install`` and serving the MTP image. Tests move it between images; the
    machine and the container go at session end.

    The images come from ``appliance_images`` (tests/plugins/docker_engine.py): built through
    ``appliance image build`` when missing, a label lookup when present. The pre-MTP image is
    not waited for here: tests that use it ask for ``pre_mtp_image``.

    The key file is rewritten with CRLF line endings before the engine first starts: the engine
    and every Python client must read the same key from it, and every test of the session shows
    they do (tests/test_secrets_systemd.py checks it)."""
    for target, ref in (("cpu-mtp", MTP_IMAGE), ("cpu-broken", BROKEN_IMAGE)):
        assert ref in appliance_images[target].tags, (target, appliance_images[target].tags)
    model_dir = devmodel.cached("copy").root
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    # The names (instance, container) are fixed: a second run on this host waits for them.
    with (
        machine_lock(f"instance-{INSTANCE}"),
        nspawn.boot("gemma4-systest", binds=[(str(model_dir), str(model_dir))]) as m,
    ):
        inst = SystemdInstance(m, INSTANCE, free_port(), model_dir)
        try:
            inst.install = _install(inst)
            yield inst
        finally:
            m.systemctl("stop", inst.unit, check=False, timeout=180)
            m.poweroff()
            # The container runs on the host's engine: make sure none outlives the machine.
            subprocess.run(
                ["docker", "rm", "--force", inst.container], capture_output=True, check=False
            )


@pytest.fixture(scope="session")
def pre_mtp_image(appliance_images) -> str:
    """``gemma4-vllm:0.19.0-cpu`` (vLLM 0.19, no MTP: the seed's rollback image), built on first
    use.
    The machines stream runs the modules that need it last (tests/conftest.py), so the 9 GB
    build goes on while the others run."""
    assert PRE_MTP_IMAGE in appliance_images["cpu-pre-mtp"].tags
    return PRE_MTP_IMAGE
