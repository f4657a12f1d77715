"""The telemetry agent against the real CPU engine: spans, attribution, parity, faults, metrics.

Every chat call here goes to a real vLLM. Where a /metrics fault cannot be produced by a real
engine (500, garbage, hang), the agent's metrics URL points at a misbehaving server from
tests/plugins/agent.py while the call itself still goes to the engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_agent_meter import points as meter_points

from appliance import agent
from appliance.agent import spans
from appliance.agent.instrumentor import OpenAIInstrumentor
from appliance.agent.server import server_for
from appliance.agent.worker import WORKER
from appliance.dev import demo
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.engine_api.vllm_client import VLLMClient

pytestmark = pytest.mark.engine

MODEL = "gemma4-tiny"
# How long a slowed or late /metrics read is held at most: each test releases it as soon as
# what it needs happened (a cancel inside it, a caller back before it); a caller that waited
# for it instead would be back only after this, and fail.
LATE_S = 60.0
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
CAPTURE = Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp.txt"


class _Unpatched:
    """``client.chat.completions.create`` as the SDK defines it, while the classes are patched."""

    def __init__(self, client) -> None:
        self.completions = self
        self._resource = client.chat.completions

    def create(self, **kw):
        create = type(self._resource).create
        return getattr(create, "__wrapped__", create)(self._resource, **kw)


class _UnpatchedClient:
    def __init__(self, client) -> None:
        self.chat = _Unpatched(client)


class Traced:
    """An instrumented client with in-memory spans, its own registry and its call records.

    ``zero_code=True``: the SDK's classes are patched by the instrumentor instead (with the same
    settings), ``client`` is a plain SDK client and ``bare`` reaches the unpatched method. Only
    one instrumentor exists per process: a new ``Traced`` replaces the settings of the last one.
    """

    def __init__(
        self,
        url: str,
        *,
        is_async: bool = False,
        role: str = "worker",
        http_client=None,
        zero_code: bool = False,
        **cfg,
    ) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.registry = CollectorRegistry()
        self._records: list[agent.CallRecord] = []
        cls = openai.AsyncOpenAI if is_async else openai.OpenAI
        self.bare = cls(
            base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http_client
        )
        # These tests check the attribution, not the bound on one /metrics read (the tests of
        # the bound set it). On a loaded 2-core host a read of a busy engine can outlast the
        # 0.25 s default; the agent then skips reads for its cooldown, and whole tests saw
        # `unknown` figures by timing alone (two failed a CI run).
        cfg.setdefault("snapshot_timeout", 30.0)
        if zero_code:
            inst = OpenAIInstrumentor()
            inst.uninstrument()  # a no-op unless an earlier Traced of this test patched
            inst.instrument(
                role=role,
                config=agent.AgentConfig(**cfg),
                tracer_provider=provider,
                registry=self.registry,
                on_call=self._records.append,
            )
            self.client, self.bare = self.bare, _UnpatchedClient(self.bare)
            return
        self.client = agent.instrument(
            self.bare,
            role=role,
            config=agent.AgentConfig(**cfg),
            tracer_provider=provider,
            registry=self.registry,
            on_call=self._records.append,
        )

    @property
    def spans(self):
        assert agent.flush(30)  # /metrics-attributed calls finish on the agent's thread
        return self.exporter.get_finished_spans()

    @property
    def records(self) -> list[agent.CallRecord]:
        assert agent.flush(30)
        return self._records

    def errors(self, kind: str) -> float:
        return self.registry.get_sample_value("gemma4_agent_errors_total", {"kind": kind}) or 0.0


@pytest.fixture(params=["proxy", "zero_code"])
def zero_code(request):
    """Both ways in: ``instrument(client)`` and the instrumentor's patched classes."""
    yield request.param == "zero_code"
    OpenAIInstrumentor().uninstrument()


def _plain(client, max_tokens=24, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, **kw
    )


def _stream(client, max_tokens=24):
    return list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )


def _same_result(a, b) -> None:
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert a.choices[0].finish_reason == b.choices[0].finish_reason


# -- spans over the real OTLP/HTTP exporter ---------------------------------------------------


def _export_and_receive(url, receiver, role, monkeypatch):
    # The resource is the SDK's reading of the process's environment.
    monkeypatch.setenv("OTEL_SERVICE_NAME", "agent-under-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    provider = agent.setup_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    sent: list[dict] = []

    def hook(request):
        sent.append(dict(request.headers))

    bare = openai.OpenAI(
        base_url=url + "/v1",
        api_key="unused",
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [hook]}),
    )
    client = agent.instrument(
        bare,
        role=role,
        tracer_provider=provider,
        config=agent.AgentConfig(),
        registry=CollectorRegistry(),
    )
    _plain(client)
    _stream(client)
    provider.shutdown()
    return receiver.wait_for(2), sent


def test_spans_reach_a_real_otlp_receiver_with_gen_ai_and_mtp_attributes(
    mtp_engine, otlp_receiver, monkeypatch
):
    got, sent = _export_and_receive(mtp_engine.url, otlp_receiver, "architect", monkeypatch)
    assert len(got) == 2
    plain, stream = got
    for span in got:
        a = span.attributes
        assert span.name == f"chat {MODEL}"
        assert span.kind == 3  # SPAN_KIND_CLIENT in the OTLP protobuf
        assert span.ended
        assert span.resource["service.name"] == "agent-under-test"
        assert span.resource["deployment.environment"] == "test"
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 24
        assert a["gen_ai.response.finish_reasons"] == ("length",)
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == mtp_engine.port
        assert a["appliance.agent.role"] == "architect"
        assert a["gen_ai.vllm.mtp.source"] == "request" and a["gen_ai.vllm.mtp.shared"] is False
        assert a["gen_ai.vllm.mtp.acceptance"] >= 0.9
        assert a["gen_ai.vllm.mtp.draft_tokens"] >= a["gen_ai.vllm.mtp.accepted"] > 0
        assert a["gen_ai.vllm.mtp.drafts"] > 0 and a["gen_ai.vllm.mtp.tokens_per_step"] > 2.5
        assert len(a["gen_ai.vllm.mtp.per_position_acceptance"]) == 2  # k=2
        # The names of this release (ADR 0020), beside the old ones above until the next.
        mtp = {k: v for k, v in a.items() if k.startswith("vllm.spec_decode.")}
        assert {spans.MTP_OLD[k]: v for k, v in mtp.items()} == {
            k: v for k, v in a.items() if k.startswith("gen_ai.vllm.mtp.")
        }
        assert mtp["vllm.spec_decode.num_draft_tokens"] == a["gen_ai.vllm.mtp.draft_tokens"] > 0
        # Prompt and completion text stay out unless enabled.
        assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a
    assert plain.attributes["gen_ai.request.stream"] is False
    assert stream.attributes["gen_ai.request.stream"] is True
    assert stream.attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert "gen_ai.response.time_to_first_chunk" not in plain.attributes
    # traceparent went out on the wire and names each call's own span.
    chat_requests = [h for h in sent if "traceparent" in h]
    assert [h["traceparent"].split("-")[1:3] for h in chat_requests] == [
        [s.trace_id, s.span_id] for s in got
    ]


def test_random_drafter_spans_show_low_acceptance(mtp_random_engine, otlp_receiver, monkeypatch):
    got, _ = _export_and_receive(mtp_random_engine.url, otlp_receiver, "worker", monkeypatch)
    assert len(got) == 2
    for span in got:
        assert span.attributes["gen_ai.vllm.mtp.source"] == "request"
        assert span.attributes["gen_ai.vllm.mtp.acceptance"] <= 0.1


def test_content_is_recorded_only_when_enabled(mtp_engine):
    t = Traced(mtp_engine.url, capture_content=True)
    resp = _plain(t.client)
    a = t.spans[0].attributes
    assert "Tell me about the sea." in a["gen_ai.input.messages"]
    assert json.loads(a["gen_ai.output.messages"]) == [resp.choices[0].message.content]


# -- attribution --------------------------------------------------------------------------------


def _concurrently(fn, n=4):
    barrier = threading.Barrier(n)
    out, errors = [None] * n, []

    def run(i):
        try:
            barrier.wait()
            out[i] = fn()
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    return out


def _batch_delta(url, fn):
    with VLLMClient(url) as obs:
        before = obs.snapshot()
        fn()
        return specdecode.delta(before, obs.snapshot())


def test_concurrent_calls_get_exact_per_request_figures_summing_to_the_batch(mtp_engine):
    # Four at once, two of them streamed, each of its own length: every record carries the
    # figures of its own response's block (a stream's is on its last chunk, with the usage),
    # and together they are the engine's counter movement over the batch.
    t = Traced(mtp_engine.url)
    calls = [(False, 40), (True, 44), (False, 48), (True, 52)]
    lock = threading.Lock()

    def one() -> tuple[str, specdecode.Delta | None]:
        with lock:
            streamed, max_tokens = calls.pop()
        if streamed:
            last = _stream(t.client, max_tokens)[-1]
            return last.id, specdecode.from_response_metrics(last.model_extra)
        resp = _plain(t.client, max_tokens)
        return resp.id, specdecode.from_response_metrics(resp.model_extra)

    got: list = []
    d = _batch_delta(mtp_engine.url, lambda: got.extend(_concurrently(one)))
    blocks = dict(got)
    records = t.records
    assert len(records) == len(blocks) == 4 and None not in blocks.values()
    assert sorted(r.stream for r in records) == [False, False, True, True]
    assert {r.response_id for r in records} == set(blocks)
    for r in records:
        block = blocks[r.response_id]
        assert (r.figures.source, r.figures.shared) == ("request", False), r
        assert (r.figures.drafts, r.figures.draft_tokens, r.figures.accepted) == (
            block.drafts,
            block.draft_tokens,
            block.accepted,
        ), r
    figs = [r.figures for r in records]
    assert sum(f.drafts for f in figs) == d.drafts
    assert sum(f.draft_tokens for f in figs) == d.draft_tokens
    assert sum(f.accepted for f in figs) == d.accepted


def test_without_per_request_metrics_overlapping_calls_are_shared(mtp_counters_engine):
    t = Traced(mtp_counters_engine.url)
    _concurrently(lambda: _plain(t.client, 48))
    figs = [(r.figures.source, r.figures.status) for r in t.records]
    assert [source for source, _ in figs] == ["shared"] * 4, figs
    assert all(r.figures.shared for r in t.records)
    # Shared windows never feed the per-role distributions or token counters.
    assert (
        t.registry.get_sample_value(
            "gemma4_agent_call_acceptance_count", {"role": "worker", "model": MODEL}
        )
        is None
    )
    assert (
        t.registry.get_sample_value(
            "gemma4_agent_calls_total",
            {"role": "worker", "model": MODEL, "source": "shared", "outcome": "ok"},
        )
        == 4
    )


def test_without_per_request_metrics_sequential_calls_are_exact(mtp_counters_engine):
    # Each call after the previous one's figures are known. Back to back, an after-read (sent
    # by the agent's thread) can reach a 2-core CPU engine after the next call's first token:
    # both calls are then shared, never wrong; the certified chain is shown deterministically
    # by test_back_to_back_calls_stay_exact_while_the_previous_after_read_is_in_flight.
    t = Traced(mtp_counters_engine.url)

    def three():
        for _ in range(3):
            _plain(t.client, 32)
            assert agent.flush(30)

    d = _batch_delta(mtp_counters_engine.url, three)
    figs = [r.figures for r in t.records]
    sources = [(f.source, f.status) for f in figs]
    assert [f.source for f in figs] == ["counters"] * 3 and not any(f.shared for f in figs), sources
    assert sum(f.draft_tokens for f in figs) == d.draft_tokens
    assert sum(f.accepted for f in figs) == d.accepted
    assert all(f.acceptance >= 0.9 for f in figs)


def test_no_metrics_request_once_the_server_sends_per_request_figures(mtp_engine, bad_metrics):
    # A counting stand-in for /metrics (it replays the engine's own real page) to see how
    # often the agent reads it; the calls go to the real engine.
    page = httpx.get(mtp_engine.url + "/metrics").text
    fake = bad_metrics("pages", pages=[page])
    t = Traced(mtp_engine.url, metrics_url=fake.url)
    _plain(t.client)
    first = fake.hits
    for _ in range(3):
        _plain(t.client)
    _stream(t.client)
    # The first call reads once (before; its own response then makes the after-read moot).
    assert first == 1
    assert fake.hits == first
    assert {r.figures.source for r in t.records} == {"request"}


# -- parity and passthrough ---------------------------------------------------------------------


def test_stream_plain_sync_async_give_the_same_figures(mtp_engine):
    t = Traced(mtp_engine.url)
    _plain(t.client, 40)
    _stream(t.client, 40)
    ta = Traced(mtp_engine.url, is_async=True)

    async def both():
        await ta.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0
        )
        s = await ta.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for _ in s:
            pass

    asyncio.run(both())
    recs = t.records + ta.records
    assert [r.stream for r in recs] == [False, True, False, True]
    assert {r.output_tokens for r in recs} == {40}
    keyed = {(r.figures.drafts, r.figures.draft_tokens, r.figures.accepted) for r in recs}
    assert len(keyed) == 1 and None not in next(iter(keyed))
    assert len(t.spans) == 2 and len(ta.spans) == 2


def _chunks(stream_iter):
    return [c.model_dump(exclude={"id", "created"}) for c in stream_iter]


class _WireTap(httpx.BaseTransport):
    """A real HTTP transport that also keeps each response body as it came over the wire."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.bodies: dict[str, bytearray] = {}  # by request path

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = self.inner.handle_request(request)
        body = self.bodies[request.url.path] = bytearray()

        class Tee(httpx.SyncByteStream):
            def __iter__(self):
                for part in resp.stream:
                    body.extend(part)
                    yield part

            def close(self) -> None:
                resp.stream.close()

        return httpx.Response(
            resp.status_code, headers=resp.headers, stream=Tee(), extensions=resp.extensions
        )


def _sse_chunks(body: bytes) -> list[dict]:
    events = [ln[len("data: ") :] for ln in body.decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return _chunks(
        openai.types.chat.ChatCompletionChunk.model_validate_json(e) for e in events[:-1]
    )


def test_stream_is_passed_through_unchanged(mtp_engine):
    # Compared with the bytes of the same call: how the engine groups tokens into chunks depends
    # on timing (two calls on a loaded host chunked differently and failed a run).
    tap = _WireTap()
    t = Traced(mtp_engine.url, http_client=httpx.Client(transport=tap))
    kw = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 30,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    s = t.client.chat.completions.create(**kw)
    assert isinstance(s, openai.Stream)  # the proxy still is what the caller expects
    with s as entered:
        ours = _chunks(entered)
    # At least the role's chunk, one of content and the usage's: a loaded host may send every
    # token in one content chunk (seen in a full run).
    assert ours == _sse_chunks(tap.bodies["/v1/chat/completions"]) and len(ours) >= 3
    assert ours[-1]["usage"]["completion_tokens"] == 30
    assert len(t.spans) == 1  # finished exactly once: on exhaustion, not again on __exit__


def test_async_stream_closed_early_ends_the_span_once(mtp_engine):
    t = Traced(mtp_engine.url, is_async=True)

    async def early():
        s = await t.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, stream=True
        )
        async for _ in s:
            break
        await s.close()
        await s.close()

    asyncio.run(early())
    assert len(t.spans) == 1 and len(t.records) == 1


def test_legacy_completions_are_traced(mtp_engine):
    t = Traced(mtp_engine.url)
    resp = t.client.completions.create(model=MODEL, prompt="waves", max_tokens=16, temperature=0)
    assert resp.usage.completion_tokens == 16
    (span,) = t.spans
    assert span.name == f"text_completion {MODEL}"
    assert span.attributes["gen_ai.vllm.mtp.source"] == "request"


# -- fault matrix ---------------------------------------------------------------------------

# The agent's read bound where a read must end by it (the hang server never answers); every
# other fault ends the read by itself, so there the bound is generous: a 0.3 s bound on a loaded
# host turned a garbage page into a timeout now and then, and the count by kind went wrong.
BOUND = 0.3


@pytest.mark.parametrize("mode", ["down", "500", "garbage", "hang"])
def test_metrics_faults_never_reach_the_caller(
    mtp_counters_engine, bad_metrics, tmp_path, mode, zero_code
):
    if mode == "down":
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a real refusal
    else:
        url = bad_metrics(mode).url
    # A path of this test's own (the fake answers any path): the agent keeps one view per
    # metrics URL for the whole process, and a port an earlier test's server had would leave
    # its readings there, so this would not be the server's first call that the counts expect.
    url += "/" + tmp_path.name
    t = Traced(
        mtp_counters_engine.url,
        metrics_url=url,
        snapshot_timeout=BOUND if mode == "hang" else 30.0,
        failure_cooldown=0.0,
        zero_code=zero_code,
    )
    kind = {
        "down": "metrics_unreachable",
        "500": "metrics_status",
        "garbage": "metrics_parse",
        "hang": "metrics_timeout",
    }[mode]
    bare = _plain(t.bare)
    ours = _plain(t.client)
    _same_result(ours, bare)
    # What the fault costs the caller, counted rather than timed. A hang's read ends by the
    # agent's own bound (the server never answers while the test runs, so only the
    # snapshot_timeout deadline can end a read there: metrics_timeout, not a closed
    # connection), the others' by the fault itself; a call makes exactly two reads, each
    # failing once and counted: the one before (on the caller's thread: the server's first
    # call) and the one after (on the agent's thread). A retry, or one more read on the
    # caller's path, would show here.
    assert agent.flush(30)
    assert t.errors(kind) == 2, {k: t.errors(k) for k in ("metrics_timeout", "metrics_skipped")}
    chunks = _stream(t.client)
    assert chunks[-1].usage.completion_tokens == 24
    assert [s.attributes["gen_ai.vllm.mtp.source"] for s in t.spans] == ["unknown"] * 2
    assert all(s.end_time is not None for s in t.spans)
    errors = {
        s.labels["kind"]: s.value
        for fam in t.registry.collect()
        for s in fam.samples
        if s.name == "gemma4_agent_errors_total"
    }
    assert errors == {kind: 4}  # two calls, two reads each, and no other kind of error


def test_call_exception_is_unchanged_when_metrics_are_down(mtp_counters_engine, zero_code):
    t = Traced(
        mtp_counters_engine.url,
        metrics_url=f"http://127.0.0.1:{free_port()}",
        zero_code=zero_code,
    )
    kw = {"model": "no-such-model", "messages": MESSAGES, "max_tokens": 4}
    with pytest.raises(openai.NotFoundError) as bare:
        t.bare.chat.completions.create(**kw)
    with pytest.raises(openai.NotFoundError) as ours:
        t.client.chat.completions.create(**kw)
    assert ours.value.status_code == bare.value.status_code
    assert ours.value.body == bare.value.body
    (span,) = t.spans
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "NotFoundError"
    assert span.kind == SpanKind.CLIENT
    assert (
        t.registry.get_sample_value(
            "gemma4_agent_calls_total",
            {"role": "worker", "model": "no-such-model", "source": "unknown", "outcome": "error"},
        )
        == 1
    )


def test_counter_reset_between_snapshots_publishes_no_delta(
    mtp_counters_engine, bad_metrics, zero_code
):
    # Two REAL captures stand for a restart between the reads: this engine's own page now,
    # then the page of another engine process (tests/data, a different *_created and lower
    # counters). Restarting the session engine mid-call would take the other tests with it.
    live = httpx.get(mtp_counters_engine.url + "/metrics").text
    fake = bad_metrics("pages", pages=[live, CAPTURE.read_text()])
    t = Traced(mtp_counters_engine.url, metrics_url=fake.url, zero_code=zero_code)
    resp = _plain(t.client)
    assert resp.usage.completion_tokens == 24
    (rec,) = t.records
    assert (rec.figures.source, rec.figures.status) == ("unknown", "reset")
    assert rec.figures.draft_tokens is None and rec.figures.acceptance is None
    (span,) = t.spans
    assert "gen_ai.vllm.mtp.draft_tokens" not in span.attributes
    assert span.attributes["gen_ai.vllm.mtp.status"] == "reset"


def test_server_without_speculative_decoding_is_recorded_as_absent(baseline_engine):
    t = Traced(baseline_engine.url)
    bare = _plain(t.bare)
    _same_result(_plain(t.client), bare)
    (rec,) = t.records
    assert (rec.figures.source, rec.figures.status) == ("absent", "absent")
    assert rec.figures.acceptance is None and rec.figures.draft_tokens is None  # not zeros
    a = t.spans[0].attributes
    assert a["gen_ai.vllm.mtp.source"] == "absent" and "gen_ai.vllm.mtp.acceptance" not in a


# -- Prometheus -------------------------------------------------------------------------------


def test_prometheus_metrics_by_role_served_on_a_local_port(mtp_engine):
    t = Traced(mtp_engine.url, role="worker")
    _plain(t.client)
    with agent.role("architect"):
        _plain(t.client)
        _stream(t.client)
    assert agent.flush(30)  # a call's metrics are recorded on the agent's thread
    port = free_port()
    server = agent.serve_metrics(port, registry=t.registry)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }

    def get(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))))

    assert get("gemma4_agent_call_acceptance_count", role="architect", model=MODEL) == 2
    assert get("gemma4_agent_call_acceptance_count", role="worker", model=MODEL) == 1
    assert get("gemma4_agent_call_acceptance_bucket", role="worker", model=MODEL, le="0.9") == 0
    assert get("gemma4_agent_call_acceptance_bucket", role="worker", model=MODEL, le="0.05") == 0
    assert get("gemma4_agent_call_tokens_per_step_count", role="worker", model=MODEL) == 1
    assert (
        get(
            "gemma4_agent_calls_total",
            role="architect",
            model=MODEL,
            source="request",
            outcome="ok",
        )
        == 2
    )
    drafted = get("gemma4_agent_drafted_tokens_total", role="worker", model=MODEL)
    assert drafted == t.records[0].figures.draft_tokens > 0
    assert get("gemma4_agent_accepted_tokens_total", role="worker", model=MODEL) > 0
    assert get("gemma4_agent_call_duration_seconds_count", role="architect", model=MODEL) == 2


def test_the_meter_api_gets_the_figures_prometheus_gets(mtp_engine):
    """The same exact figures through the OpenTelemetry meter API (E7): an application that
    exports metrics over OTLP sees what the agent's Prometheus registry and records say."""
    reader = InMemoryMetricReader()
    registry = CollectorRegistry()
    records: list[agent.CallRecord] = []
    client = agent.instrument(
        openai.OpenAI(base_url=mtp_engine.url + "/v1", api_key="unused"),
        role="worker",
        tracer_provider=TracerProvider(),
        registry=registry,
        on_call=records.append,
        meter_provider=MeterProvider(metric_readers=[reader]),
    )
    _plain(client)
    _stream(client)
    assert agent.flush(30)
    got = meter_points(reader)
    figs = [r.figures for r in records]
    assert [f.source for f in figs] == ["request", "request"]
    (acceptance,) = got["vllm.spec_decode.acceptance_rate"]
    assert acceptance.count == 2
    assert acceptance.sum == pytest.approx(sum(f.acceptance for f in figs))
    (length,) = got["vllm.spec_decode.acceptance_length"]
    assert length.sum == pytest.approx(sum(f.tokens_per_step for f in figs))
    (drafted,) = got["vllm.spec_decode.num_draft_tokens"]
    labels = {"role": "worker", "model": MODEL}
    assert drafted.value == sum(f.draft_tokens for f in figs) > 0
    assert drafted.value == registry.get_sample_value("gemma4_agent_drafted_tokens_total", labels)
    (accepted,) = got["vllm.spec_decode.num_accepted_tokens"]
    assert accepted.value == sum(f.accepted for f in figs)
    assert dict(drafted.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "server.address": "127.0.0.1",
        "server.port": mtp_engine.port,
        "appliance.agent.role": "worker",
    }
    usage = {p.attributes["gen_ai.token.type"]: p for p in got["gen_ai.client.token.usage"]}
    assert usage["output"].sum == sum(r.output_tokens for r in records) == 48
    assert usage["input"].sum == sum(r.input_tokens for r in records)
    (duration,) = got["gen_ai.client.operation.duration"]
    assert duration.count == 2


# -- the demo -----------------------------------------------------------------------------------


def test_demo_exports_spans_when_an_endpoint_is_set(mtp_engine, otlp_receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.url)
    report = demo.run(mtp_engine.url, calls=2, max_tokens=16)
    got = otlp_receiver.wait_for(2)
    assert [s.attributes["appliance.agent.role"] for s in got] == ["demo", "demo"]
    assert [s.attributes["gen_ai.request.stream"] for s in got] == [False, True]
    assert [c.figures.draft_tokens for c in report.calls] == [
        s.attributes["gen_ai.vllm.mtp.draft_tokens"] for s in got
    ]


def test_demo_records_carry_source_and_shared(mtp_engine, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    report = demo.run(mtp_engine.url, calls=2, max_tokens=16)
    calls = report.to_dict()["calls"]
    for c in calls:
        f = c["figures"]
        assert f["source"] == "request" and f["shared"] is False
        assert c["output_tokens"] == 16 and f["acceptance"] >= 0.9
        for key in ("drafts", "draft_tokens", "accepted", "tokens_per_step"):
            assert f[key] is not None
    assert "request" in demo.format_table(report)


# -- interruption, identity, headers -------------------------------------------------------------


def _sequential_sources(t, n=2):
    for _ in range(n):
        _plain(t.client, 16)
        assert agent.flush(30)  # see test_without_per_request_metrics_sequential_calls_are_exact
    return [r.figures.source for r in t.records[-n:]]


def test_cancelled_task_mid_metrics_read_ends_the_span_and_leaves_no_window(
    mtp_counters_engine, bad_metrics, zero_code
):
    # The first /metrics read is held (the real engine's page, relayed once released) so the
    # task can be cancelled while the agent is inside it: a stream without include_usage reads
    # before the request on the caller's path.
    slow = bad_metrics("slow", upstream=mtp_counters_engine.url, slow_hits=(1,), slow_s=LATE_S)
    t = Traced(
        mtp_counters_engine.url,
        is_async=True,
        metrics_url=slow.url,
        snapshot_timeout=LATE_S,
        zero_code=zero_code,
    )

    async def cancelled():
        task = asyncio.create_task(
            t.client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
            )
        )
        while slow.hits < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    (span,) = t.spans
    assert span.end_time is not None and span.attributes["error.type"] == "CancelledError"
    assert t.records[0].outcome == "error"
    slow.release.set()
    # The same server, so the same windows; a generous bound for the relay on a loaded host.
    ts = Traced(
        mtp_counters_engine.url, metrics_url=slow.url, snapshot_timeout=2.0, zero_code=zero_code
    )
    assert _sequential_sources(ts) == ["counters", "counters"]


def test_keyboard_interrupt_mid_metrics_read_ends_the_span_and_leaves_no_window(
    mtp_counters_engine, bad_metrics, zero_code
):
    import os
    import signal

    slow = bad_metrics("slow", upstream=mtp_counters_engine.url, slow_hits=(1,), slow_s=LATE_S)
    t = Traced(
        mtp_counters_engine.url, metrics_url=slow.url, snapshot_timeout=LATE_S, zero_code=zero_code
    )

    def ctrl_c_inside_the_read():
        # A real Ctrl-C, once the agent is provably inside the slowed read (a fixed delay lands
        # elsewhere on a loaded host).
        deadline = time.monotonic() + 60
        while slow.hits < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=ctrl_c_inside_the_read, daemon=True)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        list(
            t.client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
            )
        )
    timer.join()
    (span,) = t.spans
    assert span.end_time is not None and span.attributes["error.type"] == "KeyboardInterrupt"
    slow.release.set()
    assert _sequential_sources(t) == ["counters", "counters"]


def test_abandoned_stream_collected_while_the_agent_lock_is_held_does_not_deadlock(mtp_engine):
    import gc

    # A server of its own (localhost, not 127.0.0.1): its lock is held below.
    url = mtp_engine.url.replace("127.0.0.1", "localhost")
    t = Traced(url)
    srv = server_for(url + "/metrics/")
    done = threading.Event()

    def collect_inside_the_lock():
        s = t.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, stream=True
        )
        s._self_cycle = s  # only the cycle collector can free it, at a time it picks
        del s
        with srv._lock:  # the garbage collector runs the finalizer here, on this thread
            gc.collect()
        done.set()

    th = threading.Thread(target=collect_inside_the_lock, daemon=True)
    th.start()
    assert done.wait(20), "the stream's finalizer deadlocked on a lock its thread held"
    (span,) = t.spans
    assert span.attributes["gen_ai.vllm.mtp.status"] == "abandoned"


def test_mapping_extra_headers_reach_the_server(mtp_engine):
    sent: list[httpx.Headers] = []
    bare = openai.OpenAI(
        base_url=mtp_engine.url + "/v1",
        api_key="unused",
        http_client=openai.DefaultHttpxClient(
            event_hooks={"request": [lambda r: sent.append(r.headers)]}
        ),
    )
    client = agent.instrument(bare, tracer_provider=TracerProvider(), registry=CollectorRegistry())
    gateway = httpx.Headers(
        {"X-Gateway-Auth": "token-1", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    )
    _plain(client, 4, extra_headers=gateway)
    (headers,) = sent
    assert headers["x-gateway-auth"] == "token-1"
    assert headers["traceparent"] == gateway["traceparent"]  # the caller's own wins


def test_no_request_text_in_error_status_without_content_capture(mtp_engine):
    t = Traced(mtp_engine.url)
    secret = "my-secret-prompt-" * 4
    with pytest.raises(openai.BadRequestError) as bare:
        # Too many tokens asked: vLLM's 400 body echoes parts of the request.
        t.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=10**9
        )
    (span,) = t.spans
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "BadRequestError"
    assert "secret" not in str(span.attributes) and str(bare.value)


# -- the snapshot path off the caller's path ----------------------------------------------------


def _movement(url, fn):
    with VLLMClient(url) as obs:
        before = obs.snapshot()
        out = fn()
        assert agent.flush(30)
        return out, specdecode.delta(before, obs.snapshot())


def test_the_call_returns_before_its_after_read_and_the_span_ends_later_exact(
    mtp_counters_engine, bad_metrics
):
    # The after-read (the agent's 2nd read) is the engine's real page, answered only once the
    # caller is back (``release``): the order is made, not timed.
    late = bad_metrics("late", upstream=mtp_counters_engine.url, slow_hits=(2,), slow_s=LATE_S)
    t = Traced(mtp_counters_engine.url, metrics_url=late.url, snapshot_timeout=LATE_S)

    def call():
        resp = _plain(t.client, 24)
        returned_ns = time.time_ns()
        unfinished = len(t.exporter.get_finished_spans())
        in_flight = not late.answered_at
        late.release.set()
        return resp, returned_ns, unfinished, in_flight

    (resp, returned_ns, unfinished, in_flight), d = _movement(mtp_counters_engine.url, call)
    assert resp.usage.completion_tokens == 24
    # The caller was back while its after-read was still unanswered, and its span was open then.
    assert in_flight and late.answered_at
    assert unfinished == 0
    (span,) = t.spans  # ended later, on the agent's thread, stamped with the call's own end
    assert span.end_time <= returned_ns
    (rec,) = t.records
    assert rec.figures.source == "counters" and not rec.figures.shared
    assert (rec.figures.drafts, rec.figures.draft_tokens, rec.figures.accepted) == (
        d.drafts,
        d.draft_tokens,
        d.accepted,
    )
    assert span.attributes["gen_ai.vllm.mtp.draft_tokens"] == d.draft_tokens


def test_back_to_back_calls_stay_exact_while_the_previous_after_read_is_in_flight(
    mtp_counters_engine, bad_metrics
):
    # Call 1's after-read takes the engine's page at once but answers only after call 2 is back
    # (``release``), so call 2's request goes out while that read is still in flight: it can be
    # call 2's before-reading only through call 1's token proof (server.Server.certify),
    # not by being complete first.
    late = bad_metrics("late", upstream=mtp_counters_engine.url, slow_hits=(2,), slow_s=LATE_S)
    t = Traced(mtp_counters_engine.url, metrics_url=late.url, snapshot_timeout=LATE_S)

    def two():
        _plain(t.client, 24)
        assert late.fetched.wait(20)
        _plain(t.client, 16)
        in_flight = not late.answered_at
        late.release.set()
        return in_flight

    in_flight, d = _movement(mtp_counters_engine.url, two)
    assert in_flight  # call 2 never waited for call 1's after-read
    figs = [r.figures for r in t.records]
    assert [f.source for f in figs] == ["counters", "counters"]
    assert [r.output_tokens for r in t.records] == [24, 16]
    for field in ("drafts", "draft_tokens", "accepted"):
        assert sum(getattr(f, field) for f in figs) == getattr(d, field)
    # Foreign traffic (another client) between two calls: the window holds it, so shared.
    _plain(t.bare, 8)
    _plain(t.client, 16)
    assert t.records[-1].figures.source == "shared"
    # The chain restarts by itself: the next call, after the previous read completed, is exact.
    assert agent.flush(30)
    _, d = _movement(mtp_counters_engine.url, lambda: _plain(t.client, 16))
    last = t.records[-1].figures
    assert last.source == "counters" and last.draft_tokens == d.draft_tokens


def test_a_full_backlog_degrades_to_unknown_and_is_counted(mtp_counters_engine):
    t = Traced(mtp_counters_engine.url)
    _plain(t.client, 8)  # the server's first read, on the caller's path
    assert t.records[0].figures.source in ("counters", "shared")
    bare = _plain(t.bare, 8)
    # A real full backlog at the real bound: the agent's thread is stuck in a job (as in a slow
    # on_call callback) and MAX_BACKLOG jobs wait behind it. Filling it with calls would take
    # MAX_BACKLOG real engine calls, so the waiting jobs are no-ops queued the agent's own way.
    stuck, release = threading.Event(), threading.Event()

    def stuck_job():
        stuck.set()
        release.wait(60)

    WORKER.put(stuck_job)
    try:
        assert stuck.wait(30)
        for _ in range(WORKER.MAX_BACKLOG):
            WORKER.put(lambda: None)
        _same_result(_plain(t.client, 8), bare)
    finally:
        release.set()
    rec = t.records[-1]
    assert (rec.figures.source, rec.figures.status) == ("unknown", "skipped")
    assert t.errors("backlog") == 1
    assert t.spans[-1].attributes["gen_ai.vllm.mtp.status"] == "skipped"
    assert server_for(mtp_counters_engine.url + "/metrics/").pending() == 0


def test_a_fork_while_the_agent_lock_is_held_does_not_deadlock_the_child(mtp_counters_engine):
    import os

    t = Traced(mtp_counters_engine.url)
    _plain(t.client, 8)
    srv = server_for(mtp_counters_engine.url + "/metrics/")
    held, release = threading.Event(), threading.Event()

    def hold():
        with srv._lock:  # another thread of the parent holds the agent's lock at fork time
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one call through the agent, its figures, then out
        code = 1
        try:
            os.close(r)
            child = Traced(mtp_counters_engine.url)
            _plain(child.client, 8)
            os.write(w, child.records[0].figures.source.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    release.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child deadlocked on a lock held at fork time")
    got = os.read(r, 100).decode()
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0
    assert got in ("counters", "shared")
    _plain(t.client, 8)  # the parent goes on as before
    assert len(t.records) == 2


def test_exit_flushes_pending_figures_before_the_tracer_provider_shuts_down(
    mtp_counters_engine, bad_metrics, tmp_path
):
    import subprocess
    import sys

    # The process exits while its call's after-read is still in flight: answered only once the
    # script printed its last line. The provider is made after importing the agent, so its
    # atexit shutdown was registered later than the agent's import: the agent's flush must
    # still run first.
    late = bad_metrics("late", upstream=mtp_counters_engine.url, slow_hits=(2,), slow_s=LATE_S)
    script = tmp_path / "app.py"
    script.write_text(
        "import openai\n"
        "from appliance import agent\n"
        "provider = agent.setup_tracing({'OTEL_TRACES_EXPORTER': 'console'})\n"
        "client = agent.instrument(\n"
        f"    openai.OpenAI(base_url={mtp_counters_engine.url + '/v1'!r}, api_key='x'),\n"
        "    tracer_provider=provider,\n"
        f"    config=agent.AgentConfig(metrics_url={late.url!r}, snapshot_timeout=5.0),\n"
        ")\n"
        f"client.chat.completions.create(model={MODEL!r}, max_tokens=8,\n"
        "    messages=[{'role': 'user', 'content': 'hi'}])\n"
        "print('returned', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    first = proc.stdout.readline()
    late.release.set()  # the script is past its last line: now the after-read may answer
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert first == "returned\n"
    assert late.answered_at  # the after-read was answered after the script's last line
    assert '"gen_ai.vllm.mtp.source": "counters"' in rest
