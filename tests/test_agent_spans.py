"""The span started on the agent's thread is the one the request's ``traceparent`` named.

The caller's thread makes the span's ids, the sampler's decision and ``traceparent``; the SDK
span itself starts and ends on the agent's thread with those ids (overhead review #2). No
engine: a real HTTP server on 127.0.0.1 that records each request's headers and answers 404 as
vLLM does for an unknown model (the call fails, as bare), or, for ``gemma4-tiny``, a chat
completion shaped as vLLM 0.32's with its per-request block, through the real OpenAI SDK. The
real engine's spans and figures: tests/test_agent.py (engine tier).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import openai
import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanContext, TraceFlags
from prometheus_client import CollectorRegistry

from appliance import agent
from appliance.agent import spans

# A chat completion as vLLM 0.32 answers it with --per-request-spec-decode-metrics (the shape
# of tests/test_specdecode.py's block; the model's other fields as the SDK reads them).
ANSWER = {
    "id": "chatcmpl-7",
    "object": "chat.completion",
    "created": 1796000000,
    "model": "gemma4-tiny",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi hi hi"},
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 9, "total_tokens": 17, "completion_tokens": 8},
    "metrics": {
        "speculative_decoding": {
            "num_spec_steps": 3,
            "num_draft_tokens": 6,
            "num_accepted_draft_tokens": 5,
            "num_spec_tokens": 2,
            "per_step_accepted": [2, 2, 1],
        }
    },
}


@pytest.fixture()
def not_found() -> Iterator[tuple[str, list[dict]]]:
    """A server answering every POST 404 (vLLM's body for an unknown model); the headers of
    each request it got."""
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(dict(self.headers))
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            status, body = (
                404,
                {
                    "object": "error",
                    "message": "The model `x` does not exist.",
                    "code": 404,
                },
            )
            if request["model"] == "gemma4-tiny":
                status, body = 200, ANSWER
            body = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def _client(url: str, provider: TracerProvider):
    return agent.instrument(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
        config=agent.AgentConfig(attribution="request"),
        tracer_provider=provider,
        registry=CollectorRegistry(),
    )


def _call(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def test_the_exported_span_carries_the_ids_traceparent_sent(not_found):
    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = _client(url, provider)
    parent = provider.get_tracer("app").start_span("app work")
    with agent.role("architect"), trace.use_span(parent):
        _call(client)
    _call(client)  # a root span of its own
    parent.end()
    assert agent.flush(30)
    ours = [s for s in exporter.get_finished_spans() if s.name == "chat x"]
    assert len(ours) == 2 and len(seen) == 2
    for span, headers in zip(ours, seen, strict=True):
        _version, trace_id, span_id, flags = headers["traceparent"].split("-")
        ctx = span.get_span_context()
        assert (trace_id, span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
        assert int(flags, 16) & 1 == 1  # sampled, as the span was
        assert span.attributes["error.type"] == "NotFoundError"
        assert span.attributes["gen_ai.request.model"] == "x"
        assert span.start_time < span.end_time
    nested, root = ours
    assert nested.parent.span_id == parent.get_span_context().span_id
    assert nested.context.trace_id == parent.get_span_context().trace_id
    assert nested.attributes["appliance.agent.role"] == "architect"
    assert root.parent is None and root.context.trace_id != nested.context.trace_id


def test_root_calls_take_ids_made_ahead_and_their_spans_carry_them(not_found):
    """After a batch, the next root calls' ids, stand-ins and ``traceparent`` are ready
    (:mod:`appliance.agent.roots`, made on the agent's thread): each call takes the next one
    in order, and its exported span carries exactly those ids; no two calls share a trace."""
    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = _client(url, provider)
    _call(client)
    assert agent.flush(30)  # the batch filled the pool
    pool = client.chat.completions._self_settings.roots
    ready = list(pool._ready)[:3]
    assert len(ready) == 3
    for _ in ready:
        _call(client)
    assert agent.flush(30)
    sent = [h["traceparent"] for h in seen[1:]]
    assert sent == [header for _sc, _span, header, _ctx in ready]
    spans_ = [s for s in exporter.get_finished_spans() if s.name == "chat x"][1:]
    assert [(s.context.trace_id, s.context.span_id) for s in spans_] == [
        (sc.trace_id, sc.span_id) for sc, _span, _header, _ctx in ready
    ]
    assert all(s.parent is None for s in spans_)
    assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 4


def test_roots_are_made_ahead_only_where_that_changes_nothing(not_found):
    """No pool under a sampler other than the default (its decision is the call's) or an id
    generator other than the SDK's random one (X-Ray's encodes the time); a forked child
    starts with an empty pool, so it never sends its parent's ids."""
    import os

    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class TimeIds(RandomIdGenerator):
        pass

    url, _ = not_found
    assert (
        _client(url, TracerProvider(sampler=ALWAYS_OFF)).chat.completions._self_settings.roots
        is None
    )
    timed = _client(url, TracerProvider(id_generator=TimeIds()))
    assert timed.chat.completions._self_settings.roots is None
    pool = _client(url, TracerProvider()).chat.completions._self_settings.roots
    pool.fill()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's
        os._exit(0 if pool.take() is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.take() is not None  # the parent keeps its own


def test_during_the_send_the_calls_span_is_current_in_the_callers_context(not_found):
    """What a span started inside the send (an HTTP instrumentation's) sees as current: the
    call's span, whose ids ``traceparent`` carries, in the caller's context (its baggage kept),
    whether the root was made at the call (an empty pool), made ahead with the context the
    send runs in (an empty caller's context), or made ahead under the caller's baggage."""
    import httpx
    from opentelemetry import baggage

    url, seen = not_found
    during: list[tuple[str, dict]] = []

    def hook(request: httpx.Request) -> None:
        sc = trace.get_current_span().get_span_context()
        during.append((f"{sc.trace_id:032x}-{sc.span_id:016x}", dict(baggage.get_all())))

    client = agent.instrument(
        openai.OpenAI(
            base_url=url + "/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.Client(event_hooks={"request": [hook]}),
        ),
        config=agent.AgentConfig(attribution="request"),
        tracer_provider=TracerProvider(),
        registry=CollectorRegistry(),
    )
    _call(client)  # an empty pool: the root made at the call
    assert agent.flush(30)
    pool = client.chat.completions._self_settings.roots
    assert len(pool._ready) >= 2
    _call(client)  # made ahead, its send's context too
    token = context.attach(baggage.set_baggage("tenant", "a"))
    try:
        _call(client)  # made ahead, sent in the caller's context
    finally:
        context.detach(token)
    assert context.get_current() == {}  # each send's context was left behind
    ids = [h["traceparent"].split("-", 1)[1].rsplit("-", 1)[0] for h in seen]
    assert during == [(ids[0], {}), (ids[1], {}), (ids[2], {"tenant": "a"})]
    assert seen[2]["baggage"] == "tenant=a"


def test_an_unsampled_call_sends_an_unsampled_traceparent_and_exports_nothing(not_found):
    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _call(_client(url, provider))
    assert agent.flush(30)
    assert exporter.get_finished_spans() == ()
    assert int(seen[0]["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0


def test_what_is_read_off_the_callers_thread_reaches_span_and_record(not_found):
    """The response's id, model and finish reasons, and the block's figures, are read on the
    agent's thread after the call returned: the record and the span still carry them."""
    url, _ = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    records: list[agent.CallRecord] = []
    client = agent.instrument(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
        tracer_provider=provider,
        registry=CollectorRegistry(),
        on_call=records.append,
    )
    resp = client.chat.completions.create(
        model="gemma4-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert resp.id == "chatcmpl-7"
    assert agent.flush(30)
    (r,) = records
    assert (r.response_id, r.model, r.finish_reasons) == ("chatcmpl-7", "gemma4-tiny", ("length",))
    assert (r.input_tokens, r.output_tokens) == (9, 8)
    f = r.figures
    assert (f.source, f.drafts, f.draft_tokens, f.accepted) == ("request", 3, 6, 5)
    (span,) = exporter.get_finished_spans()
    a = span.attributes
    assert (a["gen_ai.response.id"], a["gen_ai.response.model"]) == ("chatcmpl-7", "gemma4-tiny")
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["vllm.spec_decode.num_accepted_tokens"] == a["gen_ai.vllm.mtp.accepted"] == 5


def test_records_come_in_the_order_the_calls_ended_across_both_paths(not_found):
    """A per-request call hands its record over at its end, a counters-path call after its
    after-read: with the records run in batches, each still comes in the order its call ended
    (the stand-in has no ``/metrics``: the counters path's figures are unknown, its record is
    still made)."""
    url, _ = not_found
    records: list[agent.CallRecord] = []

    def client(attribution: str):
        return agent.instrument(
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
            config=agent.AgentConfig(attribution=attribution),
            tracer_provider=TracerProvider(),
            registry=CollectorRegistry(),
            on_call=records.append,
        )

    by_request, by_counters = client("request"), client("counters")
    for _ in range(3):
        for c in (by_request, by_counters):
            c.chat.completions.create(
                model="gemma4-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
    assert agent.flush(30)
    sources = [r.figures.source for r in records]
    assert sources == ["request", sources[1]] * 3 and sources[1] != "request", sources


def test_under_the_default_sampler_an_unsampled_parent_keeps_the_call_unsampled(not_found):
    """The SDK's default sampler follows the parent: the caller takes that decision itself
    (the sampler is not called there), and the span the agent's thread starts agrees."""
    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # ParentBased(ALWAYS_ON), the default
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = _client(url, provider)
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(0))
    token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    try:
        _call(client)
    finally:
        context.detach(token)
    _call(client)  # a root: sampled
    assert agent.flush(30)
    unsampled, root = (h["traceparent"].split("-") for h in seen)
    assert unsampled[1:] == [f"{0xABC:032x}", unsampled[2], "00"]
    assert int(root[3], 16) & 1 == 1  # sampled (with the random trace-id flag, W3C level 2)
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.span_id:016x}" == root[2]


def test_a_provider_shut_down_right_after_the_call_still_exports_its_span(not_found):
    """The span ends on the agent's thread after the call returned: the provider's own
    shutdown (and force_flush) first runs the agent's pending work, so a program that shuts
    its provider down right after its last call, without ``agent.flush()``, loses nothing."""
    url, _ = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = agent.instrument(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
        tracer_provider=provider,
        registry=CollectorRegistry(),
    )
    client.chat.completions.create(
        model="gemma4-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    provider.shutdown()
    assert [s.name for s in exporter.get_finished_spans()] == ["chat gemma4-tiny"]


def test_a_calls_span_and_meter_points_carry_every_attribute_exactly(not_found):
    """Every attribute of a finished call's span, by name and value (the request's, the
    figures' under both names, the response's), and the meter API's points for two roles: the
    agent builds them off the caller's thread from cached pieces (issue 56 §2), and each must
    still be this call's own."""
    url, _ = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    client = agent.instrument(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
        tracer_provider=provider,
        registry=CollectorRegistry(),
        meter_provider=MeterProvider(metric_readers=[reader]),
    )
    kw = {"model": "gemma4-tiny", "messages": [{"role": "user", "content": "hi"}]}
    with agent.role("architect"):
        client.chat.completions.create(**kw, max_tokens=8, temperature=0.5, top_p=0.9)
    client.chat.completions.create(**kw, max_tokens=8, stream=False)
    assert agent.flush(30)
    first, second = exporter.get_finished_spans()
    port = int(url.rsplit(":", 1)[1])
    request = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "gemma4-tiny",
        "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.stream": False,
        "server.address": "127.0.0.1",
        "server.port": port,
        "appliance.agent.role": "architect",
    }
    figures = {
        "source": "request",
        "shared": False,
        "status": "ok",
        "num_drafts": 3,
        "num_draft_tokens": 6,
        "num_accepted_tokens": 5,
        "acceptance_rate": 5 / 6,
        "acceptance_length": 1 + 5 / 3,
        "per_position_acceptance_rate": (1.0, 2 / 3),
    }
    new = {"vllm.spec_decode." + k: v for k, v in figures.items()}
    old = {spans.MTP_OLD[k]: v for k, v in new.items()}
    response = {
        "gen_ai.response.model": "gemma4-tiny",
        "gen_ai.response.id": "chatcmpl-7",
        "gen_ai.usage.input_tokens": 9,
        "gen_ai.usage.output_tokens": 8,
        "gen_ai.response.finish_reasons": ("length",),
    }
    assert dict(first.attributes) == {**request, **new, **old, **response}
    assert list(first.attributes) == [*request, *new, *old, *response]  # the order too
    del request["gen_ai.request.temperature"], request["gen_ai.request.top_p"]
    request["appliance.agent.role"] = "default"
    assert dict(second.attributes) == {**request, **new, **old, **response}
    got = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                # A counter's point has its value, a histogram's its sum.
                value = "value" if m.name.endswith("_tokens") else "sum"
                got[m.name] = sorted(
                    (sorted(p.attributes.items()), getattr(p, value)) for p in m.data.data_points
                )
    base = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "gemma4-tiny",
        "gen_ai.response.model": "gemma4-tiny",
        "server.address": "127.0.0.1",
        "server.port": port,
    }
    roles = [{**base, "appliance.agent.role": r} for r in ("architect", "default")]
    assert got["gen_ai.client.token.usage"] == sorted(
        (sorted({**a, "gen_ai.token.type": kind}.items()), n)
        for a in roles
        for kind, n in (("input", 9), ("output", 8))
    )
    assert [a for a, _ in got["gen_ai.client.operation.duration"]] == [
        sorted(a.items()) for a in roles
    ]
    assert got["vllm.spec_decode.num_accepted_tokens"] == [(sorted(a.items()), 5) for a in roles]


def test_baggage_and_trace_state_go_out_as_the_propagator_writes_them(not_found):
    """traceparent alone is written by hand only without baggage and trace state; with
    either, the global propagator injects all three headers, for the same span."""
    from opentelemetry import baggage
    from opentelemetry.trace import TraceState

    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = _client(url, provider)
    _call(client)  # neither: traceparent alone
    token = context.attach(baggage.set_baggage("tenant", "a"))
    try:
        _call(client)
    finally:
        context.detach(token)
    remote = SpanContext(
        0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED), TraceState([("vendor", "x")])
    )
    token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    try:
        _call(client)
    finally:
        context.detach(token)
    assert agent.flush(30)
    plain, with_baggage, with_state = seen
    assert "baggage" not in plain and "tracestate" not in plain
    assert with_baggage["baggage"] == "tenant=a" and "tracestate" not in with_baggage
    assert with_state["tracestate"] == "vendor=x" and "baggage" not in with_state
    spans_by_id = {f"{s.context.span_id:016x}": s for s in exporter.get_finished_spans()}
    for headers in seen:
        _version, trace_id, span_id, flags = headers["traceparent"].split("-")
        span = spans_by_id[span_id]
        assert trace_id == f"{span.context.trace_id:032x}"
        assert int(flags, 16) & 1 == 1  # sampled, as the span was
    assert with_state["traceparent"].split("-")[1] == f"{0xABC:032x}"
