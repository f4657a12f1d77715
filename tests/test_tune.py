"""``appliance bench tune`` without an engine: the k per level from the predictions of
appliance/bench/schedule.py, the schedule's ranges, and the profile copy it writes.

The engine test (tests/test_bench_engine.py) runs tune against the session engines and hands
the written profile to vLLM's own config code.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from appliance import profiles
from appliance.bench import schedule, tune
from appliance.bench.concurrency import LevelResult
from appliance.engine_api import specdecode
from appliance.errors import UsageError
from appliance.profiles import validate

CAPTURE = Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp.txt"


def captured_level(concurrency: int) -> LevelResult:
    """A level whose figures are the counters a real cpu-tiny-mtp engine (k=2, the copy
    drafter) exposed, read from its captured /metrics page."""
    total = specdecode.parse(CAPTURE.read_text()).total()
    assert total is not None
    moved = specdecode.counters_delta(specdecode.Counters(), total)
    return LevelResult(concurrency, [], 1.0, moved)


def test_the_captured_counters_predict_every_k_and_the_cheap_draft_wins():
    lengths = captured_level(1).predicted_lengths()
    # 21 drafts, each position accepted 21 times: the copy drafter is always right.
    assert lengths == (2.0, 3.0)
    # Measured: baseline 10 ms a token; MTP at k=2 yields 3 tokens a step in 12 ms (a GPU-like
    # step that barely grows with k), so k=2 is predicted fastest and pays.
    c = tune.choose(1, lengths, mtp_tpot_s=0.004, baseline_tpot_s=0.010)
    assert c.k == 2 and c.chosen_k == 2 and c.mtp_pays
    # The step line: 10 ms at k=0, 12 ms at k=2 -> 11 ms at k=1 for 2 tokens.
    assert c.predicted_tpot_s == pytest.approx((0.0055, 0.004))


def test_a_decaying_drafter_under_load_gets_a_smaller_k():
    # Per position 0.8 / 0.5 / 0.3 at k=3 (the partial drafter): 1.8, 2.3, 2.6 tok/step.
    lengths = schedule.predicted_lengths((0.8, 0.5, 0.3))
    assert lengths == pytest.approx((1.8, 2.3, 2.6))
    # Alone: a step costs 10 ms + 1 ms per draft; at k=3, 13 ms / 2.6 = 5 ms a token.
    alone = tune.choose(1, lengths, mtp_tpot_s=0.013 / 2.6, baseline_tpot_s=0.010)
    assert alone.chosen_k == 3 and alone.mtp_pays
    # Under load a draft costs as much as a token (compute bound): 10 ms + 10 ms per draft.
    loaded = tune.choose(8, lengths, mtp_tpot_s=0.040 / 2.6, baseline_tpot_s=0.010)
    assert loaded.predicted_tpot_s == pytest.approx((0.020 / 1.8, 0.030 / 2.3, 0.040 / 2.6))
    assert loaded.chosen_k == 1 and not loaded.mtp_pays  # the baseline's 10 ms beats 11.1 ms


def choice(concurrency: int, k: int) -> tune.LevelChoice:
    return tune.LevelChoice(concurrency, 3, 0.01, 0.01, 2.0, (1.5, 1.8, 2.0), (1, 1, 1), k)


@pytest.mark.parametrize(
    "chosen, max_num_seqs, want",
    [
        ([(1, 3), (4, 2), (16, 1)], None, ((1, 2, 3), (3, 10, 2), (11, 16, 1))),
        ([(1, 3), (4, 3), (16, 1)], 64, ((1, 10, 3), (11, 64, 1))),  # same k: merged
        ([(8, 2)], 32, ((1, 32, 2),)),  # one level: every batch size, from 1
        ([(16, 1), (1, 2)], None, ((1, 8, 2), (9, 16, 1))),  # levels in any order
    ],
)
def test_the_schedule_covers_every_batch_size_from_1(chosen, max_num_seqs, want):
    got = tune.schedule([choice(n, k) for n, k in chosen], max_num_seqs)
    assert got == want
    assert validate.schedule_problem(got) is None  # vLLM's rules, held to vLLM's in another test


def result(profile: profiles.Profile, chosen) -> tune.TuneResult:
    return tune.TuneResult(profile, [choice(n, k) for n, k in chosen], [], [], 1.0)


def test_the_copy_keeps_the_profiles_text_and_reads_back_as_the_tuned_profile(tmp_path):
    source = profiles.shipped_text("l4x4-31b-mtp")
    tuned = result(profiles.get("l4x4-31b-mtp"), [(1, 2), (8, 1)]).tuned("l4x4-31b-mtp-tuned")
    dest = tmp_path / "tuned.toml"
    tune.write(dest, source, tuned)
    text = dest.read_text()
    assert profiles.load_file(dest) == tuned
    assert tuned.speculative.num_speculative_tokens_per_batch_size == ((1, 4, 2), (5, 8, 1))
    # Every comment of the original is still there, in order.
    assert [ln for ln in source.splitlines() if ln.startswith("#")] == [
        ln for ln in text.splitlines() if ln.startswith("#") and "appliance bench tune" not in ln
    ]
    # Tuning the copy's copy replaces the schedule rather than adding a second one.
    again = dataclasses.replace(
        tuned,
        speculative=dataclasses.replace(
            tuned.speculative, num_speculative_tokens_per_batch_size=((1, 64, 1),)
        ),
    )
    tune.write(dest, text, again)
    assert tomllib.loads(dest.read_text())["speculative"][tune.SCHEDULE_KEY] == [[1, 64, 1]]


def test_a_failed_write_keeps_the_file_that_was_there(tmp_path):
    dest = tmp_path / "tuned.toml"
    dest.write_text("# the operator's previous copy\n")
    tuned = result(profiles.get("cpu-tiny-mtp"), [(1, 2)]).tuned("t")
    # Another profile's text: with the schedule in, it would not read back as the tuned
    # profile; refused, nothing written.
    source = profiles.shipped_text("cpu-tiny-mtp").replace(
        "max_model_len = 512", "max_model_len = 256"
    )
    with pytest.raises(UsageError, match="could not write the schedule.*reads back differently"):
        tune.write(dest, source, tuned)
    assert dest.read_text() == "# the operator's previous copy\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.toml"]  # no temporary left behind


def _restyled(style: str) -> str:
    """cpu-tiny-mtp's text with its [speculative] table in another valid TOML style."""
    text = profiles.shipped_text("cpu-tiny-mtp")
    table = (
        '[speculative]\nmethod = "mtp"\nmodel = "{devmodel}/drafter"\nnum_speculative_tokens = 2\n'
    )
    assert table in text
    if style == "dotted":  # the review's E6: valid, validated, and refused by the regex editor
        top = 'speculative.method = "mtp"\nspeculative.model = "{devmodel}/drafter"\n'
        top += "speculative.num_speculative_tokens = 2\n"
    else:
        top = 'speculative = { method = "mtp", model = "{devmodel}/drafter", '
        top += "num_speculative_tokens = 2 }\n"
    text = text.replace(table, "")
    return text.replace('min_vllm = "0.32.0"\n', f'min_vllm = "0.32.0"\n{top}', 1)


@pytest.mark.parametrize("style", ["dotted", "inline"])
def test_the_schedule_goes_into_dotted_keys_and_inline_tables(tmp_path, style):
    source = _restyled(style)
    path = tmp_path / "mine.toml"
    path.write_text(source)
    assert profiles.load_file(path) == profiles.get("cpu-tiny-mtp")  # the same profile
    tuned = result(profiles.get("cpu-tiny-mtp"), [(1, 2), (8, 1)]).tuned("mine-tuned")
    dest = tmp_path / "tuned.toml"
    tune.write(dest, source, tuned)
    assert profiles.load_file(dest) == tuned
    text = dest.read_text()
    if style == "dotted":
        assert "speculative.num_speculative_tokens_per_batch_size = [[1, 4, 2], [5, 8, 1]]" in text
        assert "[speculative]" not in text
    # Every comment of the original is still there, in order.
    assert [ln for ln in source.splitlines() if ln.startswith("#")] == [
        ln for ln in text.splitlines() if ln.startswith("#")
    ]


def test_a_write_that_cannot_succeed_is_refused_before_any_measurement(tmp_path, cli_run):
    """E6: the write is tried (a stand-in schedule) before the bench starts; nothing listens
    on port 9, so an answer about the TOML or the path came before any request."""
    args = ["bench", "tune", "--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9"]
    mine = tmp_path / "mine.toml"
    mine.write_text(_restyled("dotted").replace('name = "cpu-tiny-mtp"', 'name = "mine"'))
    missing = tmp_path / "no-such-dir" / "tuned.toml"
    res = cli_run([*args, "--profile", str(mine), "--write", str(missing)], code=2)
    assert res.stderr == (
        f"Error: cannot write {missing}: the directory {missing.parent} does not exist "
        f"(create it first: mkdir -p {missing.parent})\n"
    )
    assert not missing.parent.exists()
    # A writable one passes the check and goes on to the endpoints (and fails there).
    res = cli_run([*args, "--profile", str(mine), "--write", str(tmp_path / "t.toml")], code=None)
    assert res.exit_code == 1 and res.stderr.startswith("Error: cannot reach http://127.0.0.1:9")
    assert not (tmp_path / "t.toml").exists()
    with pytest.raises(UsageError, match="no top-level name"):
        tune.check_writable(
            tmp_path / "x.toml",
            profiles.shipped_text("cpu-tiny-mtp").replace('name = "cpu-tiny-mtp"\n', ""),
            profiles.get("cpu-tiny-mtp"),
            "x",
        )


def test_tune_measures_a_fixed_k_of_an_mtp_profile_only():
    with pytest.raises(UsageError, match="no MTP to tune"):
        tune.check_profile(profiles.get("cpu-tiny"))
    tuned = result(profiles.get("cpu-tiny-mtp"), [(1, 2)]).tuned()
    with pytest.raises(UsageError, match="already has a num_speculative_tokens_per_batch_size"):
        tune.check_profile(tuned)


def test_cli_refuses_before_touching_a_server(tmp_path, cli_run):
    res = cli_run(
        ["bench", "tune", "--url", "http://127.0.0.1:9", "--profile", "cpu-tiny-mtp"], code=2
    )
    assert "--baseline-url" in res.output
    args = ["bench", "tune", "--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9"]
    res = cli_run([*args, "--profile", "cpu-tiny"], code=2)
    assert "Error: profile cpu-tiny has no MTP to tune" in res.output
    res = cli_run([*args, "--profile", "cpu-tiny-mtp", "--concurrency", "0"], code=2)
    assert "--concurrency" in res.output
    # A profile file is a --profile too (endpoint.resolve reads it).
    path = tmp_path / "mine.toml"
    path.write_text(profiles.shipped_text("cpu-tiny").replace('"cpu-tiny"', '"mine"', 1))
    res = cli_run([*args, "--profile", str(path)], code=2)
    assert "profile mine has no MTP to tune" in res.output


def test_the_old_spelling_still_runs_and_names_the_new_form(cli_run):
    args = ["--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9"]
    res = cli_run(["tune", *args, "--profile", "cpu-tiny"], code=2)
    assert res.stderr.splitlines() == [
        "warning: `appliance tune` is now `appliance bench tune` (the old spelling goes in 0.2.0)",
        "Error: profile cpu-tiny has no MTP to tune",
    ]


def test_verify_reads_each_level_against_the_schedule():
    tuned = result(profiles.get("cpu-tiny-mtp"), [(1, 1), (4, 2)]).tuned()
    assert tuned.speculative.num_speculative_tokens_per_batch_size == ((1, 2, 1), (3, 4, 2))
    # The capture's engine drafted k=2 at every step (it had no schedule): alone, where this
    # schedule says k=1, that is a drafter ignoring it; at 4 requests the schedule keeps k=2.
    alone, four = tune.verify(tuned, [captured_level(1), captured_level(4)])
    assert (alone.verdict, alone.k_at, alone.k_most) == ("ignored", 1, 1)
    assert (four.verdict, four.k_at, four.k_most) == ("unchanged", 2, 2)
    with pytest.raises(UsageError, match="has no num_speculative_tokens_per_batch_size"):
        tune.verify(profiles.get("cpu-tiny-mtp"), [captured_level(1)])


@pytest.mark.parametrize(
    ("schedule", "k", "want"),
    [
        (((1, 4, 2), (5, 64, 1)), 2, {1: 2, 4: 2, 5: 1, 64: 1, 100: 1}),
        (((1, 2, 3), (9, 16, 1)), 3, {2: 3, 3: 3, 8: 3, 9: 1}),  # a gap carries the k before it
        (((5, 64, 1), (1, 4, 4)), 2, {1: 2, 5: 1}),  # unsorted; k above the profile's is capped
    ],
)
def test_the_k_at_each_batch_size_is_vllms_lookup(schedule, k, want):
    assert {b: tune.k_at(schedule, k, b) for b in want} == want


def test_cli_verify_refuses_a_profile_without_a_schedule_before_touching_a_server(cli_run):
    args = ["bench", "tune", "--url", "http://127.0.0.1:9", "--profile", "cpu-tiny-mtp"]
    res = cli_run([*args, "--verify"], code=2)
    assert "Error: profile cpu-tiny-mtp has no num_speculative_tokens_per_batch_size" in res.output
