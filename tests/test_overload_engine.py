"""Overload, and a k schedule read back, against a real CPU engine of their own (issue 46).

A burst several times what the engine holds: the excess is turned away with vLLM's 503 while
the requests let in wait, every request let in is answered in full, nothing hangs past its
deadline, and the engine serves afterwards. The agent marks a turned-away call and counts it;
``bench --concurrency`` counts rejections per level. ``tune --verify`` reads the engine's
per-batch-size k schedule back from its draft counters.

The bound and the schedule are set at start (``--max-num-queued-reqs``, the speculative
config), so these tests start one engine of their own: ``max_num_seqs`` 2, the profile's derived
bound of 4, and k=2 with the schedule [[1, 1, 1], [2, 2, 2]] (one draft token alone, two in a
pair). The CPU build runs the V1 model runner, which hands the scheduler's k to the Gemma 4
drafter every step (``propose(num_speculative_tokens=...)`` in
vllm/v1/worker/gpu_model_runner.py, read by vllm/v1/spec_decode/llm_base_proposer.py).

Which requests vLLM lets in depends on when each arrives against when earlier ones finish; to
make the count exact, the engine's scheduler is held (vLLM's own dev-mode ``POST
/pause?mode=keep``, which keeps the requests let in waiting and runs nothing,
vllm/entrypoints/rl/online/api_router.py) while the burst arrives, then released. A second burst
runs unheld, as traffic does, and prints its figures.

The judges of an engine (``instance doctor``, ``canary record``, the cutover's generation and MTP
gates, which its way back runs too) pass this good engine while it sheds load: held, with its
bound full of clients' requests, it turns their probes away until it is released and a place
frees; each sends its probe again (appliance/engine_api/shed.py) and reports exactly as many shed as
vLLM counted (review 2026-12-06-security-and-reliability.md T1: before, each failed on the first
503).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

from appliance import agent, profiles
from appliance.bench import concurrency, prompts, report, runner, schedule, tune
from appliance.cutover import gates
from appliance.engine import local
from appliance.engine_api import probe, specdecode
from appliance.engine_api.vllm_client import Generation, VLLMClient
from appliance.errors import OverloadedError

pytestmark = [pytest.mark.engine, pytest.mark.own_engines]

SEQS = 2
BOUND = profiles.QUEUE_PER_SEQUENCE * SEQS  # what the profile derives: 4 requests in flight
BURST = 4 * BOUND
MAX_TOKENS = 48
# The most any request may take, answered or turned away: a hung one fails the test here.
DEADLINE_S = 120.0
PROMPT = "Tell me about the sea."
BUSY = "The engine is currently busy and cannot accept new requests."  # vllm/exceptions.py
T = TypeVar("T")


SCHEDULE = ((1, 1, 1), (2, SEQS, 2))


def scheduled() -> profiles.Profile:
    """cpu-tiny-mtp with the schedule: what ``appliance tune --write`` would make of it."""
    base = profiles.get("cpu-tiny-mtp")
    spec = dataclasses.replace(base.speculative, num_speculative_tokens_per_batch_size=SCHEDULE)
    return dataclasses.replace(base, name="cpu-tiny-mtp-scheduled", speculative=spec)


@pytest.fixture(scope="module")
def bounded() -> Iterator[local.LocalEngine]:
    base = scheduled()
    prof = dataclasses.replace(
        base,
        name="cpu-tiny-mtp-bounded",
        max_num_seqs=SEQS,
        # As the session engines (tests/conftest.py): a small KV cache, beside other engines.
        env={k: v for k, v in base.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
    )
    assert prof.queue_bound == BOUND
    with local.serve(
        prof,
        extra_args=["--kv-cache-memory-bytes", str(64 << 20)],
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /pause and /resume
        timeout=900,
    ) as engine:
        yield engine


@contextlib.contextmanager
def held(url: str) -> Iterator[None]:
    """The engine's scheduler held: requests let in wait, none runs, until the block ends."""
    httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
    try:
        yield
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()


def _ask(client: VLLMClient) -> Generation | OverloadedError:
    try:
        return client.generate("gemma4-tiny", PROMPT, MAX_TOKENS, timeout=DEADLINE_S)
    except OverloadedError as exc:
        return exc


def _rejections(url: str) -> float:
    """vLLM's own count of requests turned away at the bound (vllm/v1/metrics/loggers.py)."""
    text = VLLMClient(url).metrics_text()
    (line,) = [
        ln
        for ln in text.splitlines()
        if ln.startswith("vllm:admission_rejections_total") and "max_num_queued_reqs" in ln
    ]
    return float(line.rsplit(" ", 1)[1])


def _first_done(futures, count: int) -> set:
    """Wait (up to the deadline) until ``count`` of ``futures`` are done; those done."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        done = {f for f in futures if f.done()}
        if len(done) >= count or time.monotonic() > deadline:
            return done
        concurrent.futures.wait(futures - done, timeout=1, return_when="FIRST_COMPLETED")


def test_a_burst_past_the_bound_is_turned_away_at_once_and_loses_nothing(bounded):
    url = bounded.url
    with VLLMClient(url, timeout=DEADLINE_S) as client:
        alone = client.generate("gemma4-tiny", PROMPT, MAX_TOKENS)
        assert (alone.completion_tokens, alone.finish_reason) == (MAX_TOKENS, "length")
        rejected_before = _rejections(url)
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            # Held: the bound's worth is let in and waits; only the excess can finish now.
            with held(url):
                futures = {pool.submit(_ask, client) for _ in range(BURST)}
                early = _first_done(futures, BURST - BOUND)
                assert len(early) == BURST - BOUND, f"only {len(early)} answered while held"
                turned_away = [f.result() for f in early]
            let_in = [f.result(timeout=DEADLINE_S) for f in futures - early]
        # Unheld, as traffic arrives: the same burst; which requests get in is the engine's.
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            started = time.perf_counter()
            free = list(pool.map(lambda _: _ask(client), range(BURST), timeout=DEADLINE_S))
            burst_s = time.perf_counter() - started
        after = client.generate("gemma4-tiny", PROMPT, MAX_TOKENS)
        assert client.health()
    # Held: exactly the excess was turned away, with vLLM's 503, and the rest answered in full.
    assert all(isinstance(r, OverloadedError) and BUSY in r.message for r in turned_away)
    assert len(let_in) == BOUND
    for r in let_in:
        assert isinstance(r, Generation), r
        assert (r.completion_tokens, r.finish_reason, r.text) == (
            MAX_TOKENS,
            "length",
            alone.text,
        )
    # Unheld: every request is answered in full or turned away; never fewer let in than the
    # bound, and none lost in between.
    answered = [r for r in free if isinstance(r, Generation)]
    refused = [r for r in free if isinstance(r, OverloadedError)]
    assert len(answered) + len(refused) == BURST and len(answered) >= BOUND
    assert all(r.text == alone.text and r.completion_tokens == MAX_TOKENS for r in answered)
    assert all(BUSY in r.message for r in refused)
    # vLLM counted each one it turned away; the engine still answers as before.
    assert _rejections(url) - rejected_before == len(turned_away) + len(refused)
    assert after.text == alone.text
    latencies = sorted(r.seconds for r in answered)
    print(
        f"\noverload (bound {BOUND}, burst {BURST}): held: {len(let_in)} answered, "
        f"{len(turned_away)} turned away in at most "
        f"{max(r.seconds for r in turned_away):.2f} s; unheld: {len(answered)} answered "
        f"(p99 {latencies[-1]:.2f} s, median {statistics.median(latencies):.2f} s), "
        f"{len(refused)} turned away in at most "
        f"{max((r.seconds for r in refused), default=0.0):.2f} s, burst {burst_s:.2f} s"
    )


def test_the_agent_marks_a_turned_away_call_and_counts_it(bounded):
    """Calls through the agent, streamed and not, two more than the bound, at once: the two
    turned away are marked on their spans and counted as ``rejected``. A streamed call turned
    away after its response started ends with vLLM's error event instead of a 503 status
    (vllm#58192); the agent reads the status from either."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    records: list[agent.CallRecord] = []
    bare = openai.OpenAI(base_url=bounded.url + "/v1", api_key="unused", max_retries=0)
    client = agent.instrument(
        bare, role="batch", tracer_provider=provider, registry=registry, on_call=records.append
    )

    def call(stream: bool):
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        messages = [{"role": "user", "content": PROMPT}]
        try:
            out = client.chat.completions.create(
                model="gemma4-tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kw
            )
            return list(out) if stream else out
        except openai.APIError as exc:  # the SDK's own error, unchanged by the agent
            return exc

    calls = BOUND + 2
    with concurrent.futures.ThreadPoolExecutor(calls) as pool:
        with held(bounded.url):
            futures = {pool.submit(call, i % 2 == 0) for i in range(calls)}
            early = _first_done(futures, calls - BOUND)
            assert len(early) == calls - BOUND, f"only {len(early)} answered while held"
        answers = [f.result(timeout=DEADLINE_S) for f in futures]
    refused = [a for a in answers if isinstance(a, openai.APIError)]
    assert len(refused) == calls - BOUND and all(f.result() in refused for f in early)
    assert agent.flush(30)
    spans = exporter.get_finished_spans()
    rejected = [s for s in spans if s.status.status_code == StatusCode.ERROR]
    assert len(rejected) == calls - BOUND
    for span in rejected:
        assert span.attributes["error.type"] == "503"
        assert span.attributes["http.response.status_code"] == 503
        assert span.status.description == "rejected: the engine's queue is full (HTTP 503)"
    assert sorted(r.outcome for r in records) == ["ok"] * BOUND + ["rejected"] * (calls - BOUND)
    count = registry.get_sample_value
    labels = {"role": "batch", "model": "gemma4-tiny", "source": "unknown"}
    assert count("gemma4_agent_calls_total", labels | {"outcome": "rejected"}) == calls - BOUND
    assert count("gemma4_agent_calls_total", labels | {"outcome": "error"}) is None


def test_bench_counts_the_requests_turned_away_per_level(bounded):
    ep = runner.open_endpoint(bounded.url, "endpoint")  # its probe runs before the hold
    config = runner.BenchConfig(
        tuple(prompts.resolve(["prose"], (), 1)), (MAX_TOKENS,), runs=1, warmups=0
    )
    level = 2 * BOUND
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        rejected_before = _rejections(bounded.url)
        with held(bounded.url):
            run = pool.submit(concurrency.run_level, ep, config, level, level)
            deadline = time.monotonic() + DEADLINE_S
            # The level's excess turned away (vLLM's counter says so), its bound's worth held.
            while _rejections(bounded.url) - rejected_before < level - BOUND:
                assert time.monotonic() < deadline and not run.done(), "no rejections counted"
                time.sleep(0.2)
        result = run.result(timeout=DEADLINE_S)
    d = result.to_dict()
    assert (d["requests"], d["rejected"], d["output_tokens"]) == (
        BOUND,
        level - BOUND,
        BOUND * MAX_TOKENS,
    )
    assert d["time_to_rejection_s"]["n"] == level - BOUND
    table = report.markdown("concurrency", concurrency.ConcurrencyResult(ep, [result]))
    assert f"| {level} | {BOUND} | {level - BOUND} | {BOUND * MAX_TOKENS} |" in table


def _while_shed(url: str, judge: Callable[[], T]) -> tuple[T, int]:
    """``judge()``, run while the engine sheds load: its scheduler held, the bound full of
    clients' requests (two clients more turned away), and released once vLLM has turned away
    two of ``judge``'s probes (or ``judge`` ended). Returns what ``judge`` returned and how many
    requests vLLM turned away from its start: every one of them ``judge``'s, as no client sends
    again. The held clients are answered in full."""
    with (
        VLLMClient(url, timeout=DEADLINE_S) as client,
        concurrent.futures.ThreadPoolExecutor(BOUND + 3) as pool,
    ):
        with held(url):
            clients = {pool.submit(_ask, client) for _ in range(BOUND + 2)}
            early = _first_done(clients, 2)
            assert len(early) == 2, f"only {len(early)} clients turned away while held"
            assert all(isinstance(f.result(), OverloadedError) for f in early)
            before = _rejections(url)
            run = pool.submit(judge)
            deadline = time.monotonic() + DEADLINE_S
            while _rejections(url) - before < 2 and not run.done():
                assert time.monotonic() < deadline, "the probe never reached the engine"
                time.sleep(0.2)
        result = run.result(timeout=DEADLINE_S)
        answered = [f.result(timeout=DEADLINE_S) for f in clients - early]
    assert all(isinstance(g, Generation) and g.completion_tokens == MAX_TOKENS for g in answered)
    return result, int(_rejections(url) - before)


def _appliance(*argv: str) -> subprocess.CompletedProcess:
    """The ``appliance`` command itself, as an operator runs it (a process of its own)."""
    exe = Path(sys.executable).parent / "appliance"
    return subprocess.run(
        [str(exe), *argv], capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )


def test_doctor_passes_a_good_engine_that_sheds_its_probe(bounded):
    """Review T1: an engine at its queue bound turned doctor's test generation away (503) and
    doctor failed 3 of 3 on a good engine. It sends the probe again and says how often."""
    res, turned_away = _while_shed(
        bounded.url, lambda: _appliance("instance", "doctor", "--url", bounded.url, "--json")
    )
    assert res.returncode == 0, res.stdout + res.stderr
    check = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "mtp.counters")
    assert turned_away >= 2 and check["evidence"]["shed"] == turned_away
    assert check["status"] == "ok" and check["evidence"]["state"] == "active"
    assert check["summary"].endswith(f"; {turned_away} probes shed at the queue bound")
    print(f"\ndoctor at the bound: {check['summary']}")


def test_canary_record_passes_a_good_engine_that_sheds_its_prompts(bounded, tmp_path):
    out = tmp_path / "record.json"
    args = ("canary", "record", "--url", bounded.url, "--out", str(out), "--max-tokens", "8")
    res, turned_away = _while_shed(bounded.url, lambda: _appliance(*args))
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads(out.read_text())
    assert turned_away >= 2 and record["shed"] == turned_away
    assert all(o["completion_tokens"] == 8 for o in record["outputs"])
    assert f"; {turned_away} prompts shed at the queue bound and sent again" in res.stdout
    assert "1 prompt shed at the queue bound, trying again" in res.stderr  # said as it waits
    print(f"\ncanary record at the bound: {res.stdout.strip()}")


def test_the_generation_gate_passes_a_good_engine_that_sheds_its_probe(bounded):
    """The cutover's generation and MTP gates (and its way back's: the same gates)."""
    expect = gates.Expect(
        unit="gemma4-vllm@bounded.service",
        base_url=bounded.url,
        served_model="gemma4-tiny",
        mtp=True,
    )
    with VLLMClient(bounded.url, timeout=DEADLINE_S) as client:
        (p, outcomes), turned_away = _while_shed(
            bounded.url, lambda: gates.probe_gates(client, expect, DEADLINE_S)
        )
    assert turned_away >= 2 and p.shed == turned_away
    assert [(n, ok) for n, ok, _ in outcomes] == [("generation", True), ("mtp", True)], outcomes
    assert outcomes[0][2] == (
        f"{probe.MAX_TOKENS} tokens; {turned_away} probes shed at the queue bound"
    )
    print(f"\ngates at the bound: {outcomes}")


def test_tune_verify_reads_the_schedule_back_from_the_draft_counters(bounded, tmp_path, cli_run):
    prof = scheduled()
    path = tmp_path / "scheduled.toml"
    path.write_text(tune.with_schedule_text(profiles.shipped_text("cpu-tiny-mtp"), prof))
    args = ["bench", "tune", "--url", bounded.url, "--profile", str(path), "--verify", "--json"]
    args += ["--concurrency", "1", "--requests", "2", "--limit", "1", "--max-tokens", "32"]
    res = cli_run(args)
    (alone,) = json.loads(res.stdout)["levels"]
    # Alone the schedule says k=1 (k=2 unscheduled): every draft was one token.
    assert (alone["verdict"], alone["k_at"], alone["drafted_per_step"]) == ("follows", 1, 1.0)
    # The control: the same engine drafts two tokens a step in a pair (both held, then run
    # together from their first step), as the schedule says there; so one alone is the schedule
    # at work, not a drafter that only ever drafts one.
    with VLLMClient(bounded.url, timeout=DEADLINE_S) as client:
        before = client.snapshot()
        with concurrent.futures.ThreadPoolExecutor(SEQS) as pool:
            with held(bounded.url):
                pair = [pool.submit(_ask, client) for _ in range(SEQS)]
            assert all(isinstance(f.result(timeout=DEADLINE_S), Generation) for f in pair)
        moved = specdecode.delta(before, client.snapshot())
    check = schedule.check_schedule(moved, SEQS, k=2, k_at=2, k_most=2)
    assert (check.verdict, check.drafted_per_step) == ("unchanged", 2.0)
    print(f"\ntune --verify: {alone}; a pair: {check.summary()}")
