"""bench without an engine: prompt files, statistics, bad input (no partial artifact)."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest

from appliance.bench import prompts, stats
from appliance.engine.local import free_port
from appliance.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_sets_load_and_are_package_data():
    for name in prompts.SHIPPED:
        s = prompts.shipped(name)
        assert s.name == name and len(s.prompts) >= 3
        assert len({p.id for p in s.prompts}) == len(s.prompts)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "bench/prompts/*.jsonl" in data["tool"]["setuptools"]["package-data"]["appliance"]


def test_invalid_jsonl_line_is_reported_with_its_number(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": "fine"}\n{"prompt": broken}\n')
    with pytest.raises(UsageError, match=r"mine.jsonl line 4: invalid JSON"):
        prompts.load_file(f)
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(UsageError, match=r"line 2: needs a non-empty string 'prompt'"):
        prompts.load_file(f)


def test_messages_form_and_default_ids(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(
        '{"messages": [{"role": "system", "content": "be brief"}, '
        '{"role": "user", "content": "hi"}]}\n{"prompt": "there"}\n'
    )
    s = prompts.load_file(f)
    assert [p.id for p in s.prompts] == ["chat-1", "chat-2"]
    assert s.prompts[0].text == "hi" and len(s.prompts[0].messages) == 2


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "has no prompts"),
        ("\n\n", "has no prompts"),
        ('{"prompt": "a"}\n[1, 2]\n', "line 2: expected a JSON object"),
    ],
)
def test_bad_prompt_file_exits_nonzero_without_artifact(tmp_path, content, message, cli_run):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    out = tmp_path / "art.json"
    # A URL nobody listens on: the file must be rejected before any server is contacted.
    res = cli_run(
        [
            "bench",
            "run",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--prompt-file",
            str(f),
            "--out",
            str(out),
        ],
        code=2,
    )
    assert message in res.output
    assert not out.exists() and list(tmp_path.iterdir()) == [f]


def test_unreachable_url_exits_nonzero_without_artifact(tmp_path, cli_run):
    out = tmp_path / "art.json"
    res = cli_run(
        [
            "bench",
            "run",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--limit",
            "1",
            "--out",
            str(out),
        ],
        code=1,
    )
    assert "cannot reach" in res.output
    assert list(tmp_path.iterdir()) == []


def test_non_vllm_server_is_refused_without_artifact(tmp_path, plain_http_server, cli_run):
    out = tmp_path / "art.json"
    res = cli_run(
        ["bench", "run", "--url", plain_http_server, "--limit", "1", "--out", str(out)], code=1
    )
    assert "/health is not 200" in res.output
    assert list(tmp_path.iterdir()) == []


def test_api_key_options_are_checked_before_any_server(tmp_path, cli_run):
    url = f"http://127.0.0.1:{free_port()}"
    res = cli_run(
        ["bench", "run", "--url", url, "--limit", "1", "--api-key-file", str(tmp_path / "missing")],
        code=2,
    )
    assert res.output.startswith("Error: API key file ")
    assert res.output.endswith("missing does not exist\n")
    res = cli_run(["bench", "run", "--url", url, "--limit", "1", "--instance", "../x"], code=2)
    assert res.output.startswith("Error: invalid instance name '../x'")
    assert len(res.output.splitlines()) == 1
    # The instance's key file is looked up under --root (APPLIANCE_ROOT), not under /.
    key = tmp_path / "etc/gemma4-vllm/tiny.api-key"
    key.parent.mkdir(parents=True)
    key.write_text("\n")
    res = cli_run(
        ["bench", "run", "--url", url, "--limit", "1", "--instance", "tiny"],
        env={"APPLIANCE_ROOT": str(tmp_path), "VLLM_API_KEY": None},
        code=2,
    )
    assert f"API key file {key} is empty" in res.output


def test_each_subcommand_takes_only_its_own_options(cli_run):
    url = f"http://127.0.0.1:{free_port()}"
    for argv, message in (
        (["sweep", "--url", url, "--k", "1,2"], "No such option '--url'"),
        (["compare", "--mtp-url", url], "Missing option '--baseline-url'"),
        (["sweep", "--k", "1,x"], "--k wants integers"),
        (["sweep", "--k", "1,2", "--concurrency", "1,4"], "No such option '--concurrency'"),
        (["load", "--url", url, "--concurrency", "1", "--report", "r.html"], "--report"),
        (["run", "--url", url, "--concurrency", "1"], "No such option '--concurrency'"),
        (["run", "--limit", "1"], "bench run measures one engine: give NAME or --url"),
    ):
        res = cli_run(["bench", *argv], env={"APPLIANCE_URL": None}, code=2)
        assert message in res.output, (argv, res.output)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (["--url", "URL", "--limit", "1"], "bench run NAME", "cannot reach"),
        (["--mtp-url", "URL", "--baseline-url", "URL"], "bench compare", "cannot reach"),
        (["--sweep-k", "1,x"], "bench sweep --k K,K", "--k wants integers"),
        (["--url", "URL", "--concurrency", "0"], "bench load NAME", "distinct integers"),
    ],
)
def test_the_old_single_command_still_runs_and_names_the_new_form(old, new, message, cli_run):
    """One release of the old `appliance bench OPTIONS`: the subcommand its options chose runs
    (here up to its first refusal, on a closed port), after one line naming the new form."""
    url = f"http://127.0.0.1:{free_port()}"
    res = cli_run(["bench", *[url if a == "URL" else a for a in old]], code=None)
    warning, error = res.stderr.splitlines()
    assert warning.startswith("warning: `appliance bench ") and f"`appliance {new}" in warning
    assert error.startswith("Error: ") and message in error
    assert res.exit_code == (2 if "--sweep-k" in old or "--concurrency" in old else 1)


def test_percentile_matches_linear_interpolation():
    """The standard library's inclusive quantiles: numpy's default, to the exact value."""
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([10, 20, 30, 40, 50], 90) == 46.0
    assert stats.percentile([50, 10, 40, 20, 30], 99) == 49.6  # unsorted in, 10 * 0.96 = 9.6
    assert stats.percentile(list(range(1, 102)), 99) == 100.0
    assert stats.percentile([0.25, 0.5], 90) == 0.475
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([3, 1, 2], 0) == 1 and stats.percentile([3, 1, 2], 100) == 3
    for bad in (99.9, -1, 101, True):
        with pytest.raises(ValueError):
            stats.percentile([1, 2], bad)
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    s = stats.summarise([3.0, 1.0, 2.0])
    assert (s.n, s.median, s.min, s.max, s.stdev) == (3, 2.0, 1.0, 3.0, 1.0)
    assert stats.summarise([]) is None


def test_paired_speedup_ci():
    same = stats.paired_speedup([2.0, 2.0, 2.0])
    assert same.ratio == pytest.approx(2.0) and same.low == pytest.approx(2.0)
    s = stats.paired_speedup([1.8, 2.0, 2.2, 2.1, 1.9])
    assert s.low < s.ratio < s.high and s.n == 5
    # By hand: logs' mean and sd, t(4) = 2.776.
    logs = [math.log(x) for x in (1.8, 2.0, 2.2, 2.1, 1.9)]
    m = sum(logs) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 4)
    assert s.high == pytest.approx(math.exp(m + 2.776 * sd / math.sqrt(5)))
    one = stats.paired_speedup([1.5])
    assert one.ratio == pytest.approx(1.5) and one.low is None
    assert stats.paired_speedup([]) is None
    assert stats.t975(1000) == 1.96 and stats.t975(35) == 2.042


def test_artifact_write_is_atomic(tmp_path):
    from appliance.bench import report

    target = tmp_path / "a.json"
    report.write_artifact(target, {"x": 1})
    assert json.loads(target.read_text()) == {"x": 1}

    class Boom:
        pass

    with pytest.raises(TypeError):
        report.write_artifact(target, {"x": Boom()})
    # The old artifact is intact and no temporary file is left behind.
    assert json.loads(target.read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "1,x"], "--concurrency wants integers"),
        (["--concurrency", "4,4"], "distinct integers"),
        (["--concurrency", "0"], "distinct integers"),
        (["--concurrency", "1", "--requests", "0"], "--requests must be at least 1"),
        (["--concurrency", "1", "--report", "r.html"], "No such option '--report'"),
    ],
)
def test_bad_load_input_is_one_line_before_any_server(tmp_path, args, message, cli_run):
    # The URL is a closed port: every refusal here comes before the first request.
    url = f"http://127.0.0.1:{free_port()}"
    res = cli_run(["bench", "load", "--url", url, *args], code=2)
    assert message in res.output
    assert res.output.startswith("Error: ") or res.output.startswith("Usage: ")
    assert not (tmp_path / "r.html").exists()


def _rec(tokens: int, drafts: int, pos: list[int], source: str = "request"):
    from appliance.bench.runner import RunRecord

    return RunRecord(
        label="e",
        prompt_set="s",
        prompt_id="p",
        max_tokens=tokens,
        run=0,
        ttft_s=0.1,
        tpot_s=0.01,
        e2el_s=0.1 + 0.01 * (tokens - 1),
        itl_s=[0.02] * 3,
        output_tokens=tokens,
        prompt_tokens=5,
        chunks=4,
        output_tps=1.0,
        output_sha256="",
        spec_source=source,
        spec_status="ok",
        drafts=drafts,
        draft_tokens=drafts * len(pos),
        accepted=sum(pos),
        accepted_per_pos=pos,
    )


def test_a_level_sums_its_requests_blocks_and_predicts_per_request():
    from appliance.bench.concurrency import LevelResult
    from appliance.engine_api import specdecode

    recs = [_rec(40, 10, [10, 10, 10]), _rec(40, 40, [0, 0, 0])]
    d = LevelResult(4, recs, 2.0, specdecode.Delta("ok", 1, 1, 1, (1, 1, 1))).to_dict()
    assert (d["requests"], d["output_tokens"], d["output_throughput_tps"]) == (2, 80, 40.0)
    assert d["prompt_tokens"] == 10  # usage's, summed: what vllm bench serve's total_input is
    assert d["spec_source"] == "request" and d["drafts"] == 50 and d["accepted"] == 30
    assert d["per_position"] == [0.2, 0.2, 0.2]
    assert d["predicted_tokens_per_step"] == pytest.approx([80 / 60, 80 / (40 / 3 + 40), 1.6])
    assert d["ttft_s"]["median"] == d["ttft_s"]["p99"] == pytest.approx(0.1)
    # Without per-request blocks the level's /metrics delta is its figure.
    shared = [_rec(40, 10, [10, 10, 10], "shared")]
    d = LevelResult(1, shared, 1.0, specdecode.Delta("ok", 8, 24, 12, (6, 4, 2))).to_dict()
    assert d["spec_source"] == "counters" and d["drafts"] == 8
    assert d["predicted_tokens_per_step"] == pytest.approx([1.75, 2.25, 2.5])


def test_a_level_whose_server_refuses_generations_is_one_engine_error(routed_http_server):
    """The level's async client raises what the sync one does. A fake server: a real vLLM
    generates; only something else on the port (or a broken proxy) answers POST with 501."""
    from plugins.http_servers import Route

    from appliance.bench import concurrency, runner
    from appliance.errors import EngineError

    url = routed_http_server({"/metrics/": Route(200, b"vllm:num_requests_running 0\n")})
    ep = runner.Endpoint("e", url, "m", None, "0.32.0", False)
    config = runner.BenchConfig(prompt_sets=tuple(prompts.resolve(limit=1)), warmups=0)
    with pytest.raises(EngineError, match=r"^.*/v1/chat/completions answered 501: "):
        concurrency.run_level(ep, config, 2, 2)


# --- vllm bench serve's names (issue 56 §4, E18) -----------------------------------------------


def _timed(ttft: float, tpot: float, tokens: int, itl: list[float], source: str = "request"):
    """A record whose E2EL is what its TTFT and TPOT make (vLLM derives TPOT from E2EL)."""
    rec = _rec(tokens, 4, [3, 2, 1], source)
    e2el = ttft + tpot * (tokens - 1)
    return dataclasses.replace(
        rec, ttft_s=ttft, tpot_s=tpot, e2el_s=e2el, itl_s=itl, prompt_tokens=7
    )


def test_bench_json_carries_vllm_bench_serve_fields_computed_as_vllm_computes_them():
    """Every bench record holds, beside the appliance's own figures, the same measurements under
    the names and units ``vllm bench serve --save-result`` writes; the values are checked against
    vLLM's own ``calculate_metrics`` on the same requests, the names against its source."""
    import inspect

    from vllm.benchmarks import serve
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    from appliance.bench import report, runner
    from appliance.bench.concurrency import ConcurrencyResult, LevelResult
    from appliance.engine_api import specdecode

    # Requests without blocks of their own: the level's figures are its /metrics delta.
    recs = [
        _timed(0.120, 0.010, 40, [0.03, 0.02, 0.05, 0.01], "shared"),
        _timed(0.080, 0.020, 17, [0.04, 0.06], "shared"),
        _timed(0.300, 0.005, 9, [0.02, 0.02, 0.03], "shared"),
    ]
    counters = specdecode.Delta("ok", 10, 30, 15, (7, 5, 3))
    level = LevelResult(4, recs, 2.5, counters)
    ep = runner.Endpoint("endpoint", "http://127.0.0.1:1", "m", 512, "0.32.0", True)
    config = runner.BenchConfig(prompt_sets=tuple(prompts.resolve(limit=1)), warmups=0)
    body = report.artifact(
        "concurrency", config, report.environment(), ConcurrencyResult(ep, [level])
    )
    ours = dict(body["concurrency"]["levels"][0]["vllm_bench_serve"])

    outputs = [
        RequestFuncOutput(
            success=True,
            latency=r.e2el_s,
            output_tokens=r.output_tokens,
            ttft=r.ttft_s,
            itl=r.itl_s,
            prompt_len=r.prompt_tokens,
        )
        for r in recs
    ]
    metrics, _ = serve.calculate_metrics([], outputs, 2.5, None, [99.0], {})
    want = {
        "duration": 2.5,
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            want[f"{stat}_{m}_ms"] = getattr(metrics, f"{stat}_{m}_ms")
        ((p, value),) = getattr(metrics, f"percentiles_{m}_ms")
        want[f"p{int(p)}_{m}_ms"] = value
    # vLLM's spec_decode_* from the same counters (vllm/benchmarks/serve.py, benchmark()).
    want |= {
        "spec_decode_acceptance_rate": 50.0,  # percent
        "spec_decode_acceptance_length": 2.5,  # 1 + accepted / drafts
        "spec_decode_num_drafts": 10,
        "spec_decode_draft_tokens": 30,
        "spec_decode_accepted_tokens": 15,
    }
    rates = ours.pop("spec_decode_per_position_acceptance_rates")
    assert rates == pytest.approx([0.7, 0.5, 0.3])
    assert ours == pytest.approx(want, rel=1e-12)  # the same keys, the *_ms ones vLLM's metrics'
    # benchmark() writes the other keys by their literal names.
    literal = [k for k in want if not k.endswith("_ms")]
    literal.append("spec_decode_per_position_acceptance_rates")
    source = inspect.getsource(serve)
    assert [k for k in literal if f'"{k}"' not in source] == []
    # The appliance's own names stay, in their units, beside vLLM's.
    level_dict = body["concurrency"]["levels"][0]
    assert level_dict["ttft_s"]["median"] * 1000 == pytest.approx(ours["median_ttft_ms"])
    assert level_dict["acceptance"] * 100 == pytest.approx(ours["spec_decode_acceptance_rate"])
    assert "vllm_bench_serve" in body["definitions"]


def test_bench_run_json_carries_vllm_names_per_group_and_run_without_a_throughput():
    """A single-endpoint bench sends one request at a time between /metrics reads: its latencies
    are vLLM's figures, but it has no benchmark duration, so no throughput under vLLM's names."""
    from appliance.bench import runner
    from appliance.engine_api import specdecode

    recs = [_timed(0.1, 0.01, 20, [0.02, 0.03]), _timed(0.2, 0.02, 10, [0.05])]
    recs = [dataclasses.replace(r, max_tokens=64) for r in recs]  # one group
    ep = runner.Endpoint("endpoint", "http://127.0.0.1:1", "m", 512, "0.32.0", True)
    counters = specdecode.Delta("ok", 50, 150, 20, (10, 6, 4))  # others' requests in it too
    d = runner.EndpointResult(ep, recs, counters).to_dict()
    run, (group,) = d["vllm_bench_serve"], d["groups"]
    assert run == group["vllm_bench_serve"]  # one group: the same requests
    assert run["completed"] == 2 and run["total_output_tokens"] == 30
    assert run["p99_ttft_ms"] == pytest.approx(199.0)
    assert run["spec_decode_num_drafts"] == 8  # the requests' own blocks, summed
    assert run["spec_decode_acceptance_rate"] == pytest.approx(100 * 12 / 24)
    assert not {"duration", "request_throughput", "output_throughput"} & set(run)
