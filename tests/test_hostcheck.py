"""``appliance host check`` and install's use of it (appliance/hostcheck).

The paths this machine can produce are checked for real: no nvidia-smi here (no GPU), a Docker
socket that does not answer, a 1 MiB tmpfs too small for the weights, a taken port, systemd
installed but not PID 1, key files of each mode. The GPU-present paths run on nvidia-smi output
captured on real GPU hosts (tests/data/nvidia-smi/README.md names each source), printed by a
fake ``nvidia-smi`` on PATH: the one fake here, because no GPU exists on this machine.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from appliance import hostcheck, profiles
from appliance.errors import UsageError
from appliance.hostcheck import disk, nvidia, ports, system

CAPTURES = Path(__file__).parent / "data" / "nvidia-smi"
NO_DOCKER = "unix:///nonexistent/docker.sock"


def as_machine(monkeypatch) -> None:
    """The test's --root named as a machine run from this host (its systemd entered through
    APPLIANCE_SYSTEMD_PREFIX, never run by host check): its GPUs are this host's, and the fake
    nvidia-smi on PATH answers for them (host/reach.py). Without it a tree is not asked."""
    monkeypatch.setenv("APPLIANCE_SYSTEMD_PREFIX", "/nonexistent/appliance-test/enter-machine")


def fake_nvidia_smi(tmp_path: Path, monkeypatch, capture: str) -> None:
    """A ``nvidia-smi`` on PATH that prints ``capture`` for ``--query-gpu`` and, for ``-L`` and
    ``topo -m``, the files beside it (``NAME.L.txt``, ``NAME.topo.txt``; where a capture has
    none, it answers with exit 6)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    listing = shlex.quote(str(CAPTURES / capture.replace(".csv", ".L.txt")))
    topo = shlex.quote(str(CAPTURES / capture.replace(".csv", ".topo.txt")))
    tool.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -L ]; then [ -f {listing} ] || exit 6; exec cat {listing}; fi\n'
        f'if [ "$1" = topo ]; then [ -f {topo} ] || exit 6; exec cat {topo}; fi\n'
        f"cat {shlex.quote(str(CAPTURES / capture))}\n"
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{shutil.os.environ['PATH']}")


@pytest.fixture
def no_nvidia_smi(monkeypatch):
    """PATH without any nvidia-smi: a host without the NVIDIA driver, also on a GPU host (the
    tests review's T11: these tests went red on the reference host)."""
    dirs = shutil.os.environ["PATH"].split(":")
    monkeypatch.setenv("PATH", ":".join(d for d in dirs if not (Path(d) / "nvidia-smi").exists()))
    assert shutil.which("nvidia-smi") is None


def by_name(findings) -> dict:
    return {f.name: f for f in findings}


# --- the GPUs, on captured output --------------------------------------------------------


def test_captures_parse_by_header():
    l40s = nvidia.parse_csv((CAPTURES / "l40s-x2.csv").read_text())
    assert [(g.index, g.name, g.driver, g.memory_mib) for g in l40s] == [
        (0, "NVIDIA L40S", "575.51.03", 46068),
        (1, "NVIDIA L40S", "575.51.03", 46068),
    ]
    (gb10,) = nvidia.parse_csv((CAPTURES / "gb10.csv").read_text())
    assert (gb10.name, gb10.memory_mib, gb10.compute_cap) == ("NVIDIA GB10", None, None)
    (h100,) = nvidia.parse_csv((CAPTURES / "h100-80gb-hbm3.csv").read_text())
    assert (h100.memory_mib, h100.compute_cap) == (81559, "9.0")
    with pytest.raises(ValueError, match="not nvidia-smi CSV"):
        nvidia.parse_csv("NVIDIA L4, 580.95.05, 23034 MiB\n")  # noheader: columns unknown
    # A memory no GPU has is not believed (security review T9: -5 MiB and 10^20 MiB were).
    for odd in ("-5 MiB", "0 MiB", "99999999999999999999 MiB"):
        with pytest.raises(ValueError, match="not a GPU's memory.total"):
            nvidia.parse_csv(f"name, memory.total [MiB]\nNVIDIA L4, {odd}\n")


def test_h100_capture_fits_the_h100_profile(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "h100-80gb-hbm3.csv")
    found = by_name(nvidia.gpu_findings(profiles.get("h100-31b-mtp")))
    assert {n: f.status for n, f in found.items()} == {
        "nvidia.driver": "ok",
        "gpu.count": "ok",
        "gpu.devices": "ok",
        "gpu.memory": "ok",
        "gpu.compute_capability": "ok",
    }
    # This capture has no uuid column and no -L listing: the GPU goes by its index.
    assert found["gpu.devices"].message == (
        "0 (NVIDIA H100 80GB HBM3): docker --gpus device=0 (no CDI spec names nvidia.com/gpu "
        "devices)"
    )
    assert found["nvidia.driver"].message == "driver 580.82.07 (>= 575.51.03)"
    assert found["gpu.memory"].message == "81559 MiB per GPU (profile: 80 GB per GPU)"


def test_one_l4_for_the_four_l4_profile_is_a_blocker(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "l4.csv")
    found = by_name(nvidia.gpu_findings(profiles.get("l4x4-31b-mtp")))
    assert found["gpu.count"].status == "blocker"
    assert found["gpu.count"].message == (
        "1 GPU(s) visible (NVIDIA L4), profile l4x4-31b-mtp needs 4"
    )
    # 23034 MiB is what an L4 (24 GB) reports: enough for the profile's 24.
    assert found["gpu.memory"].status == "ok"


def test_l4_for_the_h100_profile_lacks_memory_and_is_another_model(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "l4.csv")
    found = by_name(nvidia.gpu_findings(profiles.get("h100-31b-mtp")))
    assert found["gpu.memory"].status == "blocker"
    assert (
        "smallest GPU has 23034 MiB, profile h100-31b-mtp needs 80 GB"
        in found["gpu.memory"].message
    )
    assert found["gpu.model"].status == "warn"
    # No compute_cap column in this capture: said, not guessed.
    assert found["gpu.compute_capability"].status == "warn"


def test_gb10_unified_memory_is_not_reported_and_not_guessed(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "gb10.csv")
    found = by_name(nvidia.gpu_findings(profiles.get("spark-31b-nvfp4-mtp")))
    assert found["gpu.memory"].status == "ok"
    assert "unified memory" in found["gpu.memory"].message
    assert found["gpu.count"].status == "ok" and found["nvidia.driver"].status == "ok"


def test_lower_compute_capability_and_older_driver_are_blockers(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "h100-80gb-hbm3.csv")
    spark = profiles.get("spark-31b-nvfp4-mtp")  # GB10: 12.1
    found = by_name(nvidia.gpu_findings(spark))
    assert found["gpu.compute_capability"].status == "blocker"
    # The profile states its precision's floor: NVFP4 kernels need 10.0 (Blackwell).
    assert found["gpu.compute_capability"].message.startswith(
        "compute capability 9.0 is below 10.0"
    )
    newer = dataclasses.replace(spark.hardware, min_driver="590.1")
    found = by_name(nvidia.gpu_findings(dataclasses.replace(spark, hardware=newer)))
    assert found["nvidia.driver"].status == "blocker"
    assert found["nvidia.driver"].fix == "upgrade the NVIDIA driver to >= 590.1 and reboot"


def test_cli_reads_the_fake_nvidia_smi_and_prints_one_line_per_finding(
    tmp_path, monkeypatch, cli_run
):
    fake_nvidia_smi(tmp_path, monkeypatch, "rtx5070ti.csv")
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    as_machine(monkeypatch)
    res = cli_run(
        ["host", "check", "--profile", "rtx5090x2-31b-fp8-mtp", "--root", str(tmp_path)], code=1
    )
    lines = res.output.splitlines()
    want = "BLOCKER gpu.count: 1 GPU(s) visible (NVIDIA GeForce RTX 5070 Ti), profile"
    assert any(line.startswith(want) for line in lines), res.output
    assert lines[-1].startswith("host check: ") and "blocker(s)" in lines[-1]


# --- this machine, for real ----------------------------------------------------------------


def test_no_gpu_here_is_a_blocker_for_a_gpu_profile_and_nothing_for_a_cpu_one(no_nvidia_smi):
    (f,) = nvidia.gpu_findings(profiles.get("l4x4-31b-mtp"))
    assert (f.name, f.status) == ("nvidia.driver", "blocker")
    assert f.fix == "install the NVIDIA driver >= 575.51.03 and reboot"
    (cpu,) = nvidia.gpu_findings(profiles.get("cpu-tiny-mtp"))
    assert cpu.status == "ok"


def test_docker_that_does_not_answer_is_a_blocker_in_one_plain_line(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    f, build = hostcheck.docker.docker_findings(profiles.get("cpu-tiny-mtp"), "gemma4-vllm:latest")
    assert (f.name, f.status) == ("docker.engine", "blocker")
    # The image's build (CPU or CUDA) cannot be read: said, not passed over.
    assert (build.name, build.status) == ("docker.image", "warn")
    assert build.message == "image build not checked: no Docker engine answered"
    # Not the SDK's nested exception tuple (the H200 capture's host check printed one).
    assert f.message == "no Docker socket at /nonexistent/docker.sock: is docker running?"
    assert "systemctl enable --now docker" in f.fix
    assert hostcheck.docker.engine_finding() == f
    # Without DOCKER_HOST the SDK's default socket is the one named.
    monkeypatch.delenv("DOCKER_HOST")
    assert hostcheck.docker.DEFAULT_SOCKET == "unix:///var/run/docker.sock"


def test_python_with_venv_and_node_exporter_are_checked_as_the_readme_says(tmp_path):
    f = system.python_finding()  # this machine's python3: 3.11 with ensurepip
    assert f.status == "ok" and f.message.startswith("python3 3.1") and "with venv" in f.message
    missing = system.python_finding(str(tmp_path / "python3"))
    assert missing.status == "warn" and "python3-venv" in missing.fix
    # No node_exporter on this machine: the state metrics would not be served.
    assert shutil.which("node_exporter") is None
    f = system.node_exporter_finding()
    assert f.status == "warn" and "prometheus-node-exporter" in f.fix
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    assert "`venv` (Debian: `apt install python3-venv`); node_exporter" in readme


def test_the_readmes_disk_figure_is_what_the_check_asks():
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    gib = profiles.get("l4x4-31b-mtp").weights_gib
    assert f"({gib:g} GiB, {gib * 2**30 / 1e9:.1f} GB, for 31B bf16 plus" in readme


@pytest.mark.docker
def test_real_docker_without_nvidia_runtime_blocks_gpu_profiles(docker_engine):
    found = by_name(
        hostcheck.docker.docker_findings(
            profiles.get("l4x4-31b-mtp"), "no-such:image", docker_engine
        )
    )
    assert found["docker.engine"].status == "ok"
    assert found["docker.gpus"].status == "blocker"
    assert "nvidia-ctk runtime configure --runtime=docker" in found["docker.gpus"].fix
    assert found["docker.data_root"].status in ("ok", "warn")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs: a full disk that costs nothing."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_weights_that_do_not_fit_are_a_blocker_and_the_cache_counts(tiny_disk):
    prof = profiles.get("l4x4-31b-mtp")
    f = disk.weights_finding(prof, tiny_disk / "huggingface")  # not created yet: its parent
    assert f.status == "blocker"
    assert f.message.startswith(f"0.0 GiB free at {tiny_disk}, the weights need 60.0 GiB more")
    small = dataclasses.replace(prof, weights_gib=0.0008)  # 839 KiB in all
    blob = tiny_disk / "huggingface/hub/models--google--gemma-4-31B-it/blobs/x"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"\0" * 600 * 1024)  # most of it is there already
    assert disk.weights_finding(small, tiny_disk / "huggingface").status == "ok"


def test_a_taken_port_is_a_blocker_unless_it_is_the_instances_own():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ports.port_finding("127.0.0.1", port).status == "blocker"
        assert ports.port_finding("127.0.0.1", port, own=True).status == "warn"
    assert ports.port_finding("127.0.0.1", port).status == "ok"


def test_systemd_here_is_installed_but_not_pid1(tmp_path):
    f = system.systemd_finding()
    assert f.status == "blocker" and "PID 1 is not systemd" in f.message
    booted = tmp_path / "run-systemd-system"
    booted.mkdir()
    assert system.systemd_finding(booted).status == "ok"  # systemd 252 >= 247


def test_api_key_file_modes(tmp_path):
    key = tmp_path / "k.api-key"
    assert system.api_key_finding(key).status == "blocker"
    key.write_text("x\n")
    key.chmod(0o644)
    f = system.api_key_finding(key)
    assert (f.status, f.fix) == ("blocker", f"chmod 600 {key}")
    key.chmod(0o600)
    assert system.api_key_finding(key).status == "ok"


def test_cli_json_and_usage(tmp_path, monkeypatch, cli_run, no_nvidia_smi):
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    res = cli_run(["host", "check", "--profile", "cpu-tiny-mtp", "--json"], code=None)
    body = json.loads(res.output)
    assert res.exit_code == 1 and body["ok"] is False  # no systemd as PID 1, no Docker
    assert {f["name"] for f in body["findings"] if f["status"] == "blocker"} == {
        "systemd",
        "docker.engine",
    }
    # Nothing to suggest one from: the host alone, the driver's absence a blocker (exit 1).
    res = cli_run(["host", "check", "--json"], code=1)
    body = json.loads(res.output)
    assert (body["profile"], body["ok"]) == (None, False)
    found = {f["name"]: f for f in body["findings"]}
    assert found["nvidia.driver"]["status"] == "blocker"
    assert found["nvidia.driver"]["message"] == "nvidia-smi not found: no NVIDIA driver"
    assert found["profile"]["message"] == (
        "no NVIDIA GPU here to suggest a profile for (nvidia-smi not found)"
    )
    assert {"user", "systemd", "python", "node_exporter", "docker.engine"} <= set(found)


def test_host_check_without_a_profile_reports_the_driver_and_gpus(tmp_path, monkeypatch, cli_run):
    # A GPU no shipped profile fits: the driver and GPUs are still reported.
    fake_nvidia_smi(tmp_path, monkeypatch, "rtx5070ti.csv")
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    as_machine(monkeypatch)
    res = cli_run(["host", "check", "--root", str(tmp_path / "r")], code=1)
    docker = "no Docker socket at /nonexistent/docker.sock: is docker running?"
    assert res.output.splitlines() == [
        "OK      nvidia.driver: driver 580.95.05 (>= 575.51.03)",
        "OK      gpu.count: 1 GPU(s): 0 NVIDIA GeForce RTX 5070 Ti (16303 MiB, compute capability "
        + "12.0)",
        f"BLOCKER docker.engine: {docker} (fix: {hostcheck.docker.INSTALL})",
        "WARN    profile: no shipped profile fits 1x NVIDIA GeForce RTX 5070 Ti (fix: give one: "
        + "--profile NAME (appliance profiles list))",
        "host check: 1 blocker(s), 1 warning(s)",
    ]
    # nvidia-smi failing (its own first line), and a driver older than the images' floor.
    q = nvidia.Query(
        error="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    )
    (f,) = nvidia.host_findings(q, "575.51.03")
    assert (f.name, f.status) == (
        "nvidia.driver",
        "blocker",
    ) and "couldn't communicate" in f.message
    old = nvidia.Query(gpus=(nvidia.Gpu("NVIDIA L4", "470.82.01", 23034),))
    assert nvidia.host_findings(old, "575.51.03")[0].status == "blocker"


# --- install refuses on a blocker --------------------------------------------------------


def test_install_refuses_on_a_blocker_and_writes_nothing(tmp_path, monkeypatch, cli_run):
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    root = tmp_path / "root"
    argv = ["instance", "install", "g1", "-p", "l4x4-31b-mtp", "--root", str(root), "--host-check"]
    res = cli_run(argv, code=1)
    assert res.output.startswith(
        "Error: host not ready for profile l4x4-31b-mtp: nvidia.driver: nvidia-smi not found"
    )
    assert len(res.output.splitlines()) == 1
    assert not root.exists()
    cli_run([*argv, "--force", " "], code=2)
    forced = cli_run([*argv, "--force", "GPUs arrive tomorrow"])
    assert "warning: installed despite BLOCKER nvidia.driver: " in forced.output
    assert "(--force: GPUs arrive tomorrow)" in forced.output
    assert (root / "etc/gemma4-vllm/g1.env").exists()


def test_install_under_another_root_checks_only_when_asked(tmp_path, monkeypatch, cli_run):
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    cli_run(["instance", "install", "g2", "-p", "l4x4-31b-mtp", "--root", str(tmp_path)])
    # The installed instance, as installed: its own key file is checked too.
    check = ["host", "check", "g2", "--root", str(tmp_path), "--json"]
    body = json.loads(cli_run(check, code=None).output)
    assert (body["profile"], body["instance"]) == ("l4x4-31b-mtp", "g2")
    key = next(f for f in body["findings"] if f["name"] == "api_key")
    assert key["status"] == "ok"
    (tmp_path / "etc/gemma4-vllm/g2.api-key").chmod(0o644)
    body = json.loads(cli_run(check, code=None).output)
    key = next(f for f in body["findings"] if f["name"] == "api_key")
    assert key["status"] == "blocker" and key["fix"].startswith("chmod 600 ")


def test_profile_fields_refuse_wrong_values_in_one_line():
    base = {"name": "x", "description": "x", "model": "m", "served_model_name": "m"}
    with pytest.raises(UsageError, match=r"^x.toml \[hardware\]: min_driver = 'new': String"):
        profiles.from_dict({**base, "hardware": {"min_driver": "new"}}, "x.toml")
    with pytest.raises(UsageError, match=r"^x.toml: weights_gib = -1: must be within 0..16384"):
        profiles.from_dict({**base, "weights_gib": -1}, "x.toml")
    with pytest.raises(UsageError, match=r"^x.toml: weights_gib = '60': Input should be a valid"):
        profiles.from_dict({**base, "weights_gib": "60"}, "x.toml")
