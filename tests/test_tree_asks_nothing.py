"""A test tree asks nothing of the host (issue 53 §1, §3), and one record names what serves a
NAME, whatever its shape.

Every command that takes ``--root`` (found by walking the click tree, not a hand list) runs
against a tree holding a single-node instance ``i1``, a one-host group ``g1`` (``--role both``)
and a GPU-profile instance ``x1``, in a child Python under strace: every ``execve`` of
``systemctl``, ``journalctl``, ``docker`` or ``nvidia-smi``, every ``connect`` to Docker's or
systemd's socket or to a port the tree's env files name, and every ``bind`` of such a port is
in strace's record, whether it succeeded or not. A server on ``127.0.0.1`` at each of those
ports answers 200 to anything (an unrelated server there was once reported as the instance's
``health: 200``). None of it may be reached, and nothing may be reported healthy; what was not
asked is said ("not asked"). The host's real tools, Docker engine and ports are there: a
command that asks them is seen asking. strace also refuses each such call (``-e inject``: the
only thing here that is not real, so that a command that would ask cannot change this host).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import pytest
from plugins.docker_engine import SOCKET, machine_lock

import docker
from appliance import profiles
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
MTP_IMAGE = "gemma4-vllm:0.32.0-mtp-cpu"  # the suite's real CPU image (docker tests)


# --- the listeners and the tree ------------------------------------------------------------


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


def _unnamed() -> dict[str, str]:
    """This process's environment without what would name a tree's systemd, Docker or engine."""
    env = {k: v for k, v in os.environ.items() if k not in TOLD}
    return {**env, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def template(tmp_path_factory, listeners) -> Path:
    """The tree: ``i1`` (cpu-tiny-mtp), ``g1`` (a one-host CPU group) and ``x1`` (a GPU
    profile), each on the port its listener holds, installed through the CLI."""
    root = tmp_path_factory.mktemp("tree")
    cases = []
    for argv in (
        ["i1", "--profile", "cpu-tiny-mtp", "--port", str(listeners["i1"].port)],
        ["g1", "--profile", GROUP_PROFILE, "--role", "both", "--port", str(listeners["g1"].port)],
        ["x1", "--profile", GPU_PROFILE, "--port", str(listeners["x1"].port)],
    ):
        image = "gemma4-vllm:0.32.0" if argv[0] == "x1" else IMAGE  # the profile's build
        cases.append(["instance", "install", *argv, "--image", image, "--root", str(root)])
    for done in trace(cases, listeners):
        assert done.code == 0 and done.reached == [], done
    return root


# --- strace: what a command asked of the host ----------------------------------------------

MARK = "/nonexistent/tree-asks-nothing/"
# The child: each case's tree copied, a mark (an access(2) of a path that cannot exist: strace's
# record is split at it), then the command through click in this one Python (one start, not one
# per case).
_DRIVER = """
import json, os, shutil, sys
from click.testing import CliRunner
from appliance.cli import cli
cases = json.load(open(sys.argv[1]))
done = []
for i, case in enumerate(cases):
    if case["copy"]:
        shutil.copytree(case["copy"][0], case["copy"][1], symlinks=True)
    os.access(f"{sys.argv[3]}{i}", os.F_OK)
    res = CliRunner().invoke(cli, case["argv"], prog_name="appliance")
    done.append({"code": res.exit_code, "output": res.output})
os.access(f"{sys.argv[3]}end", os.F_OK)
json.dump(done, open(sys.argv[2], "w"))
"""
_MARKED = re.compile(r'access\w*\((?:AT_FDCWD, )?"' + re.escape(MARK) + r'(\w+)"')
_EXECVE = re.compile(r'execve\("([^"]+)"')
_UNIX = re.compile(r'connect\(\d+, \{sa_family=AF_UNIX, sun_path="([^"]+)"')
_PORT = re.compile(r"(connect|bind)\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\)")
_HOST_SOCKETS = ("docker", "containerd", "systemd", "dbus")


@dataclass
class Done:
    """One command run under strace: its exit, its output, what it asked of the host."""

    argv: list[str]
    code: int
    output: str
    reached: list[str]


def trace(
    cases: list[list[str]],
    listeners: dict,
    copies: list[tuple[Path, Path] | None] | None = None,
    *,
    refuse: bool = True,
    told: dict[str, str] | None = None,
) -> list[Done]:
    """Run each ``appliance`` argv of ``cases`` (after copying ``copies[i]``: a tree of its
    own) in one child Python under strace, with none of :data:`TOLD` set but ``told``;
    ``refuse``: strace fails every execve after the child's own and every connect, so that
    nothing asked can reach this host."""
    ports = {s.port for s in listeners.values()}
    for server in listeners.values():
        server.hits.clear()
    work = Path(os.environ.get("TMPDIR", "/tmp"))
    record = work / f"tree-asks-nothing-{os.getpid()}-{threading.get_ident()}"
    copies = copies or [None] * len(cases)
    spec = [
        {"argv": a, "copy": [str(c[0]), str(c[1])] if c else None}
        for a, c in zip(cases, copies, strict=True)
    ]
    Path(f"{record}.cases").write_text(json.dumps(spec))
    argv = ["strace", "-f", "-qq", "--seccomp-bpf", "-o", f"{record}.strace"]
    argv += ["-e", "trace=execve,connect,bind,access,faccessat,faccessat2"]
    if refuse:
        argv += ["-e", "inject=execve:error=EPERM:when=2+"]
        argv += ["-e", "inject=connect:error=ECONNREFUSED"]
    argv += [sys.executable, "-c", _DRIVER, f"{record}.cases", f"{record}.done", MARK]
    try:
        env = {**_unnamed(), **(told or {})}
        subprocess.run(argv, env=env, check=True, timeout=600, cwd=work)
        results = json.loads(Path(f"{record}.done").read_text())
        lines = Path(f"{record}.strace").read_text().splitlines()
    finally:
        for suffix in (".cases", ".done", ".strace"):
            Path(f"{record}{suffix}").unlink(missing_ok=True)
    reached: list[list[str]] = [[] for _ in cases]
    case = None
    for line in lines:
        if m := _MARKED.search(line):
            case = None if m[1] == "end" else int(m[1])
            continue
        if case is None:
            continue
        if (m := _EXECVE.search(line)) and Path(m[1]).name in SPIED:
            reached[case].append(f"ran {Path(m[1]).name}")
        elif (m := _UNIX.search(line)) and any(h in m[1] for h in _HOST_SOCKETS):
            reached[case].append(f"connect {m[1]}")
        elif (m := _PORT.search(line)) and int(m[2]) in ports:
            reached[case].append(f"{m[1]} port {m[2]}")
    hits = [f"port {s.port}: {h}" for s in listeners.values() for h in s.hits]
    if hits:  # a request that got through (not refused): the listeners cannot tell which case
        reached = [[*r, *hits] for r in reached]
    return [
        Done(a, r["code"], r["output"], sorted(set(x)))
        for a, r, x in zip(cases, results, reached, strict=True)
    ]


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
NAMES = ("i1", "g1", "x1")


@pytest.fixture(scope="module")
def every_command(template, listeners, tmp_path_factory) -> dict[tuple[str, str], Done]:
    """Each command that takes --root, for each NAME, on a copy of the tree of its own
    (uninstall, install and cutover may write), all in one traced child."""
    work = tmp_path_factory.mktemp("cases")
    keys, cases, copies = [], [], []
    for command in ROOT_COMMANDS:
        for name in NAMES:
            case = work / f"{command.replace(' ', '-')}-{name}"
            (case / "scratch").mkdir(parents=True)
            argv = [*command.split(), *_argv(command, name, case / "scratch")]
            keys.append((command, name))
            cases.append([*argv, "--root", str(case / "root")])
            copies.append((template, case / "root"))
    return dict(zip(keys, trace(cases, listeners, copies), strict=True))


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


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("command", ROOT_COMMANDS)
def test_a_command_under_a_tree_asks_nothing_of_the_host(command, name, every_command):
    done = every_command[(command, name)]
    assert done.reached == [], f"{' '.join(done.argv)} reached the host:\n{done.output}"
    assert "Traceback" not in done.output, done.output
    assert "health:     200" not in done.output and '"healthy": true' not in done.output


def test_the_trace_sees_a_command_that_asks(template, listeners, tmp_path):
    """The same trace on the same tree, the tree's systemd and Docker named (as for a machine
    run from this host), records the asking, refused: the test above can fail. The prefix is
    ``systemctl`` itself, so that the program run is the one the trace looks for."""
    tree = tmp_path / "root"
    told = {"APPLIANCE_SYSTEMD_PREFIX": "systemctl", "DOCKER_HOST": f"unix://{SOCKET}"}
    cases = [["status", "i1", "--root", str(tree)], ["image", "list", "--root", str(tree)]]
    status, images = trace(cases, listeners, [(template, tree), None], told=told)
    assert status.reached == ["ran systemctl"], status
    assert images.reached == [f"connect {SOCKET}"], images


# --- what the commands say instead -----------------------------------------------------------


@pytest.fixture
def tree(template, tmp_path) -> tuple[Path, tuple[Path, Path]]:
    """A path for a copy of the tree, and the copy to make in the traced child."""
    root = tmp_path / "root"
    return root, (template, root)


@pytest.mark.parametrize("name", ["i1", "g1"])
def test_status_says_what_it_did_not_ask_and_is_not_serving(name, tree, listeners):
    root, copy = tree
    [done] = trace([["status", name, "--root", str(root)]], listeners, [copy])
    assert done.code == 1 and done.reached == [], done
    lines = {ln.split(":", 1)[0].strip(): ln for ln in done.output.splitlines()[1:]}
    assert "not asked" in done.output.splitlines()[0]  # the units: systemd is not the tree's
    assert "not asked: --root" in lines["health"] and "200" not in lines["health"].split("(")[0]
    assert "not asked: --root" in lines["running"]
    assert lines["build"].strip() == "build:      image build not checked: Docker was not asked"


@pytest.mark.parametrize("name", ["i1", "g1"])
def test_commands_that_must_talk_to_the_engine_refuse_in_one_line(name, tree, listeners, tmp_path):
    root, copy = tree
    cases = [
        ["canary", "record", name, "--out", str(tmp_path / "c.json"), "--root", str(root)],
        ["bench", "run", name, "--root", str(root)],
        ["fleet", "snapshot", name, "--out", str(tmp_path / "s.json"), "--root", str(root)],
    ]
    for done in trace(cases, listeners, [copy, None, None]):
        assert done.code == 2 and done.reached == [], done
        [line] = done.output.strip().splitlines()
        assert line.startswith(f"Error: --root {root} is not this host's /: the port its env"), line
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "s.json").exists()


def test_a_url_given_is_asked(tree, listeners):
    """Told (--url), doctor asks the engine there: the listener is hit (nothing refused)."""
    root, copy = tree
    url = f"http://127.0.0.1:{listeners['i1'].port}"
    argv = ["instance", "doctor", "i1", "--url", url, "--root", str(root)]
    [done] = trace([argv], listeners, [copy], refuse=False)
    assert f"connect port {listeners['i1'].port}" in done.reached, done
    assert any(r.endswith("GET /health") for r in done.reached), done


def test_host_check_of_a_tree_says_not_asked_never_ready(tree, listeners):
    root, copy = tree
    cases = [
        ["host", "check", "i1", "--root", str(root), "--json"],
        ["host", "check", "i1", "--root", str(root)],
    ]
    as_json, plain = trace(cases, listeners, [copy, None])
    assert as_json.code == 0 and as_json.reached == [], as_json
    found = {f["name"]: f for f in json.loads(as_json.output)["findings"]}
    for name in ("docker.engine", "port"):
        assert found[name]["status"] == "warn"
        assert found[name]["message"].startswith(f"not asked: --root {root} ")
    assert found["docker.image"]["message"] == "image build not checked: Docker was not asked"
    assert plain.code == 0 and plain.reached == [], plain
    assert plain.output.splitlines()[-1] == "host check: no blocker, 2 not asked (3 warning(s))"


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


def test_a_worker_hosts_record_serves_no_api(template, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(template, root, symlinks=True)
    layout = Layout(root)
    layout.node_args_file("g1", "head").unlink()
    rec = instance.read(root, "g1")
    assert rec.units == ("gemma4-vllm-worker@g1.service",) and rec.node.rank == 1
    assert rec.api_key_path is None and rec.api_key() is None and not rec.answers


def test_a_groups_profile_is_its_kept_copy(template, tmp_path):
    """The operator's own profile, kept beside the env file, is the one read (not a shipped
    name): cutover, doctor and canary record take the group's record."""
    root = tmp_path / "root"
    shutil.copytree(template, root, symlinks=True)
    layout = Layout(root)
    text = (Path(profiles.__file__).parent / "data" / f"{GROUP_PROFILE}.toml").read_text()
    mine = text.replace(f'name = "{GROUP_PROFILE}"', 'name = "my-2node"')
    assert mine != text
    layout.profile_copy("g1").write_text(mine)
    env = envfile.read(layout.env_file("g1"))
    write_atomic(layout.env_file("g1"), env.with_value(envfile.PROFILE_KEY, "my-2node"))
    assert instance.read(root, "g1").profile.name == "my-2node"


# --- doctor and fleet status name the group's head, on the real Docker engine ---------------


@pytest.fixture
def head_running(template, tmp_path, docker_engine, appliance_images):
    """A copy of the tree whose group ``g1`` runs the suite's MTP image, and on the real
    engine a container of that name (``sleep``: nothing of the engine needed) beside a decoy
    under the single-node name ``gemma4-vllm-g1``, started from the image's ID: a command that
    read the wrong container would say the ID."""
    appliance_images["cpu-mtp"]
    root = tmp_path / "root"
    shutil.copytree(template, root, symlinks=True)
    env_path = Layout(root).env_file("g1")
    write_atomic(env_path, envfile.read(env_path).with_value(envfile.IMAGE_KEY, MTP_IMAGE))
    image = docker_engine.images.get(MTP_IMAGE)
    names = ("gemma4-vllm-g1-head", "gemma4-vllm-g1")
    with machine_lock("tree-asks-nothing-g1"):
        for name, ref in zip(names, (MTP_IMAGE, image.id), strict=True):
            _remove(docker_engine, name)
            docker_engine.containers.run(
                ref, ["600"], entrypoint=["sleep"], name=name, detach=True, network_mode="none"
            )
        try:
            yield root
        finally:
            for name in names:
                _remove(docker_engine, name)


def _remove(client, name: str) -> None:
    try:
        client.containers.get(name).remove(force=True)
    except docker.errors.NotFound:
        pass


@pytest.mark.docker
def test_doctor_on_a_group_names_the_head_unit_and_container(head_running, listeners):
    argv = ["instance", "doctor", "g1", "--root", str(head_running), "--json"]
    [done] = trace([argv], listeners, refuse=False, told={"DOCKER_HOST": f"unix://{SOCKET}"})
    checks = {c["name"]: c for c in json.loads(done.output)["checks"]}
    assert checks["instance.unit"]["summary"] == "unit gemma4-vllm-head@.service installed"
    assert checks["instance.container"]["summary"] == f"gemma4-vllm-g1-head runs {MTP_IMAGE}"
    assert checks["engine.reachable"]["status"] == "warn"  # not asked, never ok
    # The tree's Docker was named and asked; its systemd and port were not.
    assert done.reached == [f"connect {SOCKET}"], done


@pytest.mark.docker
def test_fleet_status_of_a_group_reads_the_heads_container(head_running, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{SOCKET}")  # the tree's Docker: this host's
    for var in ("APPLIANCE_SYSTEMD_PREFIX", "APPLIANCE_ROOT"):
        monkeypatch.delenv(var, raising=False)
    st = hosts.host_status("g1", head_running)
    assert st.container == "gemma4-vllm-g1-head" and st.container_image == MTP_IMAGE
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


def test_a_gpu_profiles_gpus_are_not_asked_for_a_tree(tree, listeners):
    root, copy = tree
    cases = [
        ["host", "check", "x1", "--root", str(root), "--json"],
        ["instance", "doctor", "x1", "--root", str(root), "--json"],
    ]
    check, doc = trace(cases, listeners, [copy, None])
    assert check.reached == [] and doc.reached == [], (check, doc)
    # Its exit is the tree's disk for the weights' (a finding of the tree's files), not the GPUs.
    found = {f["name"]: f for f in json.loads(check.output)["findings"]}
    assert found["gpu"]["status"] == "warn" and found["gpu"]["message"].startswith("not asked")
    assert doc.code == 1  # its models are not in the tree
    checks = {c["name"]: c for c in json.loads(doc.output)["checks"]}
    assert checks["host.gpus"]["status"] == "warn"
    assert checks["host.gpus"]["summary"].startswith(f"not asked: --root {root} ")
