"""Zero-code: the agent's OpenTelemetry instrumentor, loaded by ``opentelemetry-instrument``.

The script under test imports only ``openai``: it knows nothing of the agent. It runs under the
real ``opentelemetry-instrument`` launcher against the session's real CPU engine, with the
console exporter; the spans it prints are the evidence.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import openai
import pytest
import wrapt
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from plugins.engine_idle import idle
from prometheus_client import CollectorRegistry

from appliance import agent
from appliance.agent.instrumentor import METHODS, OpenAIInstrumentor
from appliance.agent.patch import UPSTREAM_OPENAI, beneath_upstream
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.engine_api.vllm_client import VLLMClient

MODEL = "gemma4-tiny"

# Sequential calls, each once the previous one's span has ended (the script cannot call
# agent.flush: it does not know the agent; it waits through the OpenTelemetry API, with a span
# processor on the launcher's provider: an agent span ends once its figures are read). It prints
# what the engine itself said per call to stderr: (operation, streamed, the figures' source, the
# span attribute, its value): the per-request block where the endpoint returns one, else the
# usage, and for LangChain, whose messages hide the block, the engine's own draft-token counter
# delta over the call.
SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, threading
    import anthropic, httpx, openai
    from langchain_openai import ChatOpenAI
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor

    URL = os.environ["ENGINE_URL"] + "/v1"
    MSG = [{"role": "user", "content": "Tell me about the sea."}]
    said = []

    def block(obj):  # the engine's figures for this request, from its own block
        extra = getattr(obj, "model_extra", None) or {}
        sd = (extra.get("metrics") or {}).get("speculative_decoding")
        return sd and {"draft_tokens": sd["num_draft_tokens"],
                       "accepted": sd["num_accepted_draft_tokens"]}

    def req(op, stream, obj):  # a call whose response carries its block
        b = block(obj)
        said.append((op, stream, "request", DRAFTS, b and b["draft_tokens"], b))

    ended = threading.Condition()
    calls_ended = [0]

    class Ended(SpanProcessor):
        def on_end(self, span):
            if "gen_ai.vllm.mtp.source" in (span.attributes or {}):
                with ended:
                    calls_ended[0] += 1
                    ended.notify_all()

    provider = trace.get_tracer_provider()
    if hasattr(provider, "add_span_processor"):
        provider.add_span_processor(Ended())
    else:  # no SDK configured: the agent makes its own provider global at the first call
        _set = trace.set_tracer_provider
        def observed(p):
            _set(p)
            p.add_span_processor(Ended())
        trace.set_tracer_provider = observed

    def pause(calls=None):  # until the spans of `calls` calls (default: those said) ended
        want = len(said) if calls is None else calls
        with ended:
            if not ended.wait_for(lambda: calls_ended[0] >= want, timeout=120):
                sys.exit(f"only {calls_ended[0]} of {want} calls' spans ended")

    DRAFTS = "gen_ai.vllm.mtp.draft_tokens"
    OUT = "gen_ai.usage.output_tokens"

    def counters():  # the engine's draft-token and accepted counters now
        page = httpx.get(os.environ["ENGINE_URL"] + "/metrics").text
        def total(name):
            return sum(float(l.rsplit(" ", 1)[1]) for l in page.splitlines()
                       if l.startswith(f"vllm:spec_decode_num_{name}_total"))
        return {"draft_tokens": total("draft_tokens"), "accepted": total("accepted_tokens")}

    def note_delta(op, stream, source, before):  # the engine's counter delta over a call
        pause(len(said) + 1)
        d = {k: round(v - before[k]) for k, v in counters().items()}
        said.append((op, stream, source, DRAFTS, d["draft_tokens"], d))

    def counted(op, stream, source, run):
        before = counters()
        run()
        note_delta(op, stream, source, before)

    c = openai.OpenAI(base_url=URL, api_key="unused", max_retries=0)
    r = c.chat.completions.create(model="gemma4-tiny", messages=MSG, max_tokens=24, temperature=0)
    req("chat", False, r); pause()
    last = None
    for last in c.chat.completions.create(
        model="gemma4-tiny", messages=MSG, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        pass
    req("chat", True, last); pause()
    r = c.completions.create(model="gemma4-tiny", prompt="The sea is", max_tokens=24, temperature=0)
    req("text_completion", False, r); pause()
    r = c.responses.create(model="gemma4-tiny", input="Tell me about the sea.",
                           max_output_tokens=24, temperature=0)
    said.append(("responses", False, "counters", OUT, r.usage.output_tokens, None)); pause()
    for ev in c.responses.create(model="gemma4-tiny", input="Tell me about the sea.",
                                 max_output_tokens=24, temperature=0, stream=True):
        pass
    said.append(("responses", True, "counters", OUT, ev.response.usage.output_tokens, None))
    pause()
    m = anthropic.Anthropic(base_url=os.environ["ENGINE_URL"], api_key="unused", max_retries=0)
    # The Anthropic SDK 2.x names no temperature: it goes in the body's extras, as vLLM reads.
    T0 = {"extra_body": {"temperature": 0}}
    r = m.messages.create(model="gemma4-tiny", messages=MSG, max_tokens=24, **T0)
    said.append(("messages", False, "counters", OUT, r.usage.output_tokens, None)); pause()
    for ev in m.messages.create(model="gemma4-tiny", messages=MSG, max_tokens=24, **T0,
                                stream=True):
        if ev.type == "message_delta":
            out = ev.usage.output_tokens
    said.append(("messages", True, "counters", OUT, out, None)); pause()
    # messages.stream posts without going through create: its with block sends the request.
    with m.messages.stream(model="gemma4-tiny", messages=MSG, max_tokens=24, **T0) as s:
        out = s.get_final_message().usage.output_tokens
    said.append(("messages", True, "counters", OUT, out, None)); pause()

    # LangChain builds its own OpenAI client: invoke() posts through with_raw_response (the
    # per-request block); stream() without stream_usage asks no usage (the counters path, no
    # token proof); include_response_headers=True streams through with_raw_response too.
    lc = ChatOpenAI(base_url=URL, api_key="unused", model="gemma4-tiny", max_tokens=24,
                    temperature=0, max_retries=0)
    counted("chat", False, "request", lambda: lc.invoke("Tell me about the sea."))
    counted("chat", True, "counters", lambda: list(lc.stream("Tell me about the sea.")))
    raw = ChatOpenAI(base_url=URL, api_key="unused", model="gemma4-tiny", max_tokens=24,
                     temperature=0, max_retries=0, include_response_headers=True,
                     stream_usage=True)
    counted("chat", True, "request", lambda: list(raw.stream("Tell me about the sea.")))

    async def main():
        a = openai.AsyncOpenAI(base_url=URL, api_key="unused", max_retries=0)
        r = await a.chat.completions.create(
            model="gemma4-tiny", messages=MSG, max_tokens=24, temperature=0)
        req("chat", False, r)
        await asyncio.to_thread(pause)
        before = counters()
        await lc.ainvoke("Tell me about the sea.")
        await asyncio.to_thread(note_delta, "chat", False, "request", before)
        s = await a.responses.create(model="gemma4-tiny", input="Tell me about the sea.",
                                     max_output_tokens=24, temperature=0, stream=True)
        async for ev in s:
            pass
        said.append(("responses", True, "counters", OUT, ev.response.usage.output_tokens, None))
        await asyncio.to_thread(pause)

    asyncio.run(main())
    print("SAID " + json.dumps(said), file=sys.stderr)
    """
)


def _spans(stdout: str) -> list[dict]:
    """The console exporter's JSON objects, one per span, concatenated."""
    dec, out, i = json.JSONDecoder(), [], 0
    text = stdout.strip()
    while i < len(text):
        obj, end = dec.raw_decode(text, i)
        out.append(obj)
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
    return out


@pytest.mark.engine
def test_an_unmodified_script_under_opentelemetry_instrument_gets_one_span_per_call_with_figures(
    mtp_engine, tmp_path
):
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    # Nothing leaves the host: every request to anything but the engine goes to a proxy that
    # refuses it (LangChain's tiktoken would fetch its encodings; LangSmith would send traces),
    # so a reach for the network fails the script instead of passing on a connected host.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANGSMITH_", "LANGCHAIN_"))}
    refused = f"http://127.0.0.1:{free_port()}"
    env |= {
        "ENGINE_URL": mtp_engine.url,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "APPLIANCE_AGENT_SNAPSHOT_TIMEOUT": "30",
        "HTTP_PROXY": refused,
        "HTTPS_PROXY": refused,
        "ALL_PROXY": refused,
        "NO_PROXY": "127.0.0.1,localhost",
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken"),  # empty: no cached encoding either
    }
    launcher = Path(sys.executable).with_name("opentelemetry-instrument")
    with VLLMClient(mtp_engine.url) as obs:
        before = obs.snapshot()
        done = subprocess.run(
            [str(launcher), sys.executable, str(script)],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        delta = specdecode.delta(before, obs.snapshot())
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stderr.split("SAID ", 1)[1].splitlines()[0])
    every = _spans(done.stdout)
    spans = [s for s in every if "gen_ai.vllm.mtp.source" in s["attributes"]]
    assert len(spans) == len(said), [s["name"] for s in every]
    # The Anthropic SDK (2.x) traces its own calls too: each of its spans sits under the agent's
    # span of that call, never beside it as a second call.
    ours = {s["context"]["span_id"]: s for s in spans}
    sdk = [s for s in every if s["name"].startswith("anthropic.")]
    assert len(sdk) == sum(call[0] == "messages" for call in said), [s["name"] for s in every]
    assert all(ours[s["parent_id"]]["name"] == f"chat {MODEL}" for s in sdk), sdk
    assert len(every) == len(spans) + len(sdk), [s["name"] for s in every]
    by_start = sorted(spans, key=lambda s: s["start_time"])
    for (operation, stream, source, attribute, engine_said, engine), span in zip(
        said, by_start, strict=True
    ):
        a = span["attributes"]
        counters = operation in ("responses", "messages")
        assert a["gen_ai.operation.name"] == ("chat" if counters else operation)
        assert a["gen_ai.request.stream"] is stream
        # /v1/responses and /v1/messages carry no per-request block on 0.32, nor does a chat
        # stream without usage: the counters path, exact even after per-request calls that read
        # nothing (the call reads a fresh before-reading first).
        assert (a["gen_ai.vllm.mtp.source"], a["gen_ai.vllm.mtp.shared"]) == (source, False), a
        assert a[attribute] == engine_said, (operation, stream, a)
        if engine is not None:  # the call's own block, or the counters' delta over it
            assert a["gen_ai.vllm.mtp.draft_tokens"] == engine["draft_tokens"] > 0, (engine, a)
            assert a["gen_ai.vllm.mtp.accepted"] == engine["accepted"], (engine, a)
            rate = engine["accepted"] / engine["draft_tokens"]
            assert a["gen_ai.vllm.mtp.acceptance"] == pytest.approx(rate, abs=1e-9), (engine, a)
    # Every call exact, so together they are the engine's counter delta over the script.
    assert sum(s["attributes"]["gen_ai.vllm.mtp.draft_tokens"] for s in spans) == delta.draft_tokens
    assert sum(s["attributes"]["gen_ai.vllm.mtp.accepted"] for s in spans) == delta.accepted


@pytest.fixture
def instrumented():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inst = OpenAIInstrumentor()
    inst.instrument(
        tracer_provider=provider,
        registry=CollectorRegistry(),
        config=agent.AgentConfig(snapshot_timeout=30.0),
    )
    try:
        yield exporter
    finally:
        inst.uninstrument()


def _creates():
    import importlib

    return [getattr(importlib.import_module(m), c).create for m, c, _, _ in METHODS]


def test_instrument_is_idempotent_and_uninstrument_restores_the_classes():
    bare = _creates()
    inst = OpenAIInstrumentor()
    inst.instrument(registry=CollectorRegistry())
    patched = _creates()
    assert all(p is not b for p, b in zip(patched, bare, strict=True))
    inst.instrument(registry=CollectorRegistry())  # a second time: nothing changes
    assert _creates() == patched
    inst.uninstrument()
    assert _creates() == bare


def test_a_server_that_is_not_vllm_passes_through_with_no_request_of_the_agents(
    instrumented, bad_metrics
):
    # A stand-in whose GETs answer 500 (counted) and whose POSTs answer 501: not vLLM. The
    # calls fail as they would bare; after the one /version probe the agent asks nothing more.
    fake = bad_metrics("500")
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="unused", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert fake.hits == 1  # the probe; no /metrics read, no second probe
    assert agent.flush(30)
    assert instrumented.get_finished_spans() == ()


@pytest.mark.engine
def test_anthropic_messages_sync_and_async_plain_and_streamed_get_the_counters_exact_figures(
    mtp_engine,
):
    # vLLM's /v1/messages sends no per-request block: each call's figures come from the
    # /metrics counters, and for sequential calls they equal the engine's own counter delta.
    import anthropic

    from appliance.agent.instrumentor import AnthropicInstrumentor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    inst = AnthropicInstrumentor()
    inst.instrument(
        tracer_provider=provider,
        registry=registry,
        config=agent.AgentConfig(snapshot_timeout=30.0),
        role="architect",
    )
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    # The SDK (2.x) names no temperature or top_k: they go in the body's extras, which vLLM reads
    # and the span's request attributes read too.
    kw |= {"max_tokens": 24, "stop_sequences": ["ZZZ"]}
    kw |= {"extra_body": {"temperature": 0, "top_k": 1}}
    sync = anthropic.Anthropic(base_url=mtp_engine.url, api_key="unused", max_retries=0)

    async def acreate(**more):
        # A client per event loop: asyncio.run closes the loop its connections belong to.
        a = anthropic.AsyncAnthropic(base_url=mtp_engine.url, api_key="unused", max_retries=0)
        got = await a.messages.create(**kw, **more)
        return [e async for e in got] if more else got

    # messages.stream(...) posts without going through create (its with block sends the
    # request); each way of reading it goes through the agent: events, text_stream, the final
    # message alone.
    def sync_stream():
        with sync.messages.stream(**kw) as s:
            assert [e.type for e in s][-1] == "message_stop"
            return s.get_final_message()

    async def astream():
        a = anthropic.AsyncAnthropic(base_url=mtp_engine.url, api_key="unused", max_retries=0)
        async with a.messages.stream(**kw) as s:
            assert "".join([t async for t in s.text_stream])
            return await s.get_final_message()

    def sync_final_only():
        with sync.messages.stream(**kw) as s:
            return s.get_final_message()

    def streamed(events) -> tuple[str, int, str]:
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        final = next(e for e in events if e.type == "message_delta")
        return events[0].message.id, final.usage.output_tokens, final.delta.stop_reason

    calls = {
        "sync plain": lambda: sync.messages.create(**kw),
        "sync stream": lambda: list(sync.messages.create(**kw, stream=True)),
        "async plain": lambda: asyncio.run(acreate()),
        "async stream": lambda: asyncio.run(acreate(stream=True)),
        "sync messages.stream": sync_stream,
        "async messages.stream": lambda: asyncio.run(astream()),
        "sync messages.stream, final message only": sync_final_only,
    }
    try:
        with VLLMClient(mtp_engine.url) as obs:
            for name, make in calls.items():
                before = obs.snapshot()
                got = make()
                assert agent.flush(30)
                delta = specdecode.delta(before, obs.snapshot())
                if isinstance(got, list):
                    rid, out, stop = streamed(got)
                else:
                    rid, out, stop = got.id, got.usage.output_tokens, got.stop_reason
                span = exporter.get_finished_spans()[-1]
                a = span.attributes
                assert span.name == f"chat {MODEL}", name
                assert a["gen_ai.operation.name"] == "chat"
                assert a["gen_ai.request.stream"] is ("stream" in name)
                assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.top_k"]) == (24, 1)
                assert a["gen_ai.request.stop_sequences"] == ("ZZZ",)
                assert (a["gen_ai.response.id"], a["gen_ai.usage.output_tokens"]) == (rid, out)
                assert a["gen_ai.response.finish_reasons"] == (stop,)
                assert a["gen_ai.usage.input_tokens"] > 0
                assert a["appliance.agent.role"] == "architect"
                assert (a["gen_ai.vllm.mtp.source"], a["gen_ai.vllm.mtp.shared"]) == (
                    "counters",
                    False,
                ), (name, a)
                assert a["gen_ai.vllm.mtp.draft_tokens"] == delta.draft_tokens > 0, name
                assert a["gen_ai.vllm.mtp.accepted"] == delta.accepted, name
    finally:
        inst.uninstrument()
    assert len(exporter.get_finished_spans()) == len(calls)
    labels = {"role": "architect", "model": MODEL, "source": "counters", "outcome": "ok"}
    assert registry.get_sample_value("gemma4_agent_calls_total", labels) == len(calls)


def _anthropic_methods():
    from anthropic.resources.messages import AsyncMessages, Messages

    return [getattr(c, m) for c in (Messages, AsyncMessages) for m in ("create", "stream")]


def test_the_anthropic_instrumentor_is_idempotent_and_leaves_create_and_stream_bare():
    from appliance.agent.instrumentor import AnthropicInstrumentor

    bare = _anthropic_methods()
    inst = AnthropicInstrumentor()
    inst.instrument(registry=CollectorRegistry())
    patched = _anthropic_methods()
    assert all(p is not b for p, b in zip(patched, bare, strict=True))
    inst.instrument(registry=CollectorRegistry())
    assert _anthropic_methods() == patched
    inst.uninstrument()
    assert _anthropic_methods() == bare


@pytest.mark.engine
def test_anthropic_messages_stream_left_early_cancelled_or_unentered_ends_once_leaks_nothing(
    mtp_engine,
):
    # The failure modes of a messages.stream the proxy survives, against the real engine:
    # the with block left after the first event (sync, and async by a real task.cancel()), an
    # exception raised inside it, and a manager never entered. None raises anything of the
    # agent's; each call has exactly one span, none claims exact figures it cannot prove, no
    # window is left open, and the next call is exact again.
    import gc

    import anthropic

    from appliance.agent.instrumentor import AnthropicInstrumentor
    from appliance.agent.server import server_for

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inst = AnthropicInstrumentor()
    cfg = agent.AgentConfig(snapshot_timeout=30.0)
    inst.instrument(tracer_provider=provider, registry=CollectorRegistry(), config=cfg)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    kw |= {"max_tokens": 64, "extra_body": {"temperature": 0}}
    sync = anthropic.Anthropic(base_url=mtp_engine.url, api_key="unused", max_retries=0)

    async def cancelled():
        a = anthropic.AsyncAnthropic(base_url=mtp_engine.url, api_key="unused", max_retries=0)
        first = asyncio.Event()

        async def read():
            async with a.messages.stream(**kw) as s:
                async for _ in s:
                    first.set()
                    await asyncio.sleep(30)

        task = asyncio.create_task(read())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        with VLLMClient(mtp_engine.url) as obs:
            before = idle(obs)
            with sync.messages.stream(**kw) as s:  # left after the first event
                next(iter(s))
            assert agent.flush(30)
            left_early = specdecode.delta(before, idle(obs))
        asyncio.run(cancelled())
        with pytest.raises(ValueError, match="the caller's"), sync.messages.stream(**kw) as s:
            next(iter(s))
            raise ValueError("the caller's own error")
        sync.messages.stream(**kw)  # built, never entered: nothing sent
        gc.collect()
        assert agent.flush(30)
        assert server_for(mtp_engine.url + specdecode.SNAPSHOT_PATH)._active == set()
        spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
        assert len(spans) == 4, [s.name for s in spans]
        a = [s.attributes for s in spans]
        # Left early: the final usage (message_delta) never came. The figures are exact only
        # when the after-read found the aborted request ended and nothing running (the proof
        # without usage; whether the abort ended first is the host's timing), and then they are
        # the engine's own for that request; else shared or unknown, never a wrong exact claim.
        assert "gen_ai.usage.output_tokens" not in a[0], a[0]
        if (a[0]["gen_ai.vllm.mtp.source"], a[0]["gen_ai.vllm.mtp.shared"]) == ("counters", False):
            assert a[0]["gen_ai.vllm.mtp.draft_tokens"] == left_early.draft_tokens > 0, a[0]
        else:
            assert a[0]["gen_ai.vllm.mtp.source"] in ("shared", "unknown"), a[0]
        assert (a[1]["error.type"], a[1]["gen_ai.vllm.mtp.status"]) == (
            "CancelledError",
            "call_failed",
        )
        assert (a[2]["error.type"], a[2]["gen_ai.vllm.mtp.status"]) == ("ValueError", "call_failed")
        assert a[3]["gen_ai.vllm.mtp.status"] == "abandoned"
        # The engine's aborted requests have ended; the next call is exact again.
        with VLLMClient(mtp_engine.url) as obs:
            before = idle(obs)
            with sync.messages.stream(**kw) as s:
                s.until_done()
            assert agent.flush(30)
            delta = specdecode.delta(before, obs.snapshot())
        last = exporter.get_finished_spans()[-1].attributes
        assert (last["gen_ai.vllm.mtp.source"], last["gen_ai.vllm.mtp.shared"]) == (
            "counters",
            False,
        )
        assert last["gen_ai.vllm.mtp.draft_tokens"] == delta.draft_tokens > 0
    finally:
        inst.uninstrument()


def test_a_client_both_proxied_and_patched_gets_one_span_the_proxys():
    # The application wraps its client with instrument(client) and also runs under the
    # instrumentor: the proxy's call reaches the patched class method, which must not trace it
    # a second time. The server is listed (no probe) and refuses the connection: the call fails
    # as it would bare, sync and async, and each call has exactly one span, with the proxy's role.
    url = f"http://127.0.0.1:{free_port()}"
    cfg = agent.AgentConfig(attribution="off", servers=(url,))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inst = OpenAIInstrumentor()
    inst.instrument(tracer_provider=provider, registry=CollectorRegistry(), config=cfg)
    try:
        kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for cls in (openai.OpenAI, openai.AsyncOpenAI):
            client = agent.instrument(
                cls(base_url=url + "/v1", api_key="unused", max_retries=0),
                role="proxied",
                config=cfg,
                tracer_provider=provider,
                registry=CollectorRegistry(),
            )
            create = client.chat.completions.create
            with pytest.raises(openai.APIConnectionError):
                if cls is openai.AsyncOpenAI:
                    asyncio.run(create(**kw))
                else:
                    create(**kw)
        # The patched method alone (a plain client) still traces: the guard only skips nesting.
        plain = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            plain.chat.completions.create(**kw)
    finally:
        inst.uninstrument()
    assert agent.flush(30)
    roles = [s.attributes["appliance.agent.role"] for s in exporter.get_finished_spans()]
    assert roles == ["proxied", "proxied", "default"]


@pytest.mark.engine
def test_a_counters_call_after_a_per_request_call_reads_nothing_on_its_callers_thread(mtp_engine):
    # An application mixing chat (the per-request block, no read) and the Anthropic SDK (the
    # counters path) on one server: each per-request call reads after itself on the agent's
    # thread, so the counters call after it starts from that reading, with no read of its own
    # on the caller's thread, and is still exact. The reads are counted by wrapping the real
    # Server.read (they stay real).
    import threading

    import anthropic

    from appliance.agent.instrumentor import AnthropicInstrumentor
    from appliance.agent.server import server_for

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = agent.AgentConfig(snapshot_timeout=30.0)
    chat = agent.instrument(
        openai.OpenAI(base_url=mtp_engine.url + "/v1", api_key="unused", max_retries=0),
        config=cfg,
        tracer_provider=provider,
        registry=CollectorRegistry(),
    )
    inst = AnthropicInstrumentor()
    inst.instrument(tracer_provider=provider, registry=CollectorRegistry(), config=cfg)
    srv = server_for(mtp_engine.url + specdecode.SNAPSHOT_PATH)
    caller, on_caller = threading.current_thread(), []
    real_read = srv.read

    def counted(*args, **kwargs):
        on_caller.append(threading.current_thread() is caller)
        return real_read(*args, **kwargs)

    srv.read = counted
    msg = [{"role": "user", "content": "Tell me about the sea."}]
    messages = anthropic.Anthropic(base_url=mtp_engine.url, api_key="unused", max_retries=0)
    try:
        messages.messages.create(model=MODEL, messages=msg, max_tokens=16)  # counters seen
        assert agent.flush(30)
        with VLLMClient(mtp_engine.url) as obs:
            for _ in range(3):
                chat.chat.completions.create(model=MODEL, messages=msg, max_tokens=16)
                assert agent.flush(30)
                on_caller.clear()
                before = obs.snapshot()
                messages.messages.create(model=MODEL, messages=msg, max_tokens=16)
                assert agent.flush(30)
                delta = specdecode.delta(before, obs.snapshot())
                assert not any(on_caller), on_caller  # its one read was the agent thread's
                a = exporter.get_finished_spans()[-1].attributes
                assert (a["gen_ai.vllm.mtp.source"], a["gen_ai.vllm.mtp.shared"]) == (
                    "counters",
                    False,
                ), a
                assert a["gen_ai.vllm.mtp.draft_tokens"] == delta.draft_tokens > 0
    finally:
        del srv.read
        inst.uninstrument()


@pytest.mark.engine
def test_with_the_upstream_openai_instrumentation_a_vllm_call_has_one_span_ours_with_figures(
    mtp_engine, bad_metrics
):
    # Both instrumentors wrap chat completions' create. In either order they instrument, a call
    # to vLLM has exactly one span, the agent's, with the per-request figures; a call to
    # another server keeps the upstream span alone; uninstrumenting either, in either order,
    # leaves the other working and, at the end, the classes bare.
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor as Upstream

    bare = _creates()
    msg = [{"role": "user", "content": "Tell me about the sea."}]
    kw = {"model": MODEL, "messages": msg, "max_tokens": 16, "temperature": 0}
    fake = bad_metrics("500")

    def block(obj) -> int:
        return obj.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"]

    def sync_stream(client):
        chunks = list(
            client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
        )
        return chunks[-1]

    async def aplain():
        a = openai.AsyncOpenAI(base_url=mtp_engine.url + "/v1", api_key="unused", max_retries=0)
        return await a.chat.completions.create(**kw)

    for upstream_first in (True, False):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        ours, theirs = OpenAIInstrumentor(), Upstream()
        cfg = agent.AgentConfig(snapshot_timeout=30.0)
        settings = {
            theirs: {"tracer_provider": provider},
            ours: {"tracer_provider": provider, "registry": CollectorRegistry(), "config": cfg},
        }
        for inst in (theirs, ours) if upstream_first else (ours, theirs):
            inst.instrument(**settings[inst])
        try:
            client = openai.OpenAI(base_url=mtp_engine.url + "/v1", api_key="unused", max_retries=0)
            said = [
                block(client.chat.completions.create(**kw)),
                block(sync_stream(client)),
                block(asyncio.run(aplain())),
            ]
            assert agent.flush(30)
            spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
            assert [s.instrumentation_scope.name for s in spans] == ["appliance.agent"] * 3, (
                upstream_first,
                [(s.name, s.instrumentation_scope.name) for s in spans],
            )
            for span, engine_said in zip(spans, said, strict=True):
                a = span.attributes
                assert (a["gen_ai.vllm.mtp.source"], a["gen_ai.vllm.mtp.status"]) == (
                    "request",
                    "ok",
                )
                assert a["gen_ai.vllm.mtp.draft_tokens"] == engine_said > 0
            # Another server: not vLLM, so the agent passes it by and the upstream traces it.
            exporter.clear()
            other = openai.OpenAI(base_url=fake.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError):
                other.chat.completions.create(**kw)
            (span,) = exporter.get_finished_spans()
            assert span.instrumentation_scope.name.startswith("opentelemetry."), span
            assert "gen_ai.vllm.mtp.source" not in span.attributes
            # The upstream one goes first: ours still traces the vLLM call, alone.
            exporter.clear()
            theirs.uninstrument()
            block(client.chat.completions.create(**kw))
            assert agent.flush(30)
            assert [s.instrumentation_scope.name for s in exporter.get_finished_spans()] == [
                "appliance.agent"
            ]
        finally:
            theirs.uninstrument()
            ours.uninstrument()
        assert _creates() == bare
    # And ours first, then theirs: the classes are bare again too.
    ours.instrument(registry=CollectorRegistry())
    theirs.instrument()
    ours.uninstrument()  # theirs alone is left on create
    wrapper = openai.resources.chat.completions.Completions.create
    assert wrapper._self_wrapper.__module__ == "opentelemetry.instrumentation.openai_v2.patch"
    theirs.uninstrument()
    assert _creates() == bare


def test_the_upstream_instrumentations_wrapt_layers_are_looked_beneath():
    """The layers ``wrapt.wrap_function_wrapper`` puts on ``create`` (what the upstream OpenAI
    instrumentation uses), seen bound: under wrapt 2 they are not ``wrapt.ObjectProxy``
    instances, and a check for that class sent every call through the upstream layer too (two
    CLIENT spans per call, caught by the README-settings test)."""
    through: list[str] = []

    class Completions:
        def create(self, **kwargs):
            return "sent"

    def upstream(wrapped, instance, args, kwargs):
        through.append(upstream.__module__)
        return wrapped(*args, **kwargs)

    upstream.__module__ = f"{UPSTREAM_OPENAI}.patch"
    wrapt.wrap_function_wrapper(Completions, "create", upstream)
    assert beneath_upstream(Completions().create)() == "sent"
    assert through == []
    # Another instrumentation's layer stays: only the upstream OpenAI one is looked beneath.
    upstream.__module__ = "opentelemetry.instrumentation.other"
    assert beneath_upstream(Completions().create)() == "sent"
    assert through == ["opentelemetry.instrumentation.other"]
