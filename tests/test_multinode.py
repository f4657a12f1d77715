"""Multi-node profiles, their validation and the head/worker units, fast.

The real pair under systemd is tests/test_multinode_systemd.py."""

from __future__ import annotations

import dataclasses
import http.server
import itertools
import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from appliance import multinode, profiles, units
from appliance.errors import UsageError
from appliance.host import envfile
from appliance.host.layout import Layout, Node
from appliance.host.names import ROLES, node_unit
from appliance.instance import installer
from appliance.profiles import validate as pv
from appliance.serve import argsfile

MULTINODE = ["spark2-31b-nvfp4-mtp", "l4x4x2-31b-mtp", "cpu-tiny-mtp-2node"]
SINGLE = sorted(n for n, p in profiles.all_profiles().items() if p.multinode is None)


def codes(prof) -> set[str]:
    return {f.code for f in pv.errors(pv.check(prof))}


def with_mn(name: str, **kw) -> profiles.Profile:
    prof = profiles.get(name)
    assert prof.multinode is not None
    return dataclasses.replace(prof, multinode=dataclasses.replace(prof.multinode, **kw))


@pytest.mark.parametrize("name", MULTINODE)
def test_shipped_multinode_profiles_are_valid(name):
    found = pv.check(profiles.get(name))
    assert pv.errors(found) == []
    # The one warning a GPU MTP profile has on every vLLM: a batching defect closed upstream
    # with no known release (appliance/profiles/defects.toml kv-auto-mtp-batching).
    assert {f.code for f in found} <= {"kv-auto-mtp-batching"}


def test_the_two_host_gpu_profile_has_the_shape_its_cpu_pair_starts_in():
    # The multi-node tier starts cpu-tiny-mtp-2node for real (tests/test_multinode_systemd.py);
    # it stands for the GPU groups because the shape is theirs: tensor parallel across the
    # nodes (one rank per device), no pipeline parallelism, Gemma 4 MTP.
    def shape(prof):
        per_node = 1 if prof.hardware.device == "cpu" else prof.hardware.gpus
        across = prof.tensor_parallel_size == prof.multinode.nodes * per_node
        return (across, prof.pipeline_parallel_size, prof.mtp)

    cpu = profiles.get("cpu-tiny-mtp-2node")
    assert shape(cpu) == (True, 1, True)
    for name in ("l4x4x2-31b-mtp", "spark2-31b-nvfp4-mtp"):
        assert shape(profiles.get(name)) == shape(cpu), name


def test_single_node_profiles_have_no_multinode_and_their_args_are_unchanged():
    for name in SINGLE:
        args = profiles.get(name).serve_args(devmodel="/m")
        assert "--pipeline-parallel-size" not in args and "--nnodes" not in args


def test_tp_times_pp_must_equal_the_devices_across_nodes():
    spark = profiles.get("spark2-31b-nvfp4-mtp")  # 2 nodes x 1 GPU, TP 2
    assert "multinode-parallel" in codes(dataclasses.replace(spark, tensor_parallel_size=1))
    l4 = profiles.get("l4x4x2-31b-mtp")  # 2 nodes x 4 GPUs, TP 8
    assert "--pipeline-parallel-size" not in l4.serve_args()
    bad = dataclasses.replace(l4, tensor_parallel_size=4)
    (finding,) = [f for f in pv.check(bad) if f.code == "multinode-parallel"]
    assert "4 x 1 = 4" in finding.message and "2 nodes x 4 GPU(s) = 8" in finding.message
    # TP 4 x PP 2 fills the 8 GPUs, so it is no parallelism error; with MTP it is the defect.
    pp = dataclasses.replace(l4, tensor_parallel_size=4, pipeline_parallel_size=2)
    assert "--pipeline-parallel-size" in pp.serve_args()
    assert codes(pp) == {"mtp-pipeline-parallel"}
    assert codes(dataclasses.replace(pp, speculative=None)) == set()
    cpu = profiles.get("cpu-tiny-mtp-2node")
    assert "multinode-parallel" in codes(dataclasses.replace(cpu, tensor_parallel_size=4))
    # A single-host CPU profile with TP 2 is still refused (the old rule, unchanged).
    assert "tensor-parallel" in codes(dataclasses.replace(cpu, multinode=None))


@pytest.mark.parametrize(
    ("name", "addr", "why"),
    [
        ("spark2-31b-nvfp4-mtp", "0.0.0.0", "every address"),
        ("spark2-31b-nvfp4-mtp", "8.8.8.8", "public address"),
        ("spark2-31b-nvfp4-mtp", "127.0.0.1", "loopback"),
        ("spark2-31b-nvfp4-mtp", "spark-a.example.com", "not an IP address"),
        ("cpu-tiny-mtp-2node", "10.0.0.1", "one host"),
    ],
)
def test_the_rendezvous_address_is_on_the_cluster_network_only(name, addr, why):
    found = [f for f in pv.check(with_mn(name, master_addr=addr)) if f.code == "multinode-master"]
    assert found and why in found[0].message


def test_the_interconnect_interfaces_must_be_named():
    found = pv.check(with_mn("spark2-31b-nvfp4-mtp", nccl_socket_ifname=""))
    assert any("nccl_socket_ifname is not set" in f.message for f in found)
    found = pv.check(with_mn("l4x4x2-31b-mtp", gloo_socket_ifname="lo"))
    assert any(f.code == "multinode-interface" and "loopback" in f.message for f in found)
    found = pv.check(with_mn("l4x4x2-31b-mtp", gloo_socket_ifname="eth0; rm"))
    assert "multinode-interface" in {f.code for f in found}
    assert "multinode-interface" in codes(with_mn("cpu-tiny-mtp-2node", gloo_socket_ifname=""))


def test_a_one_host_cpu_group_left_to_bind_threads_by_local_rank_is_warned():
    prof = profiles.get("cpu-tiny-mtp-2node")
    env = {k: v for k, v in prof.env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    for unbound in (env, {**env, "VLLM_CPU_OMP_THREADS_BIND": "auto"}):
        found = pv.check(dataclasses.replace(prof, env=unbound))
        [f] = [f for f in found if f.code == "multinode-cpu-threads"]
        assert f.level == "warning" and "same core" in f.message


def test_multinode_table_rejects_unknown_fields():
    data = {
        "name": "x",
        "description": "d",
        "model": "m",
        "served_model_name": "s",
        "multinode": {"nodes": 2, "master_address": "10.0.0.1"},
    }
    with pytest.raises(UsageError, match=r"\[multinode\].*master_address"):
        profiles.from_dict(data)


# --- the units --------------------------------------------------------------------------------


def _install(root: Path, name: str, node: Node, **kw) -> None:
    opts = units.Options(image="gemma4-vllm:0.32.0-mtp", **kw)
    if profiles.get(name).uses_devmodel:
        opts = dataclasses.replace(opts, model_dir="/srv/tiny")
    installer.install(name, "grp", node=node, root=root, options=opts)


def _args(root: Path, role: str) -> argsfile.ServeArgs:
    return argsfile.read(Layout(root).node_args_file("grp", role))


def test_head_and_worker_args_differ_only_in_rank_and_headless(tmp_path):
    _install(tmp_path, "spark2-31b-nvfp4-mtp", Node(roles=("head", "worker")))
    head, worker = _args(tmp_path, "head").serve, _args(tmp_path, "worker").serve
    assert head[head.index("--node-rank") + 1] == "0"
    assert worker[worker.index("--node-rank") + 1] == "1"
    assert worker[-1] == "--headless" and "--headless" not in head
    for args in (head, worker):
        assert args[args.index("--nnodes") + 1] == "2"
        assert args[args.index("--master-addr") + 1] == "192.168.100.10"
    docker = _args(tmp_path, "head").docker
    assert "NCCL_SOCKET_IFNAME=enp1s0f0np0" in docker
    assert "GLOO_SOCKET_IFNAME=enp1s0f0np0" in docker
    # One env file, one VLLM_IMAGE, for both units.
    env = envfile.read(Layout(tmp_path).env_file("grp"))
    assert env.get("VLLM_IMAGE") == "gemma4-vllm:0.32.0-mtp"
    for name in (multinode.HEAD_TEMPLATE, multinode.WORKER_TEMPLATE):
        unit = (tmp_path / "etc/systemd/system" / name).read_text()
        assert "EnvironmentFile=/etc/gemma4-vllm/%i.env" in unit


def test_the_one_host_cpu_pair_keeps_the_instance_hardening(tmp_path):
    """The CPU pair meets through the host's IPC and one /tmp, hardened as an instance is (the
    systemd tier shows it generating so: tests/test_multinode_systemd.py)."""
    _install(tmp_path, "cpu-tiny-mtp-2node", Node(roles=("head", "worker")))
    for role in ("head", "worker"):
        docker = list(_args(tmp_path, role).docker)
        pairs = set(itertools.pairwise(docker))
        assert {("--cap-drop", "ALL"), ("--security-opt", "no-new-privileges")} <= pairs, role
        assert ("--ipc", "host") in pairs and "--init" in docker, role
        assert "--shm-size" not in docker, role  # a private IPC namespace's: --ipc host has none


def test_a_bad_rank_or_a_single_node_profile_renders_nothing(tmp_path):
    with pytest.raises(UsageError, match="rank 2"):
        _install(tmp_path, "spark2-31b-nvfp4-mtp", Node(roles=("worker",), rank=2))
    with pytest.raises(UsageError, match="no \\[multinode\\]"):
        _install(tmp_path, "l4x4-31b-mtp", Node())
    assert not any(tmp_path.rglob("*.env"))


def test_the_head_is_bound_to_a_local_worker_only(tmp_path):
    both, head_only = tmp_path / "both", tmp_path / "head"
    _install(both, "cpu-tiny-mtp-2node", Node(roles=("head", "worker")))
    _install(head_only, "cpu-tiny-mtp-2node", Node(roles=("head",)))
    dropin = Layout(both).node_dropin("grp", "head").read_text()
    assert "BindsTo=gemma4-vllm-worker@%i.service" in dropin
    assert "PartOf=gemma4-vllm-worker@%i.service" in dropin
    upholds = Layout(both).node_dropin("grp", "worker").read_text()
    assert "Upholds=gemma4-vllm-head@%i.service" in upholds
    assert not Layout(head_only).node_dropin("grp", "head").exists()
    head = Layout(head_only).node_template("head").read_text()
    # Across hosts: a start gate that generates, and a timer that generates through the head.
    assert "ExecStartPost=/usr/local/libexec/gemma4-vllm/serve %i-head wait-generates" in head
    assert "Restart=always" in head
    assert all(path.exists() for path in Layout(head_only).probe_units)


def _verify_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    return root


@pytest.mark.parametrize("name", MULTINODE)
def test_rendered_units_pass_systemd_analyze_verify_silently(tmp_path, name):
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed (scripts/setup-system.sh)")
    root = _verify_root(tmp_path)
    _install(root, name, Node(roles=("head", "worker")))
    names = [node_unit("grp", r) for r in ROLES]
    names += ["gemma4-vllm-probe@grp.service", "gemma4-vllm-probe@grp.timer"]
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *names],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


class _Head(http.server.BaseHTTPRequestHandler):
    """A head that answers /health 200 and a completion with ``code`` (500: a worker is gone)."""

    code = 200
    seen: ClassVar[list[tuple[str, str | None, dict]]] = []

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Head.seen.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(_Head.code)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_generation_gate_and_probe_send_one_completion_with_the_heads_key(tmp_path):
    """The head unit's ExecStartPost and the probe timer's service: the serve program asks the
    head for one completion of the served model with its key; 500 (a worker gone) fails."""
    _install(tmp_path, "cpu-tiny-mtp-2node", Node(roles=("head",)))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    key = Layout(tmp_path).node_api_key_file("grp", "head").read_text().strip()
    env = {
        **envfile.read(Layout(tmp_path).env_file("grp")).values,
        "VLLM_PORT": str(server.server_address[1]),
        "APPLIANCE_ROOT": str(tmp_path),
        "PATH": "/nonexistent",
    }
    program = str(tmp_path / "usr/local/libexec/gemma4-vllm/serve")
    try:
        for code, rc in ((200, 0), (500, 1)):
            _Head.code = code
            for command in ("wait-generates", "probe"):
                proc = subprocess.run(
                    [program, "grp-head", command],
                    env=env, capture_output=True, text=True, timeout=60, check=False,
                )  # fmt: skip
                assert proc.returncode == rc, (command, proc.stderr)
                if rc:
                    assert "got 500: a " in proc.stderr and key not in proc.stderr
    finally:
        server.shutdown()
    path, auth, body = _Head.seen[0]
    assert (path, auth) == ("/v1/completions", f"Bearer {key}")
    assert body["model"] == _args(tmp_path, "head").served_model_name() and body["max_tokens"] == 2


def _non_loopback_address() -> str:
    """An IPv4 address of this host that is not loopback (the Docker bridge's at least)."""
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True)
    found = [
        a["local"]
        for link in json.loads(out.stdout)
        for a in link.get("addr_info", [])
        if not a["local"].startswith("127.")
    ]
    assert found, "this host has no IPv4 address but loopback"
    return found[0]


def test_the_heads_key_goes_to_loopback_only(tmp_path):
    """A head bound to another address would get its API key in clear
    HTTP; like the instance unit, whose probe reaches only loopback, the serve program refuses
    (exit 78, one line, no request) instead of sending it."""
    _install(tmp_path, "cpu-tiny-mtp-2node", Node(roles=("head",)))
    address = _non_loopback_address()
    server = http.server.ThreadingHTTPServer((address, 0), _Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    key = Layout(tmp_path).node_api_key_file("grp", "head").read_text().strip()
    env = {
        **envfile.read(Layout(tmp_path).env_file("grp")).values,
        "VLLM_HOST": address,
        "VLLM_PORT": str(server.server_address[1]),
        "APPLIANCE_ROOT": str(tmp_path),
        "PATH": "/nonexistent",
    }
    program = str(tmp_path / "usr/local/libexec/gemma4-vllm/serve")
    _Head.code = 200
    _Head.seen.clear()
    try:
        for command in ("wait-generates", "probe"):
            proc = subprocess.run(
                [program, "grp-head", command],
                env=env, capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert [auth for _, auth, _ in _Head.seen] == [], "the key went out in clear"
            assert proc.returncode == 78, (command, proc.stderr)
            assert f"in clear to {address}" in proc.stderr and key not in proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1
    finally:
        server.shutdown()


def test_cli_install_is_idempotent_and_names_the_first_unit(tmp_path, cli_run):

    base = ["instance", "install", "grp", "-p", "spark2-31b-nvfp4-mtp", "--root", str(tmp_path)]
    argv = [*base, "--role", "worker", "--rank", "1", "--image", "gemma4-vllm:0.32.0-mtp"]
    first = cli_run(argv)
    assert "systemctl enable --now gemma4-vllm-worker@grp.service" in first.output
    assert Layout(tmp_path).node_args_file("grp", "worker").exists()
    assert not Layout(tmp_path).node_args_file("grp", "head").exists()
    again = cli_run(argv)
    assert "next:" not in again.output
    assert not any(line.startswith("wrote") for line in again.output.splitlines())
    bad = cli_run([*base, "--role", "worker", "--rank", "5"], code=2)
    assert "rank 5" in bad.output
