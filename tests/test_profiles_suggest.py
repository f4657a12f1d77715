"""``appliance profiles suggest``, ``host check`` without a profile and ``install`` without one:
the profile for the GPUs nvidia-smi lists (appliance/hostcheck/suggest.py).

No GPU exists on this machine, so nvidia-smi's answers are the real outputs captured on GPU
hosts (tests/data/nvidia-smi/README.md names each), printed by a fake ``nvidia-smi`` on PATH:
the one fake here, as in tests/test_hostcheck.py. That nvidia-smi is missing here is real.
"""

from __future__ import annotations

import json

import pytest
from plugins.cli import invoke
from test_hostcheck import (  # noqa: F401 (a fixture)
    NO_DOCKER,
    as_machine,
    fake_nvidia_smi,
    no_nvidia_smi,
)

from appliance import profiles
from appliance.hostcheck import nvidia, suggest

# Each real capture, the profile suggested first, and a profile that does not fit with why.
CAPTURES = {
    "h200.csv": (
        "h200-31b-mtp",
        ("l4x4-31b-mtp", "gpu.count: 1 GPU(s) visible (NVIDIA H200), profile l4x4-31b-mtp needs 4"),
    ),
    "l4.csv": ("l4-e4b-mtp", ("h200-e2b-mtp", "gpu.memory: smallest GPU has 23034 MiB")),
    "l40s-x2.csv": (
        "l40sx2-31b-mtp",
        ("l40sx2-31b-nvfp4-mtp", None),  # no such profile: NVFP4 needs Blackwell
    ),
    "h100-80gb-hbm3.csv": (
        "h100-31b-mtp",
        ("rtxpro6000-31b-nvfp4-mtp", "gpu.memory: smallest GPU has 81559 MiB"),
    ),
    "gb10.csv": ("spark-31b-nvfp4-mtp", ("spark2-31b-nvfp4-mtp", "spans 2 hosts (a group)")),
}


def run(*args: str):
    return invoke(list(args), code=None)


@pytest.mark.parametrize("capture", sorted(CAPTURES))
def test_the_suggested_profile_passes_host_check_for_the_captures_gpus(
    tmp_path, monkeypatch, capture
):
    fake_nvidia_smi(tmp_path, monkeypatch, capture)
    best, (other, why) = CAPTURES[capture]
    res = run("profiles", "suggest", "--json")
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["best"] == best
    assert body["fitting"][0]["why"]  # one line of why
    if why is not None:
        (line,) = [o["why"] for o in body["others"] if o["name"] == other]
        assert line.startswith(why), line
    # The suggestion passes host check for these GPUs: no GPU blocker.
    found = nvidia.gpu_findings(profiles.get(best))
    assert [f.line() for f in found if f.status == "blocker"] == []
    # host check without a profile checks the suggested one, and says so.
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    as_machine(monkeypatch)  # the tree is a machine on this host: its GPUs are the fake's
    res = run("host", "check", "--json", "--root", str(tmp_path / "root"))
    report = json.loads(res.stdout)
    assert report["profile"] == best
    assert f"the suggested profile for {body_host(body)} is {best}" in res.stderr
    gpu = [f for f in report["findings"] if f["name"].startswith(("gpu", "nvidia"))]
    assert gpu and all(f["status"] != "blocker" for f in gpu), gpu


def body_host(body: dict) -> str:
    names = ", ".join(sorted({g["name"] for g in body["gpus"]}))
    return f"{len(body['gpus'])}x {names}"


def test_the_text_lists_the_fitting_best_first_and_says_why_the_others_do_not(
    tmp_path, monkeypatch
):
    fake_nvidia_smi(tmp_path, monkeypatch, "l4.csv")
    res = run("profiles", "suggest")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert lines[0] == "GPUs: 1x NVIDIA L4"
    assert lines[1].startswith("fit, best first (") and lines[2].startswith("  l4-e4b-mtp: ")
    assert "  l4x4-31b-mtp: gpu.count: 1 GPU(s) visible (NVIDIA L4)" in res.output
    others = lines.index(next(ln for ln in lines if ln.startswith("do not fit (")))
    shipped_gpu = [p for p in profiles.all_profiles().values() if p.hardware.device == "cuda"]
    assert len(lines) - 2 - 1 == len(shipped_gpu)  # every GPU profile, one line each
    assert all(ln.startswith("  ") and ": " in ln for ln in lines[others + 1 :])


def test_a_gpu_nothing_fits_exits_1_with_every_reason(tmp_path, monkeypatch, cli_run):
    # A 16 GB RTX 5070 Ti: below every profile's GPU memory.
    fake_nvidia_smi(tmp_path, monkeypatch, "rtx5070ti.csv")
    res = run("profiles", "suggest")
    assert res.exit_code == 1
    assert "no shipped profile fits these GPUs" in res.output
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    as_machine(monkeypatch)  # the tree is a machine on this host: its GPUs are the fake's
    # host check then reports the host alone (tests/test_hostcheck.py), saying why.
    res = cli_run(["host", "check", "--root", str(tmp_path / "r")], code=1)
    assert "WARN    profile: no shipped profile fits 1x NVIDIA GeForce RTX 5070 Ti" in res.output


@pytest.mark.usefixtures("no_nvidia_smi")
def test_no_gpu_here_is_said_and_the_fix_is_a_profile(cli_run):
    res = cli_run(["profiles", "suggest"], code=None)
    assert (res.exit_code, res.output) == (
        1,  # nothing fits this host: a refusal, as when its GPUs fit no profile
        (
            "Error: no NVIDIA GPU here to suggest a profile for (nvidia-smi not found) "
            "(give the profile: --profile NAME (appliance profiles list))\n"
        ),
    )


def test_install_without_a_profile_takes_the_suggestion_and_an_explicit_one_wins(
    tmp_path, monkeypatch
):
    fake_nvidia_smi(tmp_path, monkeypatch, "h200.csv")
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)  # Docker and systemd are blockers here: --force
    root = tmp_path / "root"
    args = ["--root", str(root), "--host-check", "--force", "no Docker on the test machine"]
    res = run("install", "big", *args)
    assert res.exit_code == 0, res.stderr
    assert "no --profile: the suggested profile for 1x NVIDIA H200 is h200-31b-mtp" in res.stderr
    env = (root / "etc/gemma4-vllm/big.env").read_text()
    assert "APPLIANCE_PROFILE=h200-31b-mtp" in env
    # Installed once, the env file names it: a re-install keeps it, no suggestion again.
    res = run("install", "big", *args)
    assert res.exit_code == 0 and "suggested" not in res.stderr
    # An explicit --profile always wins; the one GPU is big's (tests/test_gpu_placement.py),
    # so the other shares it, saying why.
    res = run("install", "other", "--profile", "h100-31b-mtp", *args)
    assert res.exit_code == 2 and "no free 1 of NVIDIA H200 for profile h100-31b-mtp" in res.output
    share = ("--gpus", "device=0", "--share-gpus", "compared with big, one at a time")
    res = run("install", "other", "--profile", "h100-31b-mtp", *share, *args)
    assert res.exit_code == 0 and "suggested" not in res.stderr
    assert "APPLIANCE_PROFILE=h100-31b-mtp" in (root / "etc/gemma4-vllm/other.env").read_text()


def test_the_candidates_rank_by_gpu_size_measurement_and_precision():
    q = nvidia.Query(gpus=(nvidia.Gpu("NVIDIA GB10", "580.95.05"),))
    s = suggest.suggest(q)
    names = [c.name for c in s.fitting]
    # Made for the GB10 first; the 31B before the smaller sizes; the seed's measured NVFP4
    # profile before the other 31B precisions.
    assert names[:3] == ["spark-31b-nvfp4-mtp", "spark-31b-mtp", "spark-31b-fp8-mtp"]
    first_other = next(i for i, n in enumerate(names) if not n.startswith("spark-"))
    assert all(not n.startswith("spark-") for n in names[first_other:])
