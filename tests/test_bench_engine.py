"""bench against the real CPU engines: usage counts, TPOT vs `vllm bench serve`, paired, sweep."""

from __future__ import annotations

import json
import re
import subprocess

import httpx
import pytest
from click.testing import CliRunner

from appliance.bench import prompts, runner
from appliance.cli import cli
from appliance.engine.local import OFFLINE_ENV, engine_command

pytestmark = [pytest.mark.engine, pytest.mark.bench]


def _config(**kw) -> runner.BenchConfig:
    base = dict(prompt_sets=tuple(prompts.resolve(limit=1)), max_tokens=(32, 48), runs=2,
                warmups=1)
    return runner.BenchConfig(**(base | kw))


def _spec(res: runner.EndpointResult) -> tuple:
    t = res.spec_totals()
    return t["drafts"], t["draft_tokens"], t["accepted"], tuple(t["accepted_per_pos"])


def _check_counts(res: runner.EndpointResult, url: str) -> None:
    """Every run's output_tokens is usage.completion_tokens; a plain call says the same."""
    with httpx.Client(timeout=60) as http:
        for r in res.records:
            p = next(p for s in prompts.resolve(limit=1) for p in s.prompts if p.id == r.prompt_id)
            body = http.post(url + "/v1/chat/completions", json={
                "model": res.endpoint.model, "messages": list(p.messages),
                "max_tokens": r.max_tokens, "temperature": 0}).json()
            assert r.output_tokens == body["usage"]["completion_tokens"] == r.max_tokens


def test_single_counts_from_usage_and_acceptance_equals_counter_deltas(mtp_engine):
    ep = runner.open_endpoint(mtp_engine.url, "mtp")
    res = runner.run_endpoint(ep, _config())
    assert len(res.records) == 3 * 2 * 2
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


def test_tpot_agrees_with_vllm_bench_serve(mtp_engine, tmp_path):
    """Same server, same prompts, one request at a time: medians within 10%."""
    pset = prompts.shipped("prose")
    data = tmp_path / "prose.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in pset.prompts))
    n, out_len = len(pset.prompts), 96
    cmd = engine_command([
        "bench", "serve", "--backend", "openai-chat", "--base-url", mtp_engine.url,
        "--endpoint", "/v1/chat/completions", "--model", "gemma4-tiny",
        "--tokenizer", str(mtp_engine.model_dir / "target"), "--dataset-name", "custom",
        "--dataset-path", str(data), "--custom-output-len", str(out_len), "--skip-chat-template",
        "--num-prompts", str(n), "--max-concurrency", "1", "--disable-shuffle",
        "--temperature", "0", "--num-warmups", "1", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "vllm.json"])
    ours = runner.run_endpoint(runner.open_endpoint(mtp_engine.url, "mtp"), runner.BenchConfig(
        (pset,), max_tokens=(out_len,), runs=1, warmups=1))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, **OFFLINE_ENV}, cwd=tmp_path)
    assert (tmp_path / "vllm.json").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    theirs = json.loads((tmp_path / "vllm.json").read_text())
    assert theirs["completed"] == n
    assert theirs["total_output_tokens"] == sum(r.output_tokens for r in ours.records)
    our_tpot = sorted(r.tpot_s for r in ours.records)
    median = (our_tpot[(n - 1) // 2] + our_tpot[n // 2]) / 2 * 1000
    print(f"\nTPOT median: appliance bench {median:.3f} ms, vllm bench serve "
          f"{theirs['median_tpot_ms']:.3f} ms, ratio {median / theirs['median_tpot_ms']:.3f}")
    assert median == pytest.approx(theirs["median_tpot_ms"], rel=0.10)


def test_paired_mtp_vs_baseline(mtp_engine, baseline_engine, tmp_path):
    out = tmp_path / "paired.json"
    res = CliRunner().invoke(cli, [
        "bench", "--mtp-url", mtp_engine.url, "--baseline-url", baseline_engine.url,
        "--limit", "1", "--max-tokens", "48", "--runs", "3", "--json-output", str(out),
        "--profile", "cpu-tiny-mtp"])
    assert res.exit_code == 0, res.output
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


def test_sweep_k_recommendation_backed_by_printed_figures(tmp_path):
    out = tmp_path / "sweep.json"
    res = CliRunner().invoke(cli, [
        "bench", "--sweep-k", "1,3", "--prompts", "prose", "--limit", "2", "--max-tokens", "64",
        "--runs", "3", "--json-output", str(out)])
    assert res.exit_code == 0, res.output
    print(res.output)
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \| [\d.]+ \| (.+) \|$",
                      res.output, re.M)
    printed = {int(k): float(tpot) for k, tpot, _, _ in rows}
    assert sorted(printed) == [1, 3]
    rec = int(re.search(r"Recommended num_speculative_tokens: \*\*(\d+)\*\*", res.output)[1])
    assert printed[rec] == min(printed.values())
    for k, _, tps, pos in rows:
        assert len(pos.split(" / ")) == int(k)  # acceptance per draft position, k of them
        assert float(tps) > 1.5
    art = json.loads(out.read_text())["sweep"]
    assert art["recommended_k"] == rec
