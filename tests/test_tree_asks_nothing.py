"""A test tree asks nothing of the host (issue 53 §1, §3), and one record names what serves a
NAME, whatever its shape.

Every command that takes ``--root`` (found by walking the click tree, not a hand list) runs
against a tree holding a single-node instance ``i1`` and a one-host group ``g1`` (``--role
both``), with stand-in ``systemctl``, ``journalctl``, ``docker`` and ``nvidia-smi`` on PATH that
log their calls, the Docker SDK's client refused and logged, and a server on ``127.0.0.1`` at
each port the tree's env files name that answers 200 to anything (an unrelated server there
was once reported as the instance's ``health: 200``). None of them may be reached, and nothing
may be reported healthy; what was not asked is said ("not asked").
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import pytest
from plugins.cli import invoke

import docker
from appliance import doctor, profiles
from appliance.cli import cli
from appliance.fleet import hosts
from appliance.fsutil import write_atomic
from appliance.host import envfile
from appliance.host.layout import Layout, Node, Shape
from appliance.units import instance

SPIED = ("systemctl", "journalctl", "docker", "nvidia-smi")
# What names a tree's own systemd, Docker or engine: none of it is set here.
TOLD = ("APPLIANCE_SYSTEMD_PREFIX", "DOCKER_HOST", "APPLIANCE_ROOT", "APPLIANCE_URL")
IMAGE = "gemma4-vllm:0.32.0-cpu"
GROUP_PROFILE = "cpu-tiny-mtp-2node"
GPU_PROFILE = "h100-31b-mtp"  # its GPUs are nvidia-smi's to tell: never asked for a tree


# --- the spies -----------------------------------------------------------------------------


class _Listener(ThreadingHTTPServer):
    """A server on 127.0.0.1 that answers 200 ``{}`` to anything and records each request."""

    daemon_threads = True

    def __init__(self) -> None:
        self.hits: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                listener.hits.append(f"{self.command} {self.path}")
                body = b"{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_HEAD = _answer

            def log_message(self, *_args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def listeners():
    found = {"i1": _Listener(), "g1": _Listener(), "x1": _Listener()}
    yield found
    for server in found.values():
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def template(tmp_path_factory, listeners) -> Path:
    """The tree: ``i1`` (cpu-tiny-mtp), ``g1`` (a one-host CPU group) and ``x1`` (a GPU
    profile), each on the port its listener holds, installed through the CLI."""
    root = tmp_path_factory.mktemp("tree")
    for argv in (
        ["i1", "--profile", "cpu-tiny-mtp", "--port", str(listeners["i1"].port)],
        ["g1", "--profile", GROUP_PROFILE, "--role", "both", "--port", str(listeners["g1"].port)],
        ["x1", "--profile", GPU_PROFILE, "--port", str(listeners["x1"].port)],
    ):
        image = "gemma4-vllm:0.32.0" if argv[0] == "x1" else IMAGE  # the profile's build
        env = {**dict.fromkeys(TOLD), "PATH": os.environ["PATH"]}
        invoke(["instance", "install", *argv, "--image", image, "--root", str(root)], env=env)
    return root


class Spies:
    def __init__(self, tmp_path: Path, monkeypatch, listeners) -> None:
        self.log = tmp_path / "spied.log"
        self.log.touch()
        bin_dir = tmp_path / "spy-bin"
        bin_dir.mkdir()
        for tool in SPIED:
            script = bin_dir / tool
            script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{self.log}"\nexit 1\n')
            script.chmod(0o755)
        self.path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        self.listeners = listeners
        for server in listeners.values():
            server.hits.clear()
        self.sdk: list[str] = []
        self.binds: list[tuple] = []

        def refused(client, *args, **kwargs):
            self.sdk.append(f"DockerClient({kwargs.get('base_url', '')})")
            raise docker.errors.DockerException("the test's spy: no Docker here")

        monkeypatch.setattr(docker.DockerClient, "__init__", refused)
        monkeypatch.setattr(docker.APIClient, "__init__", refused)
        ports = {s.port for s in listeners.values()}
        bind = socket.socket.bind

        def spied_bind(sock, address):
            if isinstance(address, tuple) and len(address) > 1 and address[1] in ports:
                self.binds.append(address)
            return bind(sock, address)

        monkeypatch.setattr(socket.socket, "bind", spied_bind)

    def env(self) -> dict:
        return {**dict.fromkeys(TOLD), "PATH": self.path, "HF_HUB_OFFLINE": "1"}

    def reached(self) -> list[str]:
        said = self.log.read_text().splitlines()
        for name, server in self.listeners.items():
            said += [f"{name}'s port: {hit}" for hit in server.hits]
        said += [f"bind {a}" for a in self.binds] + [f"Docker SDK: {c}" for c in self.sdk]
        return said


@pytest.fixture
def spies(tmp_path, monkeypatch, listeners) -> Spies:
    return Spies(tmp_path, monkeypatch, listeners)


@pytest.fixture
def tree(template, tmp_path) -> Path:
    """A copy of the tree of its own (uninstall, install and cutover may write)."""
    root = tmp_path / "root"
    shutil.copytree(template, root, symlinks=True)
    return root


# --- every command that takes --root -------------------------------------------------------


def _root_commands() -> list[str]:
    """Every visible command with a ``--root`` option, as its words (``instance status``)."""
    found = []

    def walk(cmd: click.Command, words: list[str]) -> None:
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, [*words, name])
        elif any(p.name == "root" for p in cmd.params):
            found.append(" ".join(words))

    walk(cli, [])
    return sorted(found)


def _argv(command: str, name: str, scratch: Path) -> list[str]:
    """The rest of ``command``'s arguments beside NAME (or none) and --root."""
    before = scratch / "before.json"
    before.write_text("{}")
    return {
        "bench load": [name],
        "bench run": [name],
        "bench tune": [name],
        "canary record": [name, "--out", str(scratch / "canary.json")],
        "cutover": [name, IMAGE, "--no-canary", "--timeout", "5"],
        "fleet snapshot": [name, "--out", str(scratch / "snap.json")],
        "fleet soak": [name, "--before", str(before), "--seconds", "0"],
        "fleet status": [name, "--json"],
        "history": [name],
        "host check": [name],
        "image list": [],
        "image prune": ["--dry-run"],
        "image rm": [IMAGE],
        "instance cutover": [name, IMAGE, "--no-canary", "--timeout", "5"],
        "instance doctor": [name, "--json"],
        "instance history": [name],
        "instance install": [name],
        "instance rollback": [name, "--timeout", "5"],
        "instance status": [name],
        "instance uninstall": [name],
        "models export": [name, "--to", str(scratch / "export")],
        "models import": [name, "--from", str(scratch / "nothing-here")],
        "models pull": [name],
        "models verify": [name, "--quick"],
        "rollback": [name, "--timeout", "5"],
        "status": [name],
    }[command]


ROOT_COMMANDS = _root_commands()


def test_every_command_that_takes_root_is_proven_below(tmp_path):
    """A new command with --root fails here until it is given its arguments in _argv (and so
    is run by the test below)."""
    missing = []
    for command in ROOT_COMMANDS:
        try:
            _argv(command, "i1", tmp_path)
        except KeyError:
            missing.append(command)
    assert not missing, f"add to _argv: {missing}"
    assert {"status", "instance doctor", "fleet status", "host check"} <= set(ROOT_COMMANDS)


@pytest.mark.parametrize("name", ["i1", "g1", "x1"])
@pytest.mark.parametrize("command", ROOT_COMMANDS)
def test_a_command_under_a_tree_asks_nothing_of_the_host(command, name, tree, spies, tmp_path):
    argv = [*command.split(), *_argv(command, name, tmp_path), "--root", str(tree)]
    res = invoke(argv, env=spies.env(), code=None)
    assert spies.reached() == [], f"{' '.join(argv)} reached the host:\n{res.output}"
    assert "health:     200" not in res.output and '"healthy": true' not in res.output


# --- what the commands say instead -----------------------------------------------------------


@pytest.mark.parametrize("name", ["i1", "g1"])
def test_status_says_what_it_did_not_ask_and_is_not_serving(name, tree, spies):
    res = invoke(["status", name, "--root", str(tree)], env=spies.env(), code=1)
    assert spies.reached() == []
    lines = {ln.split(":", 1)[0].strip(): ln for ln in res.output.splitlines()[1:]}
    assert "not asked" in res.output.splitlines()[0]  # the units: systemd is not the tree's
    assert "not asked: --root" in lines["health"] and "200" not in lines["health"].split("(")[0]
    assert "not asked: --root" in lines["running"]
    assert lines["build"].strip() == "build:      image build not checked: Docker was not asked"


@pytest.mark.parametrize("name", ["i1", "g1"])
def test_commands_that_must_talk_to_the_engine_refuse_in_one_line(name, tree, spies, tmp_path):
    for argv in (
        ["canary", "record", name, "--out", str(tmp_path / "c.json")],
        ["bench", "run", name],
        ["fleet", "snapshot", name, "--out", str(tmp_path / "s.json")],
    ):
        res = invoke([*argv, "--root", str(tree)], env=spies.env(), code=2)
        [line] = res.output.strip().splitlines()
        assert line.startswith(f"Error: --root {tree} is not this host's /: the port its env"), line
    assert spies.reached() == []
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "s.json").exists()


def test_a_url_given_is_asked(tree, spies, listeners):
    """Told (--url), doctor asks the engine there: the listener is hit."""
    url = f"http://127.0.0.1:{listeners['i1'].port}"
    invoke(
        ["instance", "doctor", "i1", "--url", url, "--root", str(tree)],
        env=spies.env(),
        code=None,
    )
    assert listeners["i1"].hits and listeners["i1"].hits[0] == "GET /health"


def test_host_check_of_a_tree_says_not_asked_never_ready(tree, spies):
    res = invoke(["host", "check", "i1", "--root", str(tree), "--json"], env=spies.env(), code=0)
    assert spies.reached() == []
    found = {f["name"]: f for f in json.loads(res.output)["findings"]}
    for name in ("docker.engine", "port"):
        assert found[name]["status"] == "warn"
        assert found[name]["message"].startswith(f"not asked: --root {tree} ")
    assert found["docker.image"]["message"] == "image build not checked: Docker was not asked"
    res = invoke(["host", "check", "i1", "--root", str(tree)], env=spies.env(), code=0)
    assert res.output.splitlines()[-1] == "host check: no blocker, 2 not asked (3 warning(s))"


# --- one record, both shapes -------------------------------------------------------------


def test_the_record_of_an_instance(template, listeners):
    rec = instance.read(template, "i1")
    layout = Layout(template)
    assert rec.shape == Shape("i1") and rec.node is None and not rec.group
    assert (rec.units, rec.containers) == (("gemma4-vllm@i1.service",), ("gemma4-vllm-i1",))
    assert (rec.unit, rec.container) == ("gemma4-vllm@i1.service", "gemma4-vllm-i1")
    assert rec.profile.name == "cpu-tiny-mtp" and rec.image == IMAGE
    assert rec.base_url == f"http://127.0.0.1:{listeners['i1'].port}"
    assert rec.api_key_path == layout.api_key_file("i1") and rec.api_key()
    assert rec.env_path == layout.env_file("i1") and rec.answers


def test_the_record_of_a_group_names_its_nodes_and_the_head_serves(template, listeners):
    rec = instance.read(template, "g1")
    layout = Layout(template)
    assert rec.group and rec.noun == "group"
    assert rec.node == Node(("head", "worker"), 1)
    assert rec.units == ("gemma4-vllm-head@g1.service", "gemma4-vllm-worker@g1.service")
    assert rec.containers == ("gemma4-vllm-g1-head", "gemma4-vllm-g1-worker")
    assert (rec.unit, rec.container) == ("gemma4-vllm-head@g1.service", "gemma4-vllm-g1-head")
    assert rec.profile.name == GROUP_PROFILE and rec.profile.multinode is not None
    assert rec.base_url == f"http://127.0.0.1:{listeners['g1'].port}"
    assert rec.api_key_path == layout.node_api_key_file("g1", "head") and rec.api_key()
    assert rec.answers


def test_a_worker_hosts_record_serves_no_api(tree):
    layout = Layout(tree)
    layout.node_args_file("g1", "head").unlink()
    rec = instance.read(tree, "g1")
    assert rec.units == ("gemma4-vllm-worker@g1.service",) and rec.node.rank == 1
    assert rec.api_key_path is None and rec.api_key() is None and not rec.answers


def test_a_groups_profile_is_its_kept_copy(tree):
    """The operator's own profile, kept beside the env file, is the one read (not a shipped
    name): cutover, doctor and canary record take the group's record."""
    layout = Layout(tree)
    text = (Path(profiles.__file__).parent / "data" / f"{GROUP_PROFILE}.toml").read_text()
    mine = text.replace(f'name = "{GROUP_PROFILE}"', 'name = "my-2node"')
    assert mine != text
    layout.profile_copy("g1").write_text(mine)
    env = envfile.read(layout.env_file("g1"))
    write_atomic(layout.env_file("g1"), env.with_value(envfile.PROFILE_KEY, "my-2node"))
    assert instance.read(tree, "g1").profile.name == "my-2node"


# --- doctor and fleet status name the group's head ------------------------------------------


class _Container:
    def __init__(self, image: str) -> None:
        self.status = "running"
        self.attrs = {"Image": "sha256:" + "ab" * 32, "Config": {"Image": image, "Labels": {}}}


class _Image:
    def __init__(self) -> None:
        self.id = "sha256:" + "ab" * 32
        self.labels = {"io.gemma4-appliance.variant": "cpu"}
        self.tags = [IMAGE]


class StubDocker:
    """A Docker SDK client that knows one running container per name asked for."""

    def __init__(self, running: dict[str, str]) -> None:
        self.asked: list[str] = []
        stub = self

        class Containers:
            def get(self, name):
                stub.asked.append(name)
                if name not in running:
                    raise docker.errors.NotFound(name)
                return _Container(running[name])

        class Images:
            def get(self, ref):
                return _Image()

        self.containers, self.images = Containers(), Images()


def test_doctor_on_a_group_names_the_head_unit_and_container(template):
    stub = StubDocker({"gemma4-vllm-g1-head": IMAGE})
    report = doctor.run(
        "http://127.0.0.1:9", instance="g1", root=template, docker_client=stub, ask_engine=False
    )
    checks = {c.name: c for c in report.checks}
    assert checks["instance.unit"].summary == "unit gemma4-vllm-head@.service installed"
    assert checks["instance.container"].summary == f"gemma4-vllm-g1-head runs {IMAGE}"
    assert stub.asked == ["gemma4-vllm-g1-head"]
    assert checks["engine.reachable"].status == "warn"  # not asked, never ok


def test_fleet_status_of_a_group_reads_the_heads_container(template, monkeypatch):
    stub = StubDocker({"gemma4-vllm-g1-head": IMAGE, "gemma4-vllm-g1": "wrong:one"})
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/the-trees-docker.sock")
    monkeypatch.setattr(docker, "from_env", lambda *a, **k: stub)
    for var in ("APPLIANCE_SYSTEMD_PREFIX", "APPLIANCE_ROOT"):
        monkeypatch.delenv(var, raising=False)
    st = hosts.host_status("g1", template)
    assert st.container == "gemma4-vllm-g1-head" and st.container_image == IMAGE
    assert "gemma4-vllm-g1" not in stub.asked and stub.asked
    assert st.unit_state == "not asked" and st.healthy is None
    assert any("its instance" in w for w in st.not_asked)


def test_one_place_names_a_serving_unit_or_container():
    """Issue 53: only host/layout.py (Shape, and the drop-in paths beside the units) turns a
    NAME into a unit or container name; every other module reads them from the Shape or the
    record."""
    package = Path(instance.__file__).resolve().parents[1]
    calls = ("container_name(", "node_container(", "unit_name(", "node_unit(")
    allowed = {package / "host" / "names.py", package / "host" / "layout.py"}
    found = [
        f"{path.relative_to(package.parent)}:{n}"
        for path in sorted(package.rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(c in line for c in calls) and not line.lstrip().startswith(("#", "def "))
    ]
    assert found == []


def test_a_gpu_profiles_gpus_are_not_asked_for_a_tree(tree, spies):
    # Its exit is the tree's disk for the weights' (a finding of the tree's files), not the GPUs.
    res = invoke(["host", "check", "x1", "--root", str(tree), "--json"], env=spies.env(), code=None)
    found = {f["name"]: f for f in json.loads(res.output)["findings"]}
    assert found["gpu"]["status"] == "warn" and found["gpu"]["message"].startswith("not asked")
    argv = ["instance", "doctor", "x1", "--root", str(tree), "--json"]
    res = invoke(argv, env=spies.env(), code=1)  # its models are not in the tree
    checks = {c["name"]: c for c in json.loads(res.output)["checks"]}
    assert checks["host.gpus"]["status"] == "warn"
    assert checks["host.gpus"]["summary"].startswith(f"not asked: --root {tree} ")
    assert spies.reached() == []
