"""A profile turns into the exact `vllm serve` argument list (issue: foundation)."""

from __future__ import annotations

import json

import pytest

from appliance import profiles
from appliance.errors import UsageError


def test_reference_profile_gives_the_exact_argument_list():
    args = profiles.get("l4x4-31b-mtp").serve_args()
    assert args == [
        "google/gemma-4-31B-it",
        "--served-model-name",
        "gemma-4-31b-it",
        "--host",
        "127.0.0.1",
        "--port",
        "8050",
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "4",
        "--max-model-len",
        "32768",
        "--max-num-batched-tokens",
        "4096",
        "--gpu-memory-utilization",
        "0.92",
        "--speculative-config",
        '{"method":"mtp","model":"google/gemma-4-31B-it-assistant","num_speculative_tokens":2}',
        "--per-request-spec-decode-metrics",
        "detailed",
    ]


def test_baseline_is_the_reference_without_speculation():
    mtp = profiles.get("l4x4-31b-mtp").serve_args()
    base = profiles.get("l4x4-31b").serve_args()
    assert base == mtp[: mtp.index("--speculative-config")]
    assert profiles.get("l4x4-31b-mtp").serve_args(speculative=False) == base


def test_cpu_mtp_profile_fills_in_the_tiny_model_and_asks_for_per_request_metrics():
    args = profiles.get("cpu-tiny-mtp").serve_args(devmodel="/m", port=9000)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "model": "/m/drafter", "num_speculative_tokens": 2}
    assert args[0] == "/m/target" and args[args.index("--port") + 1] == "9000"
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    assert "--speculative-config" not in profiles.get("cpu-tiny").serve_args(devmodel="/m")


def test_cpu_profile_without_model_dir_is_a_usage_error():
    with pytest.raises(UsageError, match="tiny dev model"):
        profiles.get("cpu-tiny-mtp").serve_args()


def test_unknown_field_in_a_profile_file_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        'name = "x"\ndescription = "d"\nmodel = "m"\nserved_model_name = "s"\n'
        "max_num_batched_token = 4096\n"
    )
    with pytest.raises(UsageError, match="unknown field.*max_num_batched_token"):
        profiles.load_file(path)


def test_every_shipped_profile_file_loads():
    names = profiles.all_profiles()
    assert {"cpu-tiny-mtp", "cpu-tiny", "l4x4-31b-mtp", "l4x4-31b"} <= set(names)
    for prof in names.values():
        assert prof.serve_args(devmodel="/m")[0]
