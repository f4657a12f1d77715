"""A multi-node group across the fleet's two hosts: the head on ``fleet-a``, the worker on
``fleet-b`` (``cpu-tiny-mtp-2node``), each under that host's systemd, moved by
``deploy/ansible/playbooks/multinode-cutover.yml`` over SSH.

The hosts are the fleet tier's (tests/plugins/fleet.py: one booted pair per run); their
instances are down by then (the ``fleet`` fixture stops them after tests/test_fleet.py). The
machines share the host's network namespace and Docker engine, so the two nodes meet on
loopback as the CPU profile requires, while each node's unit, env file, history and appliance
are its own host's: what the play moves is two hosts' state, reached only through Ansible.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from appliance import profiles, units
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.host import envfile
from appliance.host.layout import Layout, Node
from appliance.host.names import node_container, node_unit
from appliance.instance import installer

from . import nspawn
from .docker_engine import inspect_container
from .fleet import OFF_IMAGE, VENV_BIN, Fleet, FleetHost
from .multinode import PROFILE, remove_group

VLLM_CACHE = nspawn.vllm_cache_dir("fleet-group")

GROUP = "xhost"
START_TIMEOUT = 600


@dataclass(frozen=True)
class Mark:
    """A moment (epoch seconds) and whether the group's head ran then."""

    at: float
    head_runs: bool


@dataclass
class FleetGroup:
    """The group on the fleet: its head and worker hosts, the head's port."""

    fleet: Fleet
    head: FleetHost
    worker: FleetHost
    port: int

    def node(self, role: str) -> FleetHost:
        return self.head if role == "head" else self.worker

    def unit(self, role: str) -> str:
        return node_unit(GROUP, role)

    def env_image(self, role: str) -> str | None:
        path = Layout(self.node(role).root).env_file(GROUP)
        return envfile.read(path).get(envfile.IMAGE_KEY)

    def container(self, role: str, fmt: str = "{{.Image}}") -> str:
        """``docker inspect`` of the node's container; raises when it cannot be read (no such
        container included), so two failed reads never compare equal."""
        return inspect_container(node_container(GROUP, role), fmt)

    def mark(self) -> Mark:
        """Now, and whether the head's container runs now: where :meth:`starts_beside_a_head`
        begins."""
        try:
            running = self.container("head", "{{.State.Running}}") == "true"
        except RuntimeError:  # no head container: stopped (--rm)
            running = False
        return Mark(time.time(), running)

    def starts_beside_a_head(self, mark: Mark) -> list[str]:
        """The worker's container starts since ``mark`` that came while a head's container ran
        whose group had formed (a worker had started since that head did; at ``mark``, a head
        that ran had its group), each as its time, from the Docker engine's events. A worker
        started so joins that head's finished rendezvous, and hangs once the head restarts; a
        head started since waits for its workers, and a worker's start then is its join."""
        head, worker = node_container(GROUP, "head"), node_container(GROUP, "worker")
        out = subprocess.run(
            ["docker", "events", "--since", f"{mark.at:.3f}", "--until", f"{time.time():.3f}"]
            + ["--filter", f"container={head}", "--filter", f"container={worker}"]
            + ["--filter", "event=start", "--filter", "event=die", "--format", "{{json .}}"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        events = sorted(
            (json.loads(line) for line in out.splitlines()), key=lambda e: e["timeNano"]
        )
        head_runs = formed = mark.head_runs
        beside = []
        for e in events:
            if e["Actor"]["Attributes"]["name"] == head:
                head_runs, formed = e["Action"] == "start", False
            elif e["Action"] == "start" and head_runs:
                if formed:
                    beside.append(time.strftime("%H:%M:%S", time.gmtime(e["timeNano"] / 1e9)))
                formed = True
        return beside

    def history(self, role: str) -> list[dict]:
        """The node's host's record of the group (read inside the machine, not over SSH)."""
        proc = self.node(role).machine.run(
            str(VENV_BIN / "appliance"), "history", GROUP, "--json", check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout)["entries"]

    def move(self, image: str, **extra: object):
        """Run the group's play to ``image``."""
        return self.fleet.playbook(
            "multinode-cutover",
            multinode_hosts="gemma4",
            multinode_group=GROUP,
            multinode_image=image,
            multinode_timeout=START_TIMEOUT,
            **extra,
        )

    def generates(self) -> specdecode.Counters | None:
        """One real generation through the head (both nodes needed); the MTP counters after."""
        resp = httpx.post(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json={
                "model": profiles.get(PROFILE).served_model_name,
                "messages": [{"role": "user", "content": "the group answers"}],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] > 0
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text
        return specdecode.parse(text).total()


@pytest.fixture(scope="module")
def fleet_group(fleet_hosts: Fleet) -> Iterator[FleetGroup]:
    """Group ``xhost`` installed on both hosts and serving ``OFF_IMAGE`` (the MTP engine with
    its MTP label off), started as an operator would: the worker host's unit, then the head's."""
    head, worker = fleet_hosts.host("fleet-a"), fleet_hosts.host("fleet-b")
    prof = profiles.get(PROFILE)
    assert prof.multinode is not None
    # A free rendezvous port: the multinode tier's pair may run beside this one.
    prof = dataclasses.replace(
        prof, multinode=dataclasses.replace(prof.multinode, master_port=free_port())
    )
    port = free_port()
    opts = units.Options(
        image=OFF_IMAGE,
        port=port,
        model_dir=str(devmodel.cached("copy").root),
        vllm_cache_dir=str(VLLM_CACHE),
    )
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    group = FleetGroup(fleet_hosts, head, worker, port)
    remove_group(GROUP)
    try:
        nodes = ((head, Node(("head",))), (worker, Node(("worker",), 1)))
        for host, node in nodes:
            installer.install(prof, GROUP, node=node, root=host.root, options=opts)
            # The serve script mounts the key file, which the host's dockerd would look for on
            # the host: no key on 127.0.0.1 (as tests/plugins/multinode.py).
            for role in node.roles:
                Layout(host.root).node_api_key_file(GROUP, role).unlink()
            # The play runs `appliance` by PATH, as the fleet's install links it.
            host.machine.run("ln", "-sf", str(VENV_BIN / "appliance"), "/usr/local/bin/appliance")
            host.machine.daemon_reload()
        worker.machine.systemctl("start", group.unit("worker"))
        head.machine.systemctl("start", "--no-block", group.unit("head"))
        head.machine.wait_active(group.unit("head"), timeout=START_TIMEOUT)
        yield group
    finally:
        head.machine.systemctl("stop", group.unit("head"), check=False, timeout=180)
        worker.machine.systemctl("stop", group.unit("worker"), check=False, timeout=180)
        remove_group(GROUP)
