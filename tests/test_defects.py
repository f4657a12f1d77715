"""The published Gemma 4 MTP defects of vLLM (appliance/profiles/defects.toml): each entry applies
on an affected version with its conditions and not otherwise; ``profiles validate`` and
``doctor`` name each that applies on one line; a wrong table entry is one line naming the field.
"""

from __future__ import annotations

import dataclasses

import pytest
from plugins.http_servers import Route

from appliance import doctor, profiles
from appliance.doctor.engine import defect_checks
from appliance.errors import UsageError
from appliance.profiles import Speculative, defects
from appliance.profiles import validate as pv


def variant(name: str, **changes) -> profiles.Profile:
    return dataclasses.replace(profiles.get(name), **changes)


def applies(defect_id: str, version: str | None, profile: profiles.Profile) -> bool:
    found = defects.applicable(version, defects.Conditions.of(profile))
    return defect_id in {d.id for d in found}


# Per entry: (profile that has its conditions, affected versions, unaffected versions, profiles
# on an affected version that lack a condition). None as a version: none given.
H100_FP8_KV = variant("h100-31b-mtp", kv_cache_dtype="fp8")
# The two-host shape l4x4x2-31b-mtp shipped with before: TP 4 in each host x PP 2 across them.
PP_MTP = variant("l4x4x2-31b-mtp", tensor_parallel_size=4, pipeline_parallel_size=2)
B200 = variant(
    "h100-31b-mtp",
    hardware=dataclasses.replace(
        profiles.get("h100-31b-mtp").hardware, gpu_name="NVIDIA B200", compute_capability="10.0"
    ),
)


def with_schedule(name: str) -> profiles.Profile:
    """Profile ``name`` with a k schedule as ``appliance tune`` writes one."""
    prof = profiles.get(name)
    spec = dataclasses.replace(
        prof.speculative, num_speculative_tokens_per_batch_size=((1, 4, 2), (5, 64, 1))
    )
    return dataclasses.replace(prof, speculative=spec)


CASES = {
    "fp8-kv-mtp-sm89": (
        variant("l4x4-31b-mtp", kv_cache_dtype="fp8"),
        ["0.21.0", "0.32.0", None],
        ["0.19.0", "0.20.2"],
        [H100_FP8_KV, profiles.get("l4x4-31b-mtp"), variant("l4x4-31b", kv_cache_dtype="fp8")],
    ),
    "fp8-kv-mtp-0.25.1": (
        H100_FP8_KV,
        ["0.25.1", "0.25.1+cu129"],
        ["0.25.0", "0.26.0", None],
        [profiles.get("h100-31b-mtp")],
    ),
    "mtp-init-0.25.1": (
        profiles.get("h100-31b-mtp"),
        ["0.25.1"],
        ["0.24.0", "0.25.2", None],
        [profiles.get("l4x4-31b"), profiles.get("cpu-tiny-mtp")],
    ),
    "mtp-draft-kv-scales": (
        H100_FP8_KV,
        ["0.21.0", "0.32.0", None],
        ["0.20.0"],
        [profiles.get("h100-31b-mtp"), variant("l4x4-31b", kv_cache_dtype="fp8")],
    ),
    "mtp-block-table-concurrency": (
        profiles.get("h100-31b-mtp"),
        ["0.21.0", "0.31.1"],
        ["0.32.0", "0.32.0rc1+cpu", None],
        [profiles.get("rtx5090x2-31b-fp8-mtp"), profiles.get("cpu-tiny-mtp")],  # one sequence
    ),
    "k-schedule-mtp-full-cudagraphs": (
        with_schedule("h100-31b-mtp"),
        ["0.25.0", "0.31.1"],
        ["0.24.0", "0.32.0", None],
        [profiles.get("h100-31b-mtp"), with_schedule("cpu-tiny-mtp")],
    ),
    "mtp-pipeline-parallel": (
        PP_MTP,
        ["0.21.0", "0.32.0", None],
        ["0.20.0"],
        [
            profiles.get("spark2-31b-nvfp4-mtp"),  # tensor parallel across the nodes
            profiles.get("l4x4x2-31b-mtp"),  # reshaped so: TP 8 across the two hosts
            dataclasses.replace(PP_MTP, speculative=None),  # PP without MTP
        ],
    ),
    "flashinfer-hd512-mtp-sm100": (
        B200,
        ["0.21.0", "0.32.0", None],
        ["0.20.0"],
        [
            profiles.get("h100-31b-mtp"),
            dataclasses.replace(B200, extra_args=("--attention-backend", "TRITON_ATTN")),
            dataclasses.replace(B200, speculative=None),
        ],
    ),
    "kv-auto-mtp-batching": (
        profiles.get("h100-31b-mtp"),
        ["0.21.0", "0.32.0", None],
        ["0.20.0"],
        [
            H100_FP8_KV,
            profiles.get("rtx5090x2-31b-fp8-mtp"),  # one sequence at a time
            profiles.get("cpu-tiny-mtp"),
            profiles.get("l4x4-31b"),
        ],
    ),
    "fp8-kv-mtp-acceptance": (
        H100_FP8_KV,
        ["0.21.0", "0.32.0", None],
        ["0.20.2"],
        [profiles.get("h100-31b-mtp"), variant("l4x4-31b", kv_cache_dtype="fp8")],
    ),
    "mrv2-dynamic-k-mtp": (
        with_schedule("h100-31b-mtp"),
        ["0.21.0", "0.31.1"],
        ["0.20.0", "0.32.0", None],
        [profiles.get("h100-31b-mtp"), with_schedule("cpu-tiny-mtp")],
    ),
}


def test_every_entry_has_its_case():
    # A new table entry needs its line in CASES (or, checked by a rule, its own test below).
    table = {d.id for d in defects.table()}
    checked = {d.id for d in defects.table() if d.checked_by}
    assert set(CASES) == table - checked and checked == {"drafter"}


@pytest.mark.parametrize("defect_id", sorted(CASES))
def test_entry_applies_on_an_affected_version_with_its_conditions_only(defect_id):
    prof, hit, miss, lacking = CASES[defect_id]
    for version in hit:
        assert applies(defect_id, version, prof), version
    for version in miss:
        assert not applies(defect_id, version, prof), version
    for other in lacking:
        assert not applies(defect_id, hit[0], other), other.name


def test_the_drafter_pairing_is_the_validator_rule_not_a_version_match():
    entry = next(d for d in defects.table() if d.id == "drafter")
    assert entry.checked_by == "drafter" and entry.fixed_in == defects.NOT_A_BUG
    wrong = variant(
        "l4x4-31b-mtp", speculative=Speculative("mtp", "google/gemma-4-E2B-it-assistant", 2)
    )
    assert not applies("drafter", "0.32.0", wrong)  # the rule decides, not the table
    found = {f.code: f for f in pv.check(wrong, vllm_version="0.32.0")}
    assert found["drafter"].level == "error" and "31b-it-assistant" in found["drafter"].fix
    assert "drafter" not in {f.code for f in pv.check(profiles.get("l4x4-31b-mtp"))}


def test_no_fixed_in_is_invented():
    for d in defects.table():
        assert d.fixed_in in (defects.UNKNOWN, defects.NOT_A_BUG) or d.fixed_in[0].isdigit()
        assert d.link.startswith("https://github.com/vllm-project/vllm/") and d.fix and d.title


def test_validate_names_each_defect_with_its_link_and_fix():
    found = {f.code: f for f in pv.check(H100_FP8_KV, vllm_version="0.25.1")}
    init, fp8 = found["mtp-init-0.25.1"], found["fp8-kv-mtp-0.25.1"]
    assert init.level == "warning" and fp8.level == "error"
    assert "https://github.com/vllm-project/vllm/issues/48848" in init.message
    assert "fixed in: unknown" in init.message and "VLLM_USE_V2_MODEL_RUNNER=1" in init.fix


def test_cli_validate_prints_one_warning_line_per_defect(cli_run):
    args = ["profiles", "validate", "h100-31b-mtp", "--vllm-version", "0.25.1"]
    res = cli_run(args)  # warnings only: exit 0
    lines = [ln for ln in res.output.splitlines() if "vllm-project/vllm" in ln]
    assert len(lines) == 3, res.output
    init = next(ln for ln in lines if "[mtp-init-0.25.1]" in ln)
    assert init.startswith("  warning: ") and "issues/48848" in init and "(fix: " in init
    assert any("[mtp-block-table-concurrency]" in ln and "pull/43982" in ln for ln in lines)
    assert any("[kv-auto-mtp-batching]" in ln and "issues/46088" in ln for ln in lines)
    # The shipped profiles on the image's own vLLM: only the batching defect closed upstream
    # with no known release (the output canary's concurrent run is its check).
    # Said once for the run, not once per profile (issue 55 §3).
    res = cli_run(["profiles", "validate", "--vllm-version", "0.32.0"])
    lines = [ln for ln in res.output.splitlines() if "vllm-project/vllm" in ln]
    assert len(lines) == 1 and "profiles: warning: [kv-auto-mtp-batching]" in lines[0], res.output


def test_cli_validate_fails_on_an_error_level_defect(tmp_path, cli_run):
    path = tmp_path / "fp8kv.toml"
    path.write_text(
        'name = "fp8kv"\ndescription = "x"\nmodel = "google/gemma-4-31B-it"\n'
        'served_model_name = "m"\nmin_vllm = "0.21.0"\nkv_cache_dtype = "fp8"\n'
        '[speculative]\nmodel = "google/gemma-4-31B-it-assistant"\n'
        '[hardware]\ngpus = 1\ngpu_memory_gib = 80\ncompute_capability = "9.0"\n'
    )
    args = ["profiles", "validate", "--file", str(path), "--vllm-version", "0.25.1"]
    res = cli_run(args, code=1)
    assert "error: [fp8-kv-mtp-0.25.1]" in res.output and "warning: [mtp-draft-kv-scales]" in (
        res.output
    )


def test_doctor_warns_once_per_defect_of_the_servers_version():
    checks = defect_checks("0.25.1", H100_FP8_KV)
    assert {c.name for c in checks} == {
        "vllm.defect.fp8-kv-mtp-0.25.1",
        "vllm.defect.mtp-init-0.25.1",
        "vllm.defect.mtp-draft-kv-scales",
        "vllm.defect.mtp-block-table-concurrency",
        "vllm.defect.fp8-kv-mtp-acceptance",
    }
    assert all(c.status == "warn" and "fix: " in c.summary for c in checks)
    assert checks[0].evidence["server"] == "0.25.1"
    # The reference runs one sequence (its fit): with more, batching's defect applies.
    assert defect_checks("0.32.0", profiles.get("l4x4-31b-mtp")) == []
    batched = dataclasses.replace(profiles.get("l4x4-31b-mtp"), max_num_seqs=8)
    assert [c.name for c in defect_checks("0.32.0", batched)] == [
        "vllm.defect.kv-auto-mtp-batching"
    ]
    assert defect_checks("0.32.0", profiles.get("rtx5090x2-31b-fp8-mtp")) == []
    assert defect_checks("0.25.1", None) == []  # no profile: no conditions to match
    assert defect_checks("dev", profiles.get("h100-31b-mtp")) == []  # vllm.version fails it


def test_doctor_report_names_the_defect_of_a_0_25_1_server(routed_http_server):
    # A vLLM 0.25.1 cannot run here (the suite's engines are 0.32): a server answering what one
    # would, with /metrics down so no probe generation is needed.
    url = routed_http_server(
        {
            "/health": Route(200, b""),
            "/version": Route(200, b'{"version": "0.25.1"}'),
            "/v1/models": Route(200, b'{"data": [{"id": "gemma-4-31b-it", "max_model_len": 8}]}'),
            "/metrics": Route(503, b"down", "text/plain"),
            "/metrics/": Route(503, b"down", "text/plain"),
        }
    )
    report = doctor.run(url, profile=profiles.get("h100-31b-mtp"), generate=False)
    assert report.get("vllm.version").status == "ok"
    line = next(ln for ln in report.text().splitlines() if "vllm.defect." in ln)
    assert line.startswith("WARN vllm.defect.mtp-init-0.25.1: ") and "issues/48848" in line


ENTRY = """
[[defect]]
id = "x"
title = "t"
link = "https://github.com/vllm-project/vllm/issues/1"
affected = ">=0.21.0"
fixed_in = "unknown"
level = "warning"
fix = "f"
[defect.needs]
mtp = true
"""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('affected = ">=0.21.0"', "affected = 0.25"), "[[defect]] x: affected = 0.25: "),
        (('affected = ">=0.21.0"', 'affected = "=>0.21"'), "affected = '=>0.21': not a version"),
        (('level = "warning"', 'level = "fatal"'), "[[defect]] x: level = 'fatal': "),
        (('fixed_in = "unknown"', 'fixed_in = "soon"'), "fixed_in = 'soon': not a version"),
        (('link = "https://github.com/vllm-project/vllm/issues/1"\n', ""), "missing field(s) link"),
        (("mtp = true", "gpu = true"), "[[defect]] x [needs]: unknown field(s) gpu"),
        (("mtp = true", 'mtp = "yes"'), "[needs]: mtp = 'yes': "),
        (('fix = "f"', 'fix = "f"\nchecked_by = "drafter"'), "goes with checked_by"),
    ],
)
def test_a_wrong_entry_is_one_line_naming_the_field(change, message):
    old, new = change
    assert old in ENTRY
    with pytest.raises(UsageError) as err:
        defects.load(ENTRY.replace(old, new), "t.toml")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("t.toml [[defect]] x")


def test_the_table_loads_and_ids_are_unique():
    assert len(defects.table()) == len(CASES) + 1
    with pytest.raises(UsageError, match="id x is used twice"):
        defects.load(ENTRY + ENTRY, "t.toml")
    assert defects.load(ENTRY, "t.toml")[0].needs == defects.Needs(mtp=True)


def test_mtp_with_pipeline_parallelism_is_refused_naming_the_defect_and_the_fix(cli_run):
    # What the two-host profile shipped as (TP 4 x PP 2 + MTP): vLLM 0.32's Gemma 4 proposer
    # returns before sharing the target's embedding on a PP group (vllm/v1/spec_decode/gemma4.py
    # _maybe_share_embeddings), and upstream reports MTP failing under PP (#52069, #49355).
    with pytest.raises(pv.ProfileError) as exc:
        pv.require_valid(PP_MTP, vllm_version="0.32.0")
    line = str(exc.value)
    assert "\n" not in line and "issues/52069" in line
    assert line.startswith("profile l4x4x2-31b-mtp: Gemma 4 MTP does not run under pipeline")
    assert exc.value.fix.startswith("run tensor parallel across the hosts instead")
    cli_run(["profiles", "validate", "l4x4x2-31b-mtp"])
    # the shipped shape is tensor parallel now
