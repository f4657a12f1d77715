"""One multi-node group (head + worker) of ``cpu-tiny-mtp-2node`` under real systemd in nspawn.

Both nodes run on one machine, as the rendered units would on a host that runs the head and a
worker: ``gemma4-vllm-head@mn2test`` and ``gemma4-vllm-worker@mn2test`` started by systemd 252
in the booted machine ``gemma4-multinode``, each running the appliance's serve script, which runs
the CPU image (``gemma4-vllm:0.32.0-mtp-cpu``) as a container on the host's dockerd (containers
``gemma4-vllm-mn2test-head``/``-worker``; host networking, the host's IPC and one shared /tmp,
so they meet as two processes of one host do: gotchas/multinode-start-order-and-worker-death.md).
Why the image and not the host's .venv vLLM:
the units run images (cutover moves the pair between them), and the machine's rootfs has no
Python. The names collide with no other test (not ``systest``/``gemma4-systest``).

The pair costs two engines (~2 GB each, ~1-2 min to start on 2 cores): ONE group per session,
every test moves it. The second image of the cutover is derived from the MTP image (same
engine and labels, its own image ID, built in seconds): vLLM 0.19 (``gemma4-vllm:0.19.0-cpu``) has
``--nnodes`` too, but no Gemma 4 MTP and ~9 GB.
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance import multinode, profiles, units
from appliance.cutover.context import Context
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.host.layout import Layout, Node
from appliance.host.names import ROLES, node_container, node_unit
from appliance.host.systemd import Systemd
from appliance.instance import installer

from . import nspawn
from .docker_engine import machine_lock

GROUP = "mn2test"
MACHINE = "gemma4-multinode"
PROFILE = "cpu-tiny-mtp-2node"
MTP_IMAGE = "gemma4-vllm:0.32.0-mtp-cpu"
DERIVED_REPO = "gemma4-multinode-test"
DERIVED_TAG = "0.32.0-mtp-b"
DERIVED_IMAGE = f"{DERIVED_REPO}:{DERIVED_TAG}"
BUILD_DIGEST_LABEL = "io.gemma4-appliance.build-digest"
START_TIMEOUT = 600.0
VLLM_CACHE = nspawn.vllm_cache_dir("multinode")


def build_derived_image(client, parent_id: str) -> str:
    """``gemma4-multinode-test:0.32.0-mtp-b``: the MTP image with one label more (its own ID;
    the build-digest label overridden so the image builder never takes it for cpu-mtp)."""
    with machine_lock("test-images"):
        return _build_derived_image(client, parent_id)


def _build_derived_image(client, parent_id: str) -> str:
    want = f"test-multinode-{parent_id.removeprefix('sha256:')[:16]}"
    found = client.images.list(filters={"label": f"{BUILD_DIGEST_LABEL}={want}"})
    if found:
        image = found[0]
    else:
        dockerfile = f"FROM {parent_id}\nLABEL io.gemma4-appliance.test=multinode-b\n".encode()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("Dockerfile")
            info.size = len(dockerfile)
            tar.addfile(info, io.BytesIO(dockerfile))
        buf.seek(0)
        image, _ = client.images.build(
            fileobj=buf,
            custom_context=True,
            labels={BUILD_DIGEST_LABEL: want},
            pull=False,
            rm=True,
        )
    if DERIVED_IMAGE not in image.tags:
        image.tag(DERIVED_REPO, DERIVED_TAG)
    return DERIVED_IMAGE


@dataclass
class Group:
    """The running group: its machine, port, key and a few actions."""

    machine: nspawn.Machine
    port: int
    docker: object
    derived_image: str
    before: set[str]  # the machine's files before the group's install (Machine.files)

    @property
    def head(self) -> str:
        return node_unit(GROUP, "head")

    @property
    def worker(self) -> str:
        return node_unit(GROUP, "worker")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str | None:
        path = Layout(self.machine.root).node_api_key_file(GROUP, "head")
        return path.read_text().strip() if path.exists() else None

    def show(self, unit: str, prop: str) -> str:
        return self.machine.systemctl("show", "-p", prop, "--value", unit).stdout.strip()

    def started_at(self, unit: str) -> int:
        """When the unit's main process started (monotonic microseconds)."""
        return int(self.show(unit, "ExecMainStartTimestampMonotonic") or 0)

    def context(self) -> Context:
        return Context(
            layout=Layout(self.machine.root),
            systemd=Systemd(tuple(self.machine.enter_argv())),
            docker_client=self.docker,
            progress=lambda msg: print("multinode:", msg, flush=True),
        )

    def container_image_id(self, role: str) -> str:
        return self.docker.containers.get(node_container(GROUP, role)).attrs["Image"]

    def chat(self, content: str = "hello", max_tokens: int = 24) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            json={
                "model": "gemma4-tiny",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {},
            timeout=120,
        )

    def counters(self) -> specdecode.Counters | None:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return specdecode.parse(text).total()

    def wait_new_start(self, unit: str, previous: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``unit`` is active on a start newer than InvocationID ``previous``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            inv = self.show(unit, "InvocationID")
            if inv and inv != previous and self.machine.is_active(unit) == "active":
                return
            time.sleep(1)
        raise nspawn.NspawnError(
            f"{unit} did not come back:\n{self.machine.journal(self.head, 40)}\n"
            f"{self.machine.journal(self.worker, 40)}"
        )


# Module scope: only tests/test_multinode_systemd.py uses the pair; its engines go down after it.
@pytest.fixture(scope="module")
def multinode_group(appliance_images, docker_engine) -> Iterator[Group]:
    """Group ``mn2test`` installed in machine ``gemma4-multinode`` (head and worker on one host),
    started the operator's way (``systemctl start gemma4-vllm-head@mn2test``: BindsTo= pulls the
    worker in, After= starts it first), serving the MTP image."""
    assert MTP_IMAGE in appliance_images["cpu-mtp"].tags
    derived = build_derived_image(docker_engine, appliance_images["cpu-mtp"].image_id)
    model_dir = devmodel.cached("copy").root
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    prof = profiles.get(PROFILE)
    assert prof.multinode is not None
    # A free rendezvous port: the profile's fixed one may be taken on a shared test host.
    prof = dataclasses.replace(
        prof, multinode=dataclasses.replace(prof.multinode, master_port=free_port())
    )
    port = free_port()
    # The names (group, containers, its socket folder) are fixed: a second run waits for them.
    with (
        machine_lock(f"group-{GROUP}"),
        nspawn.boot(MACHINE, binds=[(str(model_dir), str(model_dir))]) as m,
    ):
        group = Group(m, port, docker_engine, derived, m.files())
        try:
            installer.install(
                prof,
                GROUP,
                node=Node(roles=("head", "worker")),
                root=m.root,
                options=units.Options(
                    image=MTP_IMAGE,
                    port=port,
                    model_dir=str(model_dir),
                    vllm_cache_dir=str(VLLM_CACHE),
                ),
            )
            # The serve script MOUNTS the key file into the container, and the dockerd here is
            # the host's: it resolves the machine's /etc/gemma4-vllm/... on the host, where it
            # does not exist (it would create a directory there). No key files, then: on
            # 127.0.0.1 the serve script serves without a key (it says so in the journal).
            for role in ROLES:
                Layout(m.root).node_api_key_file(GROUP, role).unlink()
            m.daemon_reload()
            m.systemctl("start", "--no-block", group.head)
            m.wait_active(group.head, timeout=START_TIMEOUT)
            yield group
        finally:
            m.systemctl("stop", group.worker, group.head, check=False, timeout=180)
            m.poweroff()
            remove_group(GROUP)


def remove_group(group: str) -> None:
    """What a CPU group leaves on the host's dockerd: its containers, and the zmq socket folder
    they shared."""
    for role in ROLES:
        subprocess.run(
            ["docker", "rm", "--force", node_container(group, role)],
            capture_output=True,
            check=False,
        )
    shutil.rmtree(f"{multinode.RPC_DIR}/{group}", ignore_errors=True)


def host_path(m: nspawn.Machine, path: str) -> Path:
    return m.root / path.lstrip("/")
