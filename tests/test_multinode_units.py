"""The head and worker units of a multi-node group share the instance unit's hardening block,
timings and start-limit arithmetic (review N6), checked on the rendered files
with the real ``systemd-analyze``. That they serve, cut over and roll back under these settings
is tests/test_multinode_systemd.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance import multinode, profiles, units
from appliance.host.layout import Layout, Node
from appliance.host.names import ROLES, node_unit
from appliance.units import timing

CPU_PAIR = "cpu-tiny-mtp-2node"
SHIPPED = ["spark2-31b-nvfp4-mtp", CPU_PAIR]


def _root(tmp_path: Path, profile: str) -> Path:
    """A root with the host's unit files (so analyze resolves docker.service) and the group."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    cpu = profiles.get(profile).uses_devmodel
    opts = units.Options(image="gemma4-vllm:0.32.0-mtp", model_dir="/srv/tiny" if cpu else None)
    multinode.install(profile, "grp", Node(roles=("head", "worker")), root=root,
                      options=opts)  # fmt: skip
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
