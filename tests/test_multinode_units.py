"""The head and worker units of a multi-node group share the instance unit's hardening block,
timings and start-limit arithmetic (review N6), checked on the rendered files
with the real ``systemd-analyze``. That they serve, cut over and roll back under these settings
is tests/test_multinode_systemd.py."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from appliance import multinode, profiles, units
from appliance.host.layout import Layout, Node
from appliance.host.names import ROLES, node_unit
from appliance.instance import installer
from appliance.serve import argsfile, health
from appliance.units import timing

CPU_PAIR = "cpu-tiny-mtp-2node"
SHIPPED = ["spark2-31b-nvfp4-mtp", CPU_PAIR]


def _root(tmp_path: Path, profile: str) -> Path:
    """A root with the host's unit files (so analyze resolves docker.service) and the group."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    cpu = profiles.get(profile).uses_devmodel
    opts = units.Options(image="gemma4-vllm:0.32.0-mtp", model_dir="/srv/tiny" if cpu else None)
    node = Node(roles=("head", "worker"))
    installer.install(profile, "grp", node=node, root=root, options=opts)
    return root


def _settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def _exposure(root: Path, unit: str) -> float:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed (scripts/setup-system.sh)")
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--no-pager", unit],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m, proc.stdout + proc.stderr
    return float(m.group(1))


@pytest.mark.parametrize("profile", SHIPPED)
def test_head_worker_and_probe_units_are_hardened_like_an_instance(tmp_path, profile):
    root = _root(tmp_path, profile)
    names = [node_unit("grp", r) for r in ROLES]
    names.append("gemma4-vllm-probe@grp.service")
    scores = {n: _exposure(root, n) for n in names}
    print(f"\nsystemd-analyze security --offline=yes: {scores}")
    assert all(score <= 2.5 for score in scores.values()), scores


def _hardening(text: str) -> list[str]:
    """The unit's least-privilege settings, in order (the block after ``SyslogIdentifier=``)."""
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("SyslogIdentifier="))
    end = lines.index("[Install]") if "[Install]" in lines else None
    return lines[start + 1 : end]


def test_the_hardening_block_is_the_instance_units_own(tmp_path):
    """One block, not a copy that drifts: head and worker carry the instance unit's settings."""
    root = _root(tmp_path, CPU_PAIR)
    units.install("cpu-tiny-mtp", "x", root=root)
    instance = _hardening(Layout(root).unit_template.read_text())
    assert "CapabilityBoundingSet=" in instance and "IPAddressAllow=localhost" in instance
    for name in (multinode.HEAD_TEMPLATE, multinode.WORKER_TEMPLATE, multinode.PROBE_SERVICE):
        text = (root / "etc/systemd/system" / name).read_text()
        assert _hardening(text) == instance, name


@pytest.mark.parametrize("template", [multinode.HEAD_TEMPLATE, multinode.WORKER_TEMPLATE])
def test_a_slowly_failing_node_trips_the_start_limit(tmp_path, template):
    """systemd counts starts in a fixed window: the window must hold ``burst`` starts that each
    hang to TimeoutStartSec and wait RestartSec, or a slowly failing head reloads forever (the
    old head: 5 starts in 7200 s, each up to 1800 s)."""
    root = _root(tmp_path, CPU_PAIR)
    s = _settings((root / "etc/systemd/system" / template).read_text())
    burst = int(s["StartLimitBurst"][0])
    window = int(s["StartLimitIntervalSec"][0])
    start, restart = int(s["TimeoutStartSec"][0]), int(s["RestartSec"][0])
    print(f"\n{template}: {burst} starts x ({start} + {restart}) s in a {window} s window")
    assert burst * (start + restart) <= window
    t = timing.unit_timing()
    assert (burst, window, start, restart) == (
        t.start_limit_burst, t.start_limit_interval_s, t.start_timeout_s, t.restart_sec
    )  # fmt: skip
    assert int(s["TimeoutStopSec"][0]) == t.stop_timeout_s


def test_a_worker_may_reach_its_heads_rendezvous_and_waits_for_it(tmp_path):
    """Review N6 (the real systemd run: tests/test_multinode_systemd.py): the worker's serve
    program waits for the head's rendezvous before its container starts, so a head whose host
    is down costs the worker no start. The unit reaches only loopback but through this drop-in;
    systemd reads it (verify) and the real listener below ends the wait."""
    prof = profiles.get("spark2-31b-nvfp4-mtp")
    root = _root(tmp_path, prof.name)
    dropin = Layout(root).rendezvous_dropin("grp")
    assert _settings(dropin.read_text())["IPAddressAllow"] == [prof.multinode.master_addr]
    worker = argsfile.read(Layout(root).node_args_file("grp", "worker"))
    head = argsfile.read(Layout(root).node_args_file("grp", "head"))
    assert worker.rendezvous() == (prof.multinode.master_addr, prof.multinode.master_port)
    assert head.rendezvous() is None
    verify = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", node_unit("grp", "worker")],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert "40-rendezvous.conf" not in verify.stdout + verify.stderr, verify.stderr

    notes: list[str] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    heard = threading.Event()

    def note(line: str) -> None:
        notes.append(line)
        listener.listen()  # the head comes back once the worker said it waits
        heard.set()

    try:
        health.wait_listening("127.0.0.1", port, note)
    finally:
        listener.close()
    assert heard.is_set()
    assert notes[0].startswith(f"waiting for the head's rendezvous at 127.0.0.1:{port} (")


def test_a_waiting_worker_says_so_on_its_unit_status_line(tmp_path, monkeypatch):
    """What the cutover's worker gate reads back (``StatusText``): the serve program's
    ``STATUS=`` datagram, sent to the socket systemd names in ``NOTIFY_SOCKET``; here a real
    datagram socket stands in for systemd's (the unit itself runs under real systemd in the
    fleet's group tests)."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        health.notify_status(health.waiting_for_head("gemma4-vllm:0.32.0-mtp", "10.0.0.1", 29500))
        sock.settimeout(5)
        said = sock.recv(4096).decode()
    assert said == (
        "STATUS=gemma4-vllm:0.32.0-mtp checked; waiting for the head's rendezvous at 10.0.0.1:29500"
    )
    assert health.image_waiting_for_head(said.removeprefix("STATUS=")) == "gemma4-vllm:0.32.0-mtp"
    assert (
        health.image_waiting_for_head("gemma4-vllm:0.32.0-mtp: joined the head's rendezvous")
        is None
    )
    monkeypatch.delenv("NOTIFY_SOCKET")
    health.notify_status("nothing listens")  # outside a unit: nothing sent, nothing raised
