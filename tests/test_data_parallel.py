"""One data-parallel instance of a dense Gemma 4 with MTP (adr/0022): ``NAME-dpN`` is shipped
profile NAME as N ranks behind one endpoint; ``profiles suggest`` lists it after NAME where NAME
fits N times; the validator refuses it where vLLM 0.32 (the source read) or the fit does not
hold.

nvidia-smi's answers are the captures of tests/data/nvidia-smi/ (8x H100, the MIG card, 2x L40S,
H100 + L4), printed by the fake of tests/test_hostcheck.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomlkit
from plugins.cli import invoke
from test_hostcheck import CAPTURES, NO_DOCKER, as_machine, fake_nvidia_smi

from appliance import profiles
from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.hostcheck import nvidia
from appliance.profiles import validate as pv
from appliance.serve import argsfile

FORCE = ("--host-check", "--force", "no Docker or systemd on the test machine")
H100 = list(nvidia.parse_list((CAPTURES / "h100x8.L.txt").read_text())[0].values())


def suggested(tmp_path, monkeypatch, capture: str) -> dict:
    fake_nvidia_smi(tmp_path, monkeypatch, capture)
    return json.loads(invoke(["profiles", "suggest", "--json"]).stdout)


# --- suggest -----------------------------------------------------------------------------------


def test_suggest_lists_each_data_parallel_form_right_after_its_profile_on_8x_h100(
    tmp_path, monkeypatch
):
    body = suggested(tmp_path, monkeypatch, "h100x8.csv")
    names = [c["name"] for c in body["fitting"]]
    assert body["best"] == "h100x2-31b-mtp"  # the one-instance shape stays the default
    assert names[:4] == ["h100x2-31b-mtp", "h100x2-31b-mtp-dp4", "h100-31b-mtp", "h100-31b-mtp-dp8"]
    base, dp = body["fitting"][0], body["fitting"][1]
    assert (base["instances"], dp["instances"]) == (4, 1)
    assert dp["devices"] == H100  # the four instances' devices, all eight, as one
    # The same memory per GPU as the profile it is made of: each rank a whole copy.
    fit = base["why"].split("); ", 1)[1]
    assert dp["why"].endswith(f"); {fit}") and fit.endswith(" spare)")
    assert "4 data-parallel ranks, one endpoint (1 instance(s) of 8 GPU(s)" in dp["why"]
    assert "each rank a whole copy on 2 GPU(s), an independent engine" in dp["why"]
    # Made for this GPU only; a mixture of experts never, and the note says why.
    assert not [n for n in names if n.endswith("-dp2") and n.startswith(("l4x4", "a100"))]
    assert not [n for n in names if "26b-a4b" in n and "-dp" in n]
    moe = (
        "no data-parallel form of h100-26b-a4b-mtp, h100-26b-a4b-fp8-mtp: Gemma 4 26B-A4B-it "
        "is a mixture of experts: under data parallel vLLM shards its experts over every rank's "
        "GPUs and steps the ranks together, which the fit does not count (adr/0022)"
    )
    assert body["notes"] == [moe]


@pytest.mark.parametrize(
    ("capture", "forms", "note"),
    [
        ("l40s-x2.csv", ["l40s-31b-fp8-mtp-dp2", "l40s-e4b-mtp-dp2", "l40s-e2b-mtp-dp2"], "26B"),
        ("rtxpro6000-mig.csv", [], "mig24-e4b-mtp is a MIG profile: one instance per slice"),
        ("h100-l4.csv", [], None),  # each GPU kind holds its profiles once
        ("h200.csv", [], None),
    ],
)
def test_suggest_offers_data_parallel_only_where_a_profile_fits_twice_on_whole_gpus(
    tmp_path, monkeypatch, capture, forms, note
):
    body = suggested(tmp_path, monkeypatch, capture)
    assert [c["name"] for c in body["fitting"] if "-dp" in c["name"]] == forms
    if note is None:
        assert body["notes"] == []
    else:
        (said,) = body["notes"]
        assert note in said


def test_the_text_ends_with_the_notes(tmp_path, monkeypatch, cli_run):
    fake_nvidia_smi(tmp_path, monkeypatch, "rtxpro6000-mig.csv")
    lines = cli_run(["profiles", "suggest"]).stdout.splitlines()
    assert lines[-1] == (
        "note: no data-parallel form of mig24-e4b-mtp: mig24-e4b-mtp is a MIG profile: one "
        "instance per slice"
    )


# --- the derived profile ---------------------------------------------------------------------


def test_profiles_show_prints_the_derived_command_its_fit_and_where_it_comes_from(cli_run):
    res = cli_run(["profiles", "show", "h100x2-31b-mtp-dp4"])
    argv = res.stdout.split()
    at = argv.index("--data-parallel-size")
    assert argv[at - 2 : at + 4] == [
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "4",
        "--api-server-count",
        "1",
    ]
    # The queue bound is the API server's, over the four ranks of 16 sequences.
    assert argv[-2:] == ["--max-num-queued-reqs", "128"]
    base = cli_run(["profiles", "show", "h100x2-31b-mtp"])
    fit = [ln for ln in base.stderr.splitlines() if ln.startswith("fit per GPU")]
    assert fit and fit[0] in res.stderr.splitlines()  # NAME's memory per GPU
    assert (
        "values derived: 4 data-parallel ranks of h100x2-31b-mtp (computed); data parallel not "
        "measured on any host here"
    ) in res.stderr.splitlines()
    assert "error:" not in res.stderr
    text = profiles.shipped_text("h100x2-31b-mtp-dp4")
    assert text.startswith("# h100x2-31b-mtp-dp4: h100x2-31b-mtp as 4 data-parallel ranks")
    assert 'min_vllm = "0.32.0"' in text and re.search(r"(?m)^gpus = 8$", text)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("h100-26b-a4b-mtp-dp2", "Gemma 4 26B-A4B-it is a mixture of experts"),
        ("mig24-e4b-mtp-dp4", "mig24-e4b-mtp is a MIG profile: one instance per slice"),
        ("cpu-tiny-mtp-dp2", "cpu-tiny-mtp runs on the cpu engine, one engine per instance"),
        ("h100x2-31b-mtp-dp1", "1 rank(s) of 2 GPU(s)"),
        ("h100x2-31b-mtp-dp40", "40 rank(s) of 2 GPU(s)"),
    ],
)
def test_a_data_parallel_form_that_does_not_hold_is_no_profile(cli_run, name, why):
    res = cli_run(["profiles", "show", name], code=2)
    assert res.output.startswith(f"Error: no profile {name}: {why}")


# --- the validator ---------------------------------------------------------------------------


def edited(tmp_path: Path, base: str, **top) -> Path:
    """Shipped ``base``'s TOML with ``top`` set (``gpus`` in [hardware]), as an operator's file."""
    doc = tomlkit.parse(profiles.shipped_text(base))
    doc["name"] = f"mine-{len(list(tmp_path.iterdir()))}"
    if "gpus" in top:
        doc["hardware"]["gpus"] = top.pop("gpus")
    for key, value in top.items():
        if key == "schedule":
            doc["speculative"]["num_speculative_tokens_per_batch_size"] = value
        else:
            doc[key] = value
    path = tmp_path / f"{doc['name']}.toml"
    path.write_text(tomlkit.dumps(doc))
    return path


def validated(cli_run, path: Path) -> list[str]:
    res = cli_run(["profiles", "validate", "--file", str(path), "--json"], code=None)
    (row,) = json.loads(res.stdout)["profiles"]
    return [
        f"{f['level']}: {f['message']}" for f in row["findings"] if "data-parallel" in f["code"]
    ]


def test_the_validator_refuses_data_parallel_where_it_does_not_hold(tmp_path, cli_run):
    dp = {"data_parallel_size": 4, "min_vllm": "0.32.0"}
    assert validated(cli_run, edited(tmp_path, "h100x2-31b-mtp", gpus=8, **dp)) == []
    (few,) = validated(cli_run, edited(tmp_path, "h100x2-31b-mtp", gpus=4, **dp))
    assert few == (
        "error: data_parallel_size = 4 x tensor_parallel_size 2 x pipeline_parallel_size 1 = 8 "
        "GPUs, but [hardware] gpus = 4"
    )
    # vLLM drops a per-batch-size k under data parallel (config/vllm.py, 0.32).
    schedule = [[1, 3], [8, 1]]
    (dropped,) = validated(
        cli_run, edited(tmp_path, "h100x2-31b-mtp", gpus=8, schedule=schedule, **dp)
    )
    assert dropped == (
        "error: data_parallel_size = 4 with [speculative] num_speculative_tokens_per_batch_size: "
        "vLLM drops the schedule under data parallel and drafts k = 3 for every batch"
    )
    # The release read is 0.32; the generated profiles allow 0.21.
    old = edited(tmp_path, "h100x2-31b-mtp", gpus=8, data_parallel_size=4)
    assert validated(cli_run, old) == [
        (
            "error: data_parallel_size = 4 with Gemma 4 MTP needs vLLM >= 0.32.0, the release "
            "read for it (adr/0022), but min_vllm is 0.21.0"
        )
    ]
    mig = validated(cli_run, edited(tmp_path, "mig24-e4b-mtp", **dp))
    assert mig[0] == (
        "error: data_parallel_size = 4 for a MIG profile, which runs one instance per slice"
    )
    cpu = validated(cli_run, edited(tmp_path, "cpu-tiny-mtp", **dp))
    assert cpu == [
        "error: data_parallel_size = 4 on the cpu engine: a CPU instance runs one engine"
    ]
    # A mixture of experts: vLLM serves it; what each GPU holds is not the fit's, said.
    (moe,) = validated(
        cli_run, edited(tmp_path, "h100-26b-a4b-mtp", gpus=2, **dp | {"data_parallel_size": 2})
    )
    assert moe.startswith("warning: data_parallel_size = 2 for Gemma 4 26B-A4B-it, a mixture")


def test_each_suggested_profile_and_data_parallel_form_validates_clean(tmp_path, monkeypatch):
    body = suggested(tmp_path, monkeypatch, "h100x8.csv")
    for c in body["fitting"]:
        found = pv.errors(pv.check(profiles.get(c["name"])))
        assert found == [], (c["name"], found)


# --- installed -------------------------------------------------------------------------------


def test_one_data_parallel_instance_takes_the_whole_8x_h100_host(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "h100x8.csv")
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    as_machine(monkeypatch)
    root = tmp_path / "root"
    res = invoke(
        ["instance", "install", "big", "--profile", "h100-31b-mtp-dp8", "--root", str(root), *FORCE]
    )
    layout = Layout(root)
    env = envfile.read(layout.env_file("big"))
    assert env.get(envfile.GPUS_KEY) == "device=" + ",".join(H100)
    assert env.get("APPLIANCE_PROFILE") == "h100-31b-mtp-dp8"
    args = argsfile.read(layout.args_file("big"))
    serve = list(args.serve)
    at = serve.index("--data-parallel-size")
    assert serve[at : at + 4] == ["--data-parallel-size", "8", "--api-server-count", "1"]
    assert list(args.queue) == ["--max-num-queued-reqs", "32"]  # 2 x 2 sequences x 8 ranks
    assert f"of 8 NVIDIA H100 80GB HBM3, the next free (VLLM_GPUS=device={','.join(H100)})" in (
        res.stderr
    )
    # host check judges the same eight devices; nothing is left for a second instance.
    check = invoke(["host", "check", "big", "--root", str(root)], code=None)
    (line,) = [ln for ln in check.output.splitlines() if " gpu.devices: " in ln]
    assert line.count("(NVIDIA H100 80GB HBM3)") == 8 and ",".join(H100) in line
    again = invoke(
        ["instance", "install", "one", "--profile", "h100-31b-mtp", "--root", str(root), *FORCE],
        code=2,
    )
    assert again.output.startswith(
        "Error: no free 1 of NVIDIA H100 80GB HBM3 for profile h100-31b-mtp: 8 of 8 held by big"
    )
