"""Zero-code: the agent's OpenTelemetry instrumentor, loaded by ``opentelemetry-instrument``.

The script under test imports only ``openai``: it knows nothing of the agent. It runs under the
real ``opentelemetry-instrument`` launcher against the session's real CPU engine, with the
console exporter; the spans it prints are the evidence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from appliance import agent, specdecode
from appliance.agent.instrumentor import METHODS, OpenAIInstrumentor
from appliance.vllm_client import VLLMClient

MODEL = "gemma4-tiny"

# Sequential calls, each after the previous one's figures had time to complete (the script
# cannot call agent.flush: it does not know the agent). It prints what the engine itself said
# per call (the per-request block, where the endpoint returns one) to stderr.
SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    import openai

    URL = os.environ["ENGINE_URL"] + "/v1"
    MSG = [{"role": "user", "content": "Tell me about the sea."}]
    said = []

    def block(obj):
        extra = getattr(obj, "model_extra", None) or {}
        sd = (extra.get("metrics") or {}).get("speculative_decoding")
        return sd and sd["num_draft_tokens"]

    def pause():
        time.sleep(1.5)

    c = openai.OpenAI(base_url=URL, api_key="unused", max_retries=0)
    r = c.chat.completions.create(model="gemma4-tiny", messages=MSG, max_tokens=24, temperature=0)
    said.append(("chat", False, block(r))); pause()
    last = None
    for last in c.chat.completions.create(
        model="gemma4-tiny", messages=MSG, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        pass
    said.append(("chat", True, block(last))); pause()
    r = c.completions.create(model="gemma4-tiny", prompt="The sea is", max_tokens=24, temperature=0)
    said.append(("text_completion", False, block(r))); pause()
    r = c.responses.create(model="gemma4-tiny", input="Tell me about the sea.",
                           max_output_tokens=24, temperature=0)
    said.append(("responses", False, r.usage.output_tokens)); pause()
    for ev in c.responses.create(model="gemma4-tiny", input="Tell me about the sea.",
                                 max_output_tokens=24, temperature=0, stream=True):
        pass
    said.append(("responses", True, ev.response.usage.output_tokens)); pause()

    async def main():
        a = openai.AsyncOpenAI(base_url=URL, api_key="unused", max_retries=0)
        r = await a.chat.completions.create(
            model="gemma4-tiny", messages=MSG, max_tokens=24, temperature=0)
        said.append(("chat", False, block(r)))
        await asyncio.sleep(1.5)
        s = await a.responses.create(model="gemma4-tiny", input="Tell me about the sea.",
                                     max_output_tokens=24, temperature=0, stream=True)
        async for ev in s:
            pass
        said.append(("responses", True, ev.response.usage.output_tokens))
        await asyncio.sleep(1.5)

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
    env = {
        **os.environ,
        "ENGINE_URL": mtp_engine.url,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "APPLIANCE_AGENT_SNAPSHOT_TIMEOUT": "30",
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
    spans = [s for s in _spans(done.stdout) if s["attributes"].get("gen_ai.provider.name")]
    assert len(spans) == len(said), [s["name"] for s in spans]
    by_start = sorted(spans, key=lambda s: s["start_time"])
    for (operation, stream, engine_said), span in zip(said, by_start, strict=True):
        a = span["attributes"]
        assert a["gen_ai.operation.name"] == ("chat" if operation == "responses" else operation)
        assert a["gen_ai.request.stream"] is stream
        if operation == "responses":
            # /v1/responses carries no per-request block on 0.32: the counters path.
            # (or "shared": see the xfail below)
            assert a["gen_ai.vllm.mtp.source"] in ("counters", "shared"), a
            assert a["gen_ai.usage.output_tokens"] == engine_said
        else:
            assert a["gen_ai.vllm.mtp.shared"] is False, a
            assert a["gen_ai.vllm.mtp.source"] == "request", a
            assert a["gen_ai.vllm.mtp.draft_tokens"] == engine_said
    shared = [
        op
        for (op, _, _), s in zip(said, by_start, strict=True)
        if s["attributes"]["gen_ai.vllm.mtp.shared"]
        or s["attributes"]["gen_ai.vllm.mtp.source"] == "shared"
    ]
    if shared:
        # Never a wrong figure, but not yet exact: a counters-path call after per-request calls
        # that read nothing can get a before-reading that predates them (issue 28, open).
        pytest.xfail(f"issue 28, open: counters-path calls came out shared: {shared}")
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
