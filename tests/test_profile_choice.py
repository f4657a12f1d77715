"""``--profile`` takes a shipped name or the operator's TOML file wherever a profile is chosen
(newcomer review D8: canary compare, dev serve and models answered "unknown profile" to a
file that install, host check, doctor, bench and tune took)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import canary
from appliance.canary.record import Output, Settings

MINE = """name = "mine-l4"
description = "an operator's copy of the 4x L4 profile, 90% parity"
model = "google/gemma-4-31B-it"
served_model_name = "gemma-4-31b-it"
max_num_batched_tokens = 4096

[speculative]
method = "mtp"
model = "google/gemma-4-31B-it-assistant"

[hardware]
gpus = 4

[canary]
min_parity = 0.5
"""


@pytest.fixture
def mine(tmp_path: Path) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(MINE)
    return path


def _record(tokens_b: tuple[int, ...]) -> canary.Record:
    outs = tuple(
        Output(cid, "prose", "t", t, len(t), "length", 0.1)
        for cid, t in {"a": (1, 2), "b": tokens_b}.items()
    )
    return canary.Record(
        "http://127.0.0.1:1", "m", "0.32.0", Settings(), "d", ("c.jsonl",), 0.0, 1.0, outs
    )


def test_canary_compare_judges_by_a_profile_file(tmp_path, mine, cli_run):
    a = canary.save(_record((3,)), tmp_path / "a.json")
    b = canary.save(_record((4,)), tmp_path / "b.json")
    res = cli_run(["canary", "compare", str(a), str(b), "--profile", str(mine)])
    # Half the outputs differ: the file's min_parity 0.5 passes it (the default 100% would not).
    assert res.output.startswith("canary passed")


def test_models_verify_takes_a_profile_file(tmp_path, mine, cli_run):
    res = cli_run(
        ["models", "verify", "--profile", str(mine), "--hf-cache-dir", str(tmp_path / "c")],
        code=None,
    )
    assert "unknown profile" not in res.output
    assert "google/gemma-4-31B-it" in res.output  # reported missing from the empty cache


def test_local_serve_reads_a_profile_file_before_refusing_a_gpu_one(mine, cli_run):
    res = cli_run(["dev", "serve", "--profile", str(mine)], code=2)
    assert res.output.startswith("Error: profile mine-l4 needs 4x GPU")
