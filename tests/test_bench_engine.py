"""bench against the real CPU engines: counts, a level beside `vllm bench serve`, paired, sweep."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import httpx
import pytest
from plugins.cli import invoke

from appliance import profiles
from appliance.bench import prompts, runner
from appliance.engine import devmodel
from appliance.engine.local import OFFLINE_ENV, engine_command

pytestmark = [pytest.mark.engine, pytest.mark.bench]


def _config(**kw) -> runner.BenchConfig:
    base = {
        "prompt_sets": tuple(prompts.resolve(limit=1)),
        "max_tokens": (32, 48),
        "runs": 2,
        "warmups": 1,
    }
    return runner.BenchConfig(**(base | kw))


def _spec(res: runner.EndpointResult) -> tuple:
    t = res.spec_totals()
    return t["drafts"], t["draft_tokens"], t["accepted"], tuple(t["accepted_per_pos"])


def _check_counts(res: runner.EndpointResult, url: str) -> None:
    """Every run's output_tokens is usage.completion_tokens; a plain call says the same."""
    with httpx.Client(timeout=60) as http:
        for r in res.records:
            p = next(p for s in prompts.resolve(limit=1) for p in s.prompts if p.id == r.prompt_id)
            body = http.post(
                url + "/v1/chat/completions",
                json={
                    "model": res.endpoint.model,
                    "messages": list(p.messages),
                    "max_tokens": r.max_tokens,
                    "temperature": 0,
                },
            ).json()
            assert r.output_tokens == body["usage"]["completion_tokens"] == r.max_tokens


def test_single_counts_from_usage_and_acceptance_equals_counter_deltas(mtp_engine):
    ep = runner.open_endpoint(mtp_engine.url, "mtp")
    res = runner.run_endpoint(ep, _config(runs=1))
    assert len(res.records) == 3 * 2
    _check_counts(res, mtp_engine.url)
    # Under MTP a chunk carries several tokens: counting chunks would undercount.
    assert all(r.chunks < r.output_tokens for r in res.records)
    assert {r.spec_source for r in res.records} == {"request"}
    c = res.counters
    assert c.status == "ok"
    assert _spec(res) == (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos)
    assert res.spec_totals()["tokens_per_step"] > 1.5


def test_counter_path_matches_whole_run_delta(mtp_counters_engine):
    ep = runner.open_endpoint(mtp_counters_engine.url, "mtp-counters")
    res = runner.run_endpoint(ep, _config(max_tokens=(32,)))
    assert {r.spec_source for r in res.records} == {"counters"}
    c = res.counters
    assert _spec(res) == (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos)
    assert c.drafts > 0


def _vllm_bench_serve(
    url: str, tokenizer, data, n: int, out_len: int, tmp_path, concurrency: int = 1
) -> dict:
    """The real `vllm bench serve` of the installed vLLM, offline, ``concurrency`` requests at a
    time (one by default)."""
    result = tmp_path / "vllm.json"
    result.unlink(missing_ok=True)
    cmd = engine_command(
        [
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--base-url",
            url,
            "--endpoint",
            "/v1/chat/completions",
            "--model",
            "gemma4-tiny",
            "--tokenizer",
            str(tokenizer),
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(data),
            "--custom-output-len",
            str(out_len),
            "--skip-chat-template",
            "--num-prompts",
            str(n),
            "--max-concurrency",
            str(concurrency),
            "--disable-shuffle",
            "--temperature",
            "0",
            "--num-warmups",
            "1",
            "--disable-tqdm",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            result.name,
        ]
    )
    proc = subprocess.run(
        cmd,
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE_ENV},
        cwd=tmp_path,
    )
    assert result.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(result.read_text())


def test_a_concurrency_level_counts_what_vllm_bench_serve_counts(mtp_engine, tmp_path):
    """`bench --concurrency 4` and `vllm bench serve --max-concurrency 4` on the same prompts:
    the same requests, prompt and output tokens, and the level's speculative figures (from the
    responses' per-request blocks) add up to vLLM's own counters over the level. One short level:
    the two tools' agreement on tok/s and TPOT is a benchmark
    (benchmarks/bench_client_vs_vllm.py --server engine), not a test."""
    texts = [p.text for p in prompts.shipped("prose").prompts] * 2  # two waves of 4
    data = tmp_path / "prose.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    n, out_len, c = len(texts), 32, 4
    ours = _appliance_level(mtp_engine.url, data, n, out_len, c)
    theirs = _vllm_bench_serve(
        mtp_engine.url, mtp_engine.model_dir / "target", data, n, out_len, tmp_path, c
    )
    assert theirs["completed"] == n
    assert theirs["output_lens"] == [out_len] * n  # ours: n x out_len, none over max_tokens
    assert theirs["total_output_tokens"] == ours["output_tokens"]
    assert theirs["total_input_tokens"] == ours["prompt_tokens"]  # the same prompts


def _appliance_level(url: str, data, n: int, out_len: int, concurrency: int) -> dict:
    """One level of `appliance bench load`, its counts checked."""
    args = ["bench", "load", "--url", url, "--prompt-file", str(data), "--max-tokens", str(out_len)]
    args += ["--concurrency", str(concurrency), "--requests", str(n), "--json"]
    res = invoke(args)
    [lv] = json.loads(res.stdout)["concurrency"]["levels"]
    assert lv["concurrency"] == concurrency
    assert lv["requests"] == n and lv["output_tokens"] == n * out_len
    assert lv["spec_source"] == "request" and lv["drafts"] > 0
    assert lv["tokens_per_step"] > 1.5  # copy drafter
    counters = lv["counters_over_level"]
    for f in ("drafts", "draft_tokens", "accepted", "accepted_per_pos"):
        assert counters[f] == lv[f], f
    # The prediction at k'=k is the measured figure itself.
    assert lv["predicted_tokens_per_step"][-1] == pytest.approx(lv["tokens_per_step"])
    return lv


def test_paired_mtp_vs_baseline(mtp_engine, baseline_engine, tmp_path, cli_run):
    out = tmp_path / "paired.json"
    res = cli_run(
        [
            "bench",
            "compare",
            "--mtp-url",
            mtp_engine.url,
            "--baseline-url",
            baseline_engine.url,
            "--limit",
            "1",
            "--max-tokens",
            "48",
            "--runs",
            "3",
            "--out",
            str(out),
            "--profile",
            "cpu-tiny-mtp",
        ]
    )
    print(res.output)
    art = json.loads(out.read_text())
    paired = art["paired"]
    assert paired["mtp"]["spec_totals"]["tokens_per_step"] > 1.5
    assert paired["baseline"]["spec_totals"]["tokens_per_step"] == 1.0
    assert paired["baseline"]["spec_totals"]["sources"] == ["absent"]
    # Same target, greedy: the drafter may only change speed, never the output.
    assert paired["parity"]["checked"] and paired["parity"]["differ"] == 0
    assert paired["parity"]["equal"] == 9
    sp = paired["speedup"]["output_tps"]
    assert sp["n"] == 9 and sp["low"] <= sp["ratio"] <= sp["high"]
    assert art["environment"]["profile"]["name"] == "cpu-tiny-mtp"
    assert {e["vllm_version"] for e in art["endpoints"]} == {"0.32.0"}
    for side in ("mtp", "baseline"):
        for r in paired[side]["runs"]:
            assert r["output_tokens"] == 48
    assert "95% CI" in res.output and "9 equal, 0 differ" in res.output
    assert paired["acceptance"] is None
    assert "acceptance not compared: the baseline does not draft" in res.output


@contextlib.contextmanager
def _environ_kept():
    """This process's environment as it was, after vLLM code run in-process: its CPU platform
    writes ``os.environ`` while it builds a config (VLLM_WORKER_MULTIPROC_METHOD=spawn,
    LD_PRELOAD, ...), and every engine this process starts afterwards inherited it (ci14:
    `appliance dev serve` then spawned its engine core, with a resource tracker beside it)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_tune_writes_a_schedule_that_vllms_config_applies(
    mtp_engine, baseline_engine, tmp_path, monkeypatch, cli_run
):
    """``appliance bench tune`` on the session engines (it starts none): one run per level at the
    profile's k=2 and on the baseline, a k per level, and the profile copy it writes, read by
    vLLM's own config code (a restart to watch the counters would cost an engine start): the
    speculative config vLLM resolves keeps the schedule, and the per-batch-size lookup its
    scheduler builds from it gives each level the k tune chose."""
    dest = tmp_path / "tuned.toml"
    args = [
        "bench",
        "tune",
        *("--url", mtp_engine.url, "--baseline-url", baseline_engine.url),
        *("--profile", "cpu-tiny-mtp", "--concurrency", "1,4", "--requests", "4"),
        *("--limit", "1", "--max-tokens", "16", "--write", str(dest), "--json"),
    ]
    res = cli_run(args)
    out = json.loads(res.stdout)
    chosen = {lv["concurrency"]: lv["chosen_k"] for lv in out["levels"]}
    assert set(chosen) == {1, 4} and set(chosen.values()) <= {1, 2}
    for lv in out["levels"]:
        # The run at k=2 gives both k' (the copy drafter: every draft accepted, ~3 tok/step).
        assert lv["k"] == 2 and len(lv["predicted_tpot_s"]) == 2
        assert lv["predicted_tokens_per_step"][-1] == pytest.approx(lv["tokens_per_step"])
    for side in ("mtp", "baseline"):
        assert [lv["requests"] for lv in out[side]] == [4, 4]
    print(
        f"\ntune: k per level {chosen}, schedule {out['num_speculative_tokens_per_batch_size']}"
        f", {out['wall_s']:.1f} s"
    )

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    tuned = profiles.load_file(dest)
    assert tuned.name == "cpu-tiny-mtp-tuned"
    for key, value in tuned.env.items():
        monkeypatch.setenv(key, value)
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(
        tuned.serve_args(devmodel=devmodel.cached().root)
    )
    validate_parsed_serve_args(ns)
    ns.model = ns.model_tag
    with _environ_kept():
        config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
    spec = config.speculative_config
    schedule = [list(e) for e in spec.num_speculative_tokens_per_batch_size]
    assert schedule == out["num_speculative_tokens_per_batch_size"]
    # What vllm/v1/core/sched/scheduler.py builds at start and reads every step.
    lookup = build_dynamic_sd_schedule_lookup(
        spec.num_speculative_tokens_per_batch_size,
        vllm_max_batch_size=config.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=spec.num_speculative_tokens,
    )
    assert {n: lookup[n] for n in chosen} == chosen


def test_paired_bench_fails_an_mtp_side_that_drafts_worse(
    mtp_engine, mtp_random_engine, tmp_path, cli_run
):
    """The canary's and the soak's acceptance judgement, in the paired bench: the
    random drafter against the copy drafter, same target, same answers, far fewer accepted."""
    out = tmp_path / "paired.json"
    args = ["bench", "compare", "--mtp-url", mtp_random_engine.url]
    args += ["--baseline-url", mtp_engine.url]
    args += ["--limit", "1", "--max-tokens", "16", "--runs", "1", "--warmups", "0"]
    res = cli_run([*args, "--out", str(out)], code=1)
    assert "Error: the MTP side drafts worse than the baseline: draft acceptance fell" in (
        res.output
    )
    paired = json.loads(out.read_text())["paired"]  # the measurement is kept
    assert paired["parity"]["differ"] == 0
    change = paired["acceptance"]
    assert change["unit"] == "requests" and change["samples"] == 3
    assert change["before"]["acceptance"] - change["after"]["acceptance"] > 0.5
    assert change["failures"] and change["failures"][0].startswith("draft acceptance fell")


# The k sweep (two engines of its own) is checked with its report: tests/test_reports.py.


def test_api_key_file_lets_bench_through(api_key_engine, tmp_path, cli_run):
    """An installed instance's vLLM guards /v1 with its key: bench sends it, and never prints it."""
    from plugins.http_servers import API_KEY

    args = [
        "bench",
        "run",
        "--url",
        api_key_engine.url,
        "--prompts",
        "prose",
        "--limit",
        "1",
        "--max-tokens",
        "8",
        "--runs",
        "1",
        "--warmups",
        "0",
    ]
    out = tmp_path / "art.json"
    res = cli_run([*args, "--out", str(out)], env={"VLLM_API_KEY": None}, code=1)
    assert "/v1/models answered 401: the API key is missing or wrong" in res.output
    assert not out.exists()
    key = tmp_path / "k.api-key"
    key.write_text(API_KEY + "\n")
    res = cli_run(
        [*args, "--api-key-file", str(key), "--out", str(out), "--json"], env={"VLLM_API_KEY": None}
    )
    art = json.loads(out.read_text())
    assert json.loads(res.stdout) == art  # --json prints the artifact, one object
    runs = art["single"]["runs"]
    assert len(runs) == 1 and runs[0]["output_tokens"] == 8
    assert "api_key" not in art["endpoints"][0]
    assert API_KEY not in res.output and API_KEY not in out.read_text()
