"""The agent's parts that need no engine: settings, names, attribution rules on real captures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as g
from opentelemetry.semconv.attributes import error_attributes, http_attributes, server_attributes
from prometheus_client import CollectorRegistry

from appliance.agent import AgentConfig, build_registry, metrics, rules, spans, tracing
from appliance.agent.server import RESTART_MAX_S, RESTART_MIN_S, Server, Window
from appliance.agent.worker import Worker
from appliance.engine_api import metrics_reader, specdecode
from appliance.errors import UsageError
from appliance.observability import names as series

CAPTURE = (Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp.txt").read_text()


def test_registry_has_exactly_the_contract_names():
    reg = build_registry()
    names = {fam.name for fam in reg.collect()}
    # The names the dashboards and rules read (the contract); prometheus-client reports counter
    # families without ``_total``.
    contract = [v.metric for k, v in vars(series).items() if k.startswith("AGENT_")]
    assert len(contract) == 7
    expected = {n.removesuffix("_total") for n in contract}
    assert names == expected
    samples = {s.name for fam in build_registry().collect() for s in fam.samples}
    assert samples == set()  # labelled metrics have no samples until used


def test_contract_buckets():
    # Both edges measurable (near 0 and near 1), the middle in tenths.
    assert metrics.ACCEPTANCE_BUCKETS == (
        0.01,
        0.05,
        0.1,
        0.2,
        0.3,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        0.95,
        0.99,
        1.0,
    )
    assert metrics.TOKENS_PER_STEP_BUCKETS[0] == 1.0 and metrics.TOKENS_PER_STEP_BUCKETS[-1] == 9.0
    assert metrics.TOKENS_PER_STEP_BUCKETS[1] == 1.25


def test_removed_helpers_stay_removed():
    # One name per figure: vLLM's ``draft_tokens`` everywhere, no dead aliases.
    assert not hasattr(metrics, "SOURCES") and not hasattr(metrics, "EXACT_SOURCES")
    assert "draft_tokens" in rules.Figures.__dataclass_fields__
    assert "drafted" not in rules.Figures.__dataclass_fields__
    assert spans.MTP_DRAFT_TOKENS == "vllm.spec_decode.num_draft_tokens"
    assert spans.MTP_OLD[spans.MTP_DRAFT_TOKENS] == "gen_ai.vllm.mtp.draft_tokens"


def test_mtp_attributes_are_vllm_spec_decode_and_the_old_names_for_one_release():
    """Provider-specific names stay out of ``gen_ai.`` (the conventions' direction, E7): each
    figure is ``vllm.spec_decode.*`` and, for this release, also its old ``gen_ai.vllm.mtp.*``
    name with the same value (ADR 0020)."""
    d = specdecode.from_response_metrics(
        {
            "metrics": {
                "speculative_decoding": {
                    "num_spec_steps": 3,
                    "num_draft_tokens": 6,
                    "num_accepted_draft_tokens": 4,
                    "num_spec_tokens": 2,
                    "per_step_accepted": [2, 1, 1],
                }
            }
        }
    )
    attrs = spans.figures_attributes(rules.Figures.from_delta(d, "request"))
    new = {k: v for k, v in attrs.items() if k.startswith("vllm.spec_decode.")}
    old = {k: v for k, v in attrs.items() if k.startswith("gen_ai.vllm.mtp.")}
    assert len(new) == len(old) == 9 and len(attrs) == 18
    assert {spans.MTP_OLD[k]: v for k, v in new.items()} == old
    assert new == {
        "vllm.spec_decode.source": "request",
        "vllm.spec_decode.shared": False,
        "vllm.spec_decode.status": "ok",
        "vllm.spec_decode.num_drafts": 3,
        "vllm.spec_decode.num_draft_tokens": 6,
        "vllm.spec_decode.num_accepted_tokens": 4,
        "vllm.spec_decode.acceptance_rate": 4 / 6,
        "vllm.spec_decode.acceptance_length": 1 + 4 / 3,
        "vllm.spec_decode.per_position_acceptance_rate": [1.0, 1 / 3],
    }


def test_pinned_semconv_names_match_the_package():
    pairs = [
        (spans.GEN_AI_OPERATION_NAME, g.GEN_AI_OPERATION_NAME),
        (spans.GEN_AI_PROVIDER_NAME, g.GEN_AI_PROVIDER_NAME),
        (spans.GEN_AI_REQUEST_MODEL, g.GEN_AI_REQUEST_MODEL),
        (spans.GEN_AI_REQUEST_MAX_TOKENS, g.GEN_AI_REQUEST_MAX_TOKENS),
        (spans.GEN_AI_REQUEST_TEMPERATURE, g.GEN_AI_REQUEST_TEMPERATURE),
        (spans.GEN_AI_REQUEST_TOP_P, g.GEN_AI_REQUEST_TOP_P),
        (spans.GEN_AI_REQUEST_TOP_K, g.GEN_AI_REQUEST_TOP_K),
        (spans.GEN_AI_REQUEST_STOP_SEQUENCES, g.GEN_AI_REQUEST_STOP_SEQUENCES),
        (spans.GEN_AI_REQUEST_STREAM, g.GEN_AI_REQUEST_STREAM),
        (spans.GEN_AI_RESPONSE_MODEL, g.GEN_AI_RESPONSE_MODEL),
        (spans.GEN_AI_RESPONSE_ID, g.GEN_AI_RESPONSE_ID),
        (spans.GEN_AI_RESPONSE_FINISH_REASONS, g.GEN_AI_RESPONSE_FINISH_REASONS),
        (spans.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, g.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK),
        (spans.GEN_AI_USAGE_INPUT_TOKENS, g.GEN_AI_USAGE_INPUT_TOKENS),
        (spans.GEN_AI_USAGE_OUTPUT_TOKENS, g.GEN_AI_USAGE_OUTPUT_TOKENS),
        (spans.GEN_AI_INPUT_MESSAGES, g.GEN_AI_INPUT_MESSAGES),
        (spans.GEN_AI_OUTPUT_MESSAGES, g.GEN_AI_OUTPUT_MESSAGES),
        (spans.SERVER_ADDRESS, server_attributes.SERVER_ADDRESS),
        (spans.SERVER_PORT, server_attributes.SERVER_PORT),
        (spans.ERROR_TYPE, error_attributes.ERROR_TYPE),
        (spans.HTTP_RESPONSE_STATUS_CODE, http_attributes.HTTP_RESPONSE_STATUS_CODE),
    ]
    for ours, theirs in pairs:
        assert ours == theirs


def test_config_from_env():
    cfg = AgentConfig.from_env(
        {
            "APPLIANCE_AGENT_ATTRIBUTION": "counters",
            "APPLIANCE_AGENT_SNAPSHOT_TIMEOUT": "0.1",
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true",
        }
    )
    assert (cfg.attribution, cfg.snapshot_timeout, cfg.capture_content) == ("counters", 0.1, True)
    assert AgentConfig.from_env({}).capture_content is False
    # Built directly (code, not the environment), bad values are still a usage error.
    with pytest.raises(UsageError):
        AgentConfig(attribution="guess")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        AgentConfig(snapshot_timeout=0)


@pytest.mark.parametrize(
    "var,value",
    [
        ("APPLIANCE_AGENT_ATTRIBUTION", "guess"),
        ("APPLIANCE_AGENT_SNAPSHOT_TIMEOUT", "soon"),
        ("APPLIANCE_AGENT_SNAPSHOT_TIMEOUT", "-1"),
        ("APPLIANCE_AGENT_FAILURE_COOLDOWN", "nan"),
    ],
)
def test_malformed_setting_is_logged_once_and_the_default_used(var, value, monkeypatch, caplog):
    import openai

    from appliance import agent

    monkeypatch.setenv(var, value)
    monkeypatch.setenv("APPLIANCE_AGENT_METRICS_URL", "http://127.0.0.1:9")
    caplog.set_level("WARNING", logger="appliance.agent")
    bare = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
    # instrument() reads the environment: a telemetry setting must not stop the application.
    clients = [agent.instrument(bare, registry=CollectorRegistry()) for _ in range(3)]
    assert all(isinstance(c, openai.OpenAI) for c in clients)
    cfg = AgentConfig.from_env()
    default = AgentConfig()
    field = {
        "APPLIANCE_AGENT_ATTRIBUTION": "attribution",
        "APPLIANCE_AGENT_SNAPSHOT_TIMEOUT": "snapshot_timeout",
        "APPLIANCE_AGENT_FAILURE_COOLDOWN": "failure_cooldown",
    }[var]
    assert getattr(cfg, field) == getattr(default, field)
    assert cfg.metrics_url == "http://127.0.0.1:9"  # the good settings still apply
    warnings = [r for r in caplog.records if var in r.getMessage()]
    assert len(warnings) == 1 and value in warnings[0].getMessage()


def test_tracing_from_otel_env(monkeypatch):
    assert not tracing.exporting({})
    assert tracing.exporting({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.exporting(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"}
    )
    # The resource is the SDK's reading of the process's environment.
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "a=1,b=2")
    p = tracing.setup_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    attrs = dict(p.resource.attributes)
    assert (attrs["service.name"], attrs["a"], attrs["b"]) == ("svc", "1", "2")
    p.shutdown()
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    p = tracing.setup_tracing({"OTEL_TRACES_EXPORTER": "none"})
    assert p.resource.attributes["service.name"] == tracing.DEFAULT_SERVICE
    p.shutdown()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=mine")  # the variable's wins
    p = tracing.setup_tracing({"OTEL_TRACES_EXPORTER": "none"})
    assert p.resource.attributes["service.name"] == "mine"
    p.shutdown()
    assert tracing._endpoint(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318/"}, "http/protobuf"
    ) == {"endpoint": "http://h:4318/v1/traces"}
    with pytest.raises(UsageError):
        tracing.setup_tracing({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


_EXITS_WITH_A_SPAN = """
from appliance import agent
provider = agent.setup_tracing()
provider.get_tracer("t").start_span("last").end()
print("span ended", flush=True)
"""


def test_a_process_exits_while_its_collector_never_answers():
    """The collector takes the connection and never answers, and the exporter would wait 10
    minutes for it (its timeout, set so). The exit flush gives up after EXIT_EXPORT_S and says
    so: the export cannot have finished, so the line is there whatever the host's load. (The
    SDK's own exit waited 30 s here, and said nothing.)"""
    with socket.socket() as collector:
        collector.bind(("127.0.0.1", 0))
        collector.listen()
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.getsockname()[1]}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "600",
        }
        proc = subprocess.run(
            [sys.executable, "-c", _EXITS_WITH_A_SPAN],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,  # only a hang fails here: the line below is what proves the bound
            cwd=Path(__file__).resolve().parents[1],
        )
        conn, _ = collector.accept()  # the export did reach it, and was left hanging
        conn.close()
    assert (proc.returncode, proc.stdout) == (0, "span ended\n"), proc.stderr
    assert proc.stderr == (
        "exiting without the last spans: the collector took no export within "
        f"{tracing.EXIT_EXPORT_S:.1f} s\n"
    )


def _with(text: str, **changes: str) -> str:
    """The real capture with some sample values replaced (``name{labels}`` prefix -> value)."""
    out = []
    for line in text.splitlines():
        for prefix, value in changes.items():
            if line.startswith((prefix + "{", prefix + " ", prefix + ",")):
                line = line.rsplit(" ", 1)[0] + " " + value
        out.append(line)
    return "\n".join(out) + "\n"


def _timed(text: str, sent: float, got: float | None = None) -> rules.Timed:
    reading = metrics_reader.parse(200, text.encode())
    return rules.Timed(reading, sent, sent + 0.001 if got is None else got)


def test_snapshot_rules_on_the_real_capture():
    # The capture: 1 finished request, 64 generation tokens, nothing running.
    before = _timed(CAPTURE, 1.0)
    moved_text = _with(
        CAPTURE,
        **{
            "vllm:spec_decode_num_drafts_total": "31.0",
            "vllm:spec_decode_num_draft_tokens_total": "62.0",
            "vllm:spec_decode_num_accepted_tokens_total": "62.0",
            "vllm:generation_tokens_total": "88.0",
            'vllm:request_success_total{engine="0",finished_reason="length"': "2.0",
        },
    )
    moved = _timed(moved_text, 3.0)
    b = before.reading.snapshot.total()
    assert before.reading.generation_tokens == 64 and before.reading.finished_requests == 1
    assert moved.reading.generation_tokens == 88 and moved.reading.finished_requests == 2

    def fig(bef, aft, *, model="gemma4-tiny", overlapped=False, out=24):
        return rules.from_readings(bef, aft, model, overlapped=overlapped, output_tokens=out)

    exact = fig(before, moved)
    assert exact.source == "counters" and exact.drafts == 31 - b.drafts
    assert exact.draft_tokens == 62 - b.draft_tokens
    # Each part of the proof, broken alone, makes the call shared:
    assert fig(before, moved, overlapped=True).source == "shared"  # another call of ours
    assert fig(before, moved, out=23).source == "shared"  # someone else's tokens in the window
    # With usage, a request running at the after-read does not matter: with a token inside the
    # window it would have moved the token counter (out=23 above); without one it drafted none.
    busy = _timed(_with(moved_text, **{"vllm:num_requests_running": "1.0"}), 3.0)
    assert fig(before, busy).source == "counters"
    assert fig(before, busy, out=None).shared  # without usage it does
    two = _timed(
        _with(
            moved_text, **{'vllm:request_success_total{engine="0",finished_reason="stop"': "1.0"}
        ),
        3.0,
    )
    assert fig(before, two).shared  # another request finished inside the window
    # Without usage, nothing may be running at the before-read either.
    assert fig(before, moved, out=None).source == "counters"
    idle_busy = _timed(_with(CAPTURE, **{"vllm:num_requests_running": "1.0"}), 1.0)
    assert fig(idle_busy, moved, out=None).shared
    # A model name the server does not know still uses the server's counters.
    assert fig(before, moved, model="alias").source == "counters"
    assert fig(moved, before).status == "reset"
    assert fig(None, moved).source == "unknown"
    no_spec = _timed('vllm:num_requests_running{engine="0"} 0.0\n', 1.0)
    assert fig(no_spec, no_spec).source == "absent"


def test_the_reading_before_a_call_was_complete_before_its_request_went_out():
    srv = Server("http://127.0.0.1:9/metrics/")
    reading = metrics_reader.parse(200, CAPTURE.encode())
    srv.record(reading, sent=reading.at - 0.002)
    w = srv.begin()
    w.sent = reading.at - 0.001  # the call went out while that read was still in flight
    assert srv.before(w) is None
    w.sent = reading.at + 0.001
    assert srv.before(w).reading is reading
    # A later read still in flight when the call went out is not a candidate.
    import dataclasses

    srv.record(dataclasses.replace(reading, at=w.sent + 0.01), sent=w.sent - 0.0005)
    assert srv.before(w).reading is reading


def _seq(text: str, tokens: float, finished: float) -> str:
    return _with(
        text,
        **{
            "vllm:generation_tokens_total": str(tokens),
            'vllm:request_success_total{engine="0",finished_reason="length"': str(finished),
        },
    )


def test_a_certified_after_read_is_the_next_calls_before_even_while_in_flight():
    # Back to back: call 1 ends at t=2.0, its after-read R1 is sent at 2.01 but only complete at
    # 2.5; call 2 went out at 2.1, while R1 was in flight. R1 is the next call's before-reading
    # only once call 1's proof showed R1 holds no other request's tokens.
    srv = Server("http://127.0.0.1:9/metrics/")

    def rec(text, sent):
        return srv.record(metrics_reader.parse(200, text.encode()), sent=sent)

    # R0: 64 tokens, 1 request finished (the capture), complete at ~1.0.
    r0 = srv.record(metrics_reader.parse(200, CAPTURE.encode()), sent=0.9)
    r0.got = r0.clean_from = 1.0
    call1 = srv.begin()
    call1.sent, call1.finished, call1.tokens = 1.5, 2.0, 24
    srv.end(call1)
    assert srv.before(call1) is r0
    r1 = rec(_seq(CAPTURE, 88, 2), 2.01)
    r1.got = r1.clean_from = 2.5
    call2 = srv.begin()
    call2.sent = 2.1
    # Not certified yet: R1 was still in flight when call 2 went out; only R0 qualifies.
    assert srv.before(call2) is r0
    fig1 = rules.from_readings(r0, r1, "gemma4-tiny", overlapped=False, output_tokens=24)
    assert fig1.source == "counters"
    assert srv.certify(r0, r1)
    assert r1.clean_from == 2.0  # nothing sent after call 1's end is in R1
    assert srv.before(call2) is r1
    # Call 2's own proof, from the certified R1 (running there may be call 2 itself).
    call2.finished, call2.tokens = 3.0, 24
    srv.end(call2)
    r2 = rec(_seq(CAPTURE, 112, 3), 3.01)
    r1_busy = rules.Timed(
        metrics_reader.parse(200, _with(_seq(CAPTURE, 88, 2), **{RUN: "1.0"}).encode()), 2.01, 2.5
    )
    r1_busy.clean_from = 2.0
    assert (
        rules.from_readings(r1_busy, r2, None, overlapped=False, output_tokens=24).source
        == "counters"
    )
    # Foreign tokens in call 1's window: no proof, no certificate; R1 stays "complete at 2.5".
    srv2 = Server("http://127.0.0.1:9/metrics/")
    f1 = rules.Timed(metrics_reader.parse(200, _seq(CAPTURE, 95, 2).encode()), 2.01, 2.5)
    assert rules.from_readings(r0, f1, None, overlapped=False, output_tokens=24).source == "shared"
    own = srv2.begin()  # call 1 again, as srv2 saw it
    own.sent, own.finished, own.tokens = 1.5, 2.0, 24
    srv2.end(own)
    assert not srv2.certify(r0, f1) and f1.clean_from == 2.5
    s0, s1 = srv2.record(r0.reading, 0.9), srv2.record(f1.reading, 2.01)
    s0.got = s0.clean_from = 1.0
    s1.got = s1.clean_from = 2.5
    assert srv2.before(call2) is s0  # a window holding both calls: shared at its end


RUN = "vllm:num_requests_running"


def test_windows_are_identities_and_end_once():
    srv = Server("http://127.0.0.1:9/metrics/")
    first, second = srv.begin(), srv.begin()
    assert first.overlapped and second.overlapped  # equal by value, never the same window
    # The old code ended each call's window twice, removing a concurrent call's equal window.
    srv.end(second)
    srv.end(second)
    third = srv.begin()
    assert third.overlapped  # ``first`` is still in flight
    srv.end(first)
    srv.end(third)
    assert srv.in_flight() == 0 and not srv.begin().overlapped


def test_error_text_is_recorded_only_with_content_capture():
    from opentelemetry.sdk.trace import TracerProvider

    span = TracerProvider().get_tracer("t").start_span("s")
    exc = ValueError("the prompt was: my secret text")
    spans.set_error(span, exc, capture_content=False)
    assert "secret" not in span.status.description and span.status.description == "ValueError"
    spans.set_error(span, exc, capture_content=True)
    assert "secret" in span.status.description


@pytest.mark.parametrize(
    "mode,kind",
    [
        ("down", "unreachable"),
        ("500", "status"),
        ("garbage", "parse"),
        ("hang", "timeout"),
    ],
)
def test_the_one_metrics_reader_raises_one_typed_error(bad_metrics, mode, kind):
    import asyncio

    import httpx

    from appliance.engine.local import free_port

    url = f"http://127.0.0.1:{free_port()}" if mode == "down" else bad_metrics(mode).url
    bound = 0.3 if mode == "hang" else 5.0  # generous unless the bound is what is tested
    timeouts = []  # the timeout each request went out with, as the real httpx client saw it

    def sent(request: httpx.Request) -> None:
        timeouts.append(request.extensions["timeout"])

    async def asent(request: httpx.Request) -> None:
        sent(request)

    async def aread():
        async with httpx.AsyncClient(event_hooks={"request": [asent]}) as client:
            return await metrics_reader.aread(url + "/metrics/", timeout=bound, client=client)

    with (
        httpx.Client(event_hooks={"request": [sent]}) as client,
        pytest.raises(metrics_reader.MetricsReadError) as sync,
    ):
        metrics_reader.read(url + "/metrics/", timeout=bound, client=client)
    with pytest.raises(metrics_reader.MetricsReadError) as async_:
        asyncio.run(aread())
    assert sync.value.kind == async_.value.kind == kind
    # Each read went out bounded by its timeout, in every phase. In "hang" that bound is what
    # ended it: the server never answers while the test runs (timeout, not a closed connection).
    assert timeouts == [dict.fromkeys(("connect", "read", "write", "pool"), bound)] * 2


def test_the_reader_parses_the_real_capture_with_the_work_counters(bad_metrics):
    fake = bad_metrics("pages", pages=[CAPTURE])
    reading = metrics_reader.read(fake.url + "/metrics/", timeout=2)
    assert reading.snapshot.speculative and reading.snapshot.running == 0
    assert (reading.generation_tokens, reading.finished_requests) == (64, 1)


def test_a_leak_makes_two_calls_shared_and_the_next_after_read_certifies_both():
    # Call 1's after-read R1 went out after call 2's request and holds 3 of call 2's tokens: call
    # 1 is shared and R1 is not certified. Call 2's window starts at R0, so it holds call 1 too:
    # shared. But R2 moved the token counter by exactly calls 1 + 2's usage since R0, so R2 is
    # certified and call 3 starts from it: the chain goes on without anyone waiting.
    srv = Server("http://127.0.0.1:9/metrics/")

    def rec(tokens, finished, sent, got):
        t = srv.record(metrics_reader.parse(200, _seq(CAPTURE, tokens, finished).encode()), sent)
        t.got = t.clean_from = got
        return t

    r0 = rec(64, 1, 0.9, 1.0)
    call1 = srv.begin()
    call1.sent, call1.finished, call1.tokens = 1.5, 2.0, 24
    srv.end(call1)
    call2 = srv.begin()
    call2.sent = 2.1
    r1 = rec(64 + 24 + 3, 1, 2.2, 2.5)
    fig1 = rules.from_readings(r0, r1, None, overlapped=False, output_tokens=24)
    assert fig1.source == "shared"
    assert not srv.certify(r0, r1) and r1.clean_from == 2.5
    call2.finished, call2.tokens = 3.0, 16
    srv.end(call2)
    assert srv.before(call2) is r0
    r2 = rec(64 + 24 + 16, 3, 3.01, 3.2)
    fig2 = rules.from_readings(r0, r2, None, overlapped=False, output_tokens=16)
    assert fig2.source == "shared"  # two requests finished in its window
    assert srv.certify(r0, r2) and r2.clean_from == 3.0
    call3 = srv.begin()
    call3.sent = 3.05
    assert srv.before(call3) is r2
    # One more token than the own calls' usage: someone else's, no certificate.
    r2x = rules.Timed(metrics_reader.parse(200, _seq(CAPTURE, 105, 3).encode()), 3.01, 3.2)
    assert not srv.certify(r0, r2x) and r2x.clean_from == 3.2
    # An own call of unknown usage (cancelled mid-stream) in the window: no certificate either.
    gone = srv.begin()
    gone.sent, gone.finished = 3.06, 3.07
    srv.end(gone)
    r3 = rec(104 + 8, 4, 3.1, 3.3)
    assert not srv.certify(r2, r3)


def test_certify_finds_its_own_calls_newest_first_and_stops_at_the_older_ones():
    """certify reads the ended calls newest first and stops at the first one Server.end closed
    before the before-reading's clean_from (on its own clock, as the agent's calls run): 300
    calls before it are not looked at, and an own call that ended first but was closed last is
    still one of the own calls."""
    srv = Server("http://127.0.0.1:9/metrics/")

    def rec(tokens, finished):
        at = time.monotonic()
        return srv.record(metrics_reader.parse(200, _seq(CAPTURE, tokens, finished).encode()), at)

    for _ in range(300):
        w = srv.begin()
        w.sent = w.finished = time.monotonic()
        w.tokens = 7
        srv.end(w)
    before = rec(64, 1)
    first, second = srv.begin(), srv.begin()
    first.sent = second.sent = time.monotonic()
    first.finished, first.tokens = time.monotonic(), 11
    second.finished, second.tokens = time.monotonic(), 5
    srv.end(second)
    srv.end(first)  # closed after the call that ended after it
    assert srv.certify(before, rec(64 + 16, 3))
    assert not srv.certify(before, rec(64 + 15, 3))  # first's tokens missing: no certificate
    third = srv.begin()
    third.sent = third.finished = time.monotonic()  # usage unknown (cancelled)
    srv.end(third)
    assert not srv.certify(before, rec(64 + 16, 4))


def test_after_foreign_traffic_a_call_waits_for_the_pending_read_now_and_then():
    srv = Server("http://127.0.0.1:9/metrics/")
    srv.record(metrics_reader.parse(200, CAPTURE.encode()), sent=0.0)
    srv.after_queued()  # an after-read is pending
    srv.chained(False)  # and the last proof failed
    assert srv.pending() == 1
    first, second = srv.begin(), srv.begin()
    srv.end(first)
    assert srv.needs(second, now=100.0) == ""  # it overlapped another call: a wait would not help
    srv.end(second)
    waited = Window()
    assert srv.needs(waited, now=100.0) == "wait"
    # The call that waited learns from its figures at once (the others' wait for the batch).
    assert srv.restarting(waited) and not srv.restarting(second)
    assert srv.needs(Window(), now=100.9) == ""  # not again within a second
    assert srv.needs(Window(quiet_before=True), now=100.9) == "wait"  # no usage: always

    def next_wait(w: Window, exact: bool, seconds: float) -> Window:
        """Learn from ``w``'s figures: the next wait comes exactly ``seconds`` after ``w`` ended;
        that call, which ends half a second later."""
        srv.restarted(w, exact)
        assert srv.needs(Window(), now=w.finished + seconds - 0.01) == ""
        due = Window()
        assert srv.needs(due, now=w.finished + seconds) == "wait"
        due.finished = w.finished + seconds + 0.5
        return due

    # The wait did not make the call exact (foreign traffic goes on): the next one comes later.
    waited.finished = 100.2
    w = next_wait(waited, exact=False, seconds=2 * RESTART_MIN_S)
    srv.restarted(Window(), exact=True)  # not the call that waited: ignored, still backing off
    w = next_wait(w, exact=False, seconds=4 * RESTART_MIN_S)
    for seconds in (8, 16, 32, RESTART_MAX_S, RESTART_MAX_S):  # never slower than RESTART_MAX_S
        w = next_wait(w, exact=False, seconds=seconds)
    w = next_wait(w, exact=True, seconds=RESTART_MIN_S)  # it paid off: back to the shortest
    assert srv.restarting(w)
    srv.restarted(w, exact=True)
    assert not srv.restarting(w)  # learnt from: no longer the call that waited
    srv.chained(True)
    assert srv.needs(Window(), now=w.finished + 1000) == ""  # a certified chain needs no wait
    srv.after_done()
    assert srv.pending() == 0


def test_a_snapshots_window_learns_its_need_at_begin_and_its_end_counts_its_after_read():
    """begin() answers needs() for a window that takes snapshots under its own lock (a window
    that takes none needs nothing); end(after_read=True) counts the after-read pending under
    end's lock, as after_queued() does, before the call hands it to the worker."""
    srv = Server("http://127.0.0.1:9/metrics/")
    first, plain = srv.begin(snapshots=True), srv.begin()
    assert (first.need, plain.need) == ("read", "")  # no reading yet; no snapshots: none
    srv.end(plain)
    srv.end(first, after_read=True)
    assert srv.pending() == 1 and srv.in_flight() == 0
    srv.record(metrics_reader.parse(200, CAPTURE.encode()), sent=0.0)
    assert srv.begin(snapshots=True, quiet_before=True).need == "wait"  # no usage: it waits
    assert srv.begin(snapshots=True, quiet_before=True).need == ""  # overlapped: no help
    srv.after_done()
    assert srv.pending() == 0


def test_a_counters_call_after_calls_that_read_nothing_reads_a_fresh_before_reading():
    # The zero-code script's case (ADR 0006): the server's first call reads R0 and then brings
    # its own per-request figures, so neither it nor the per-request calls after it read
    # /metrics again. A Responses call (counters path) that then took R0 as its before-reading
    # would count those calls' tokens as its own: never exact. R0 predates the last call's end,
    # so the call reads a fresh one first, on the caller's path, like a server's first call.
    srv = Server("http://127.0.0.1:9/metrics/")
    r0 = srv.record(metrics_reader.parse(200, _seq(CAPTURE, 64, 1).encode()), sent=1.0)
    r0.got = r0.clean_from = 1.1
    for sent in (1.2, 2.2, 3.2):  # three per-request calls, no reads of their own
        w = srv.begin()
        w.sent, w.finished, w.tokens = sent, sent + 0.5, 24
        srv.end(w)
    counters = srv.begin()
    assert srv.needs(counters, now=4.0) == "read"
    fresh = srv.record(metrics_reader.parse(200, _seq(CAPTURE, 64 + 72, 4).encode()), sent=4.0)
    fresh.got = fresh.clean_from = 4.05
    counters.sent = 4.1
    assert srv.before(counters) is fresh  # not R0
    counters.finished, counters.tokens = 4.6, 16
    srv.end(counters)
    # Its after-read went out after it ended and is certified: the next call needs no read.
    after = srv.record(metrics_reader.parse(200, _seq(CAPTURE, 64 + 72 + 16, 5).encode()), 4.61)
    after.got = after.clean_from = 4.8
    assert srv.certify(fresh, after)
    assert srv.needs(srv.begin(), now=5.0) == ""


def test_queued_jobs_alone_let_the_thread_sleep_without_timed_wakeups():
    """A queued job wakes the thread itself, so with queued jobs alone (nothing deferred) the
    thread goes to sleep after SLEEP_AFTER_S even while jobs keep coming, instead of waking to
    poll a deferred queue that stays empty (issue 56 §2); a deferred job then still wakes it."""
    w = Worker()
    w.SLEEP_AFTER_S = 0.1
    done: list[int] = []
    deadline = time.monotonic() + 10
    i = 0
    while not w._sleeping and time.monotonic() < deadline:
        w.offer(lambda i=i: done.append(i))  # every 20 ms: more often than SLEEP_AFTER_S
        i += 1
        time.sleep(0.02)
    assert w._sleeping
    assert w.flush(30) and done == list(range(i))
    ran = threading.Event()
    assert w.defer(ran.set)
    assert ran.wait(30)


def test_deferred_work_runs_in_batches_in_order_and_wakes_a_sleeping_thread():
    """Deferred jobs (a call's span end, metrics, record) wait for their batch while a queued
    job (an after-read) runs at once; a batch runs at its tick, when it is full, or at a flush,
    in the order handed over; a sleeping thread is woken by a deferral. A hang here (the 30 s
    waits) is the failure."""
    w = Worker()
    w.DRAIN_S = 3600.0  # no tick in this test's time: only a full batch or a flush drains
    w.SLEEP_AFTER_S = 3600.0
    done: list[str] = []
    assert w.defer(lambda: done.append("a"))
    ran_b = threading.Event()
    w.offer(lambda: (done.append("b"), ran_b.set()))
    assert ran_b.wait(30)
    assert done == ["b"]  # the after-read did not wait for the batch
    assert w.defer(lambda: done.append("c"))
    assert w.flush(30)
    assert done == ["b", "a", "c"]
    # A full batch drains by itself.
    full = threading.Event()
    for i in range(w.DRAIN_BATCH - 1):
        assert w.defer(lambda i=i: done.append(f"x{i}"))
    assert w.defer(full.set)
    assert full.wait(30)
    assert done[3:] == [f"x{i}" for i in range(w.DRAIN_BATCH - 1)]
    # The tick drains what is left, then the idle thread sleeps; a deferral wakes it.
    w.DRAIN_S, w.SLEEP_AFTER_S = 0.05, 0.1
    ticked = threading.Event()
    w.offer(lambda: None)  # the thread takes the new tick at its next wake
    assert w.defer(ticked.set)
    assert ticked.wait(30)
    deadline = time.monotonic() + 30
    while not w._sleeping and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w._sleeping  # idle: blocked on its queue with no timeout
    woke = threading.Event()
    assert w.defer(woke.set)
    assert woke.wait(30)
    # A full deferred backlog refuses (the caller then closes the call itself).
    w._sleeping = False
    w._deferred.extend([lambda: None] * w.MAX_BACKLOG)
    assert not w.defer(lambda: None)
    assert w.flush(30) and not w._deferred


def test_a_forked_childs_first_hand_overs_start_a_thread_of_its_own():
    """The hand-overs ask no pid (a system call per call): the at-fork hook empties the
    child's thread, so its first deferral and its first queued job start the child's own
    thread and run there, and the parent's thread goes on. A child that hangs on its flush
    exits 3."""
    import os

    from appliance.agent.worker import WORKER

    WORKER.start()
    parent = WORKER._thread
    pid = os.fork()
    if pid == 0:  # the child: its own thread, or nothing runs
        ran: list[str] = []
        code = 0 if WORKER.defer(lambda: ran.append("deferred")) else 1
        code = code or (0 if WORKER.offer(lambda: ran.append("queued")) else 1)
        code = code or (0 if WORKER.flush(30) else 3)
        code = code or (0 if sorted(ran) == ["deferred", "queued"] else 4)
        os._exit(code or (0 if WORKER._thread is not parent else 5))
    # A child stuck on a lock some other thread held at the fork is killed, not waited for.
    deadline = time.monotonic() + 90
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not exit within 90 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    ran_here = threading.Event()
    assert WORKER.defer(ran_here.set) and WORKER.flush(30) and ran_here.is_set()
    assert WORKER._thread is parent


def test_the_callers_context_goes_through_the_apis_own_variable_or_its_functions(monkeypatch):
    """Under the API's own contextvars runtime the agent reads, attaches and detaches the
    current context through that runtime's variable (what ``context.get_current()`` then
    sees); under any other runtime (``OTEL_PYTHON_CONTEXT``) it finds none, and the API's
    functions are used."""
    from opentelemetry import context

    from appliance.agent import calls

    assert calls.current_context is not context.get_current  # the default runtime: its variable
    token = calls.attach_context(context.set_value("k", "v"))
    try:
        assert context.get_value("k") == "v" and calls.current_context()["k"] == "v"
    finally:
        calls.detach_context(token)
    assert context.get_value("k") is None
    from appliance.agent import patch

    patch._detach(token)  # spent: the variable's reset raises; as the API's detach, not here

    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

    class Other:  # a runtime of another kind with an attribute of the same name
        _current_context = calls._VAR

    class Derived(ContextVarsRuntimeContext):  # may attach differently: not its variable either
        pass

    for runtime in (Other(), Derived()):
        monkeypatch.setattr(context, "_RUNTIME_CONTEXT", runtime)
        assert calls._runtime_var() is None
    monkeypatch.setattr(context, "_RUNTIME_CONTEXT", ContextVarsRuntimeContext())
    assert calls._runtime_var() is context._RUNTIME_CONTEXT._current_context


def test_request_attributes_leave_out_unset_values_and_sentinels():
    import openai

    kwargs = {
        "model": "",  # no value
        "max_tokens": openai.NOT_GIVEN,
        "max_completion_tokens": 16,
        "temperature": 0,  # a value, though falsy
        "top_p": None,
        "stream": True,
        "extra_body": {"top_k": 5, "temperature": 9},  # the named argument wins
        "stop_sequences": ["\n\n", "END"],
    }
    attrs = spans.request_attributes("chat", kwargs, None, 8000, "", capture_content=False)
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0,
        "gen_ai.request.top_k": 5,
        "gen_ai.request.stream": True,
        "server.port": 8000,
        "gen_ai.request.stop_sequences": ["\n\n", "END"],
    }
    assert list(attrs)[-1] == "gen_ai.request.stop_sequences"
    attrs = spans.request_attributes(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "h", 1, "r", True
    )
    assert attrs["gen_ai.input.messages"] == '[{"role": "user", "content": "hi"}]'
    assert (attrs["gen_ai.request.model"], attrs["appliance.agent.role"]) == ("m", "r")


def test_a_done_after_read_wakes_a_call_that_waits_for_it_and_only_then_notifies():
    """after_done() notifies only while a call waits in prepare() (most after-reads wake
    nobody); one that waits is woken at once, not at its timeout."""
    srv = Server("http://127.0.0.1:9/metrics/")
    srv.record(metrics_reader.parse(200, CAPTURE.encode()), sent=0.0)
    srv.after_queued()
    srv.after_queued()
    srv.after_done()  # nobody waits: nothing to wake
    w = Window(need="wait")
    waited: list[float] = []

    def wait() -> None:
        t0 = time.monotonic()
        srv.prepare(w, metrics.build(), timeout=30.0, cooldown=1.0)
        waited.append(time.monotonic() - t0)

    t = threading.Thread(target=wait)
    t.start()
    deadline = time.monotonic() + 10
    while not srv._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert srv._waiting == 1
    srv.after_done()
    t.join(10)
    assert waited and waited[0] < 10 and srv._waiting == 0 and srv.pending() == 0
