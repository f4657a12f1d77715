"""The real vLLM CPU engine with the tiny Gemma 4 pair: MTP counters move as designed."""

from __future__ import annotations

import httpx
import pytest

from appliance.engine_api import specdecode
from appliance.engine_api.vllm_client import VLLMClient

pytestmark = pytest.mark.engine

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def chat(url: str, max_tokens: int = 64, **extra) -> dict:
    body = {
        "model": "gemma4-tiny",
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()


def measured_call(url: str, max_tokens: int = 64) -> tuple[dict, specdecode.Delta]:
    client = VLLMClient(url)
    before = client.snapshot()
    body = chat(url, max_tokens)
    return body, specdecode.delta(before, client.snapshot())


def test_vllm_loads_the_pair_with_method_mtp(mtp_engine):
    client = VLLMClient(mtp_engine.url)
    assert client.version() == "0.32.0"
    assert [m.id for m in client.models()] == ["gemma4-tiny"]
    assert "Gemma4 MTP: draft layer" in mtp_engine.log_path.read_text()


def test_copy_drafter_is_accepted_almost_always(mtp_engine):
    body, d = measured_call(mtp_engine.url)
    assert body["usage"]["completion_tokens"] == 64
    assert d.status == "ok" and d.drafts > 0
    assert d.acceptance >= 0.9
    assert d.tokens_per_step > 2.5  # k=2: at most 3


def test_random_drafter_is_accepted_almost_never(mtp_random_engine):
    body, d = measured_call(mtp_random_engine.url)
    assert body["usage"]["completion_tokens"] == 64
    assert d.status == "ok" and d.draft_tokens > 0
    assert d.acceptance <= 0.1


def test_baseline_has_no_speculative_series_and_says_so(baseline_engine):
    body, d = measured_call(baseline_engine.url)
    assert body["usage"]["completion_tokens"] == 64
    assert not VLLMClient(baseline_engine.url).snapshot().speculative
    assert d.status == "absent"
    assert d.acceptance is None and d.tokens_per_step is None  # not "zero acceptance"


def test_streamed_tokens_come_from_usage_and_chunk_counting_is_wrong(mtp_engine):
    body = {
        "model": "gemma4-tiny",
        "messages": PROMPT,
        "max_tokens": 64,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    content_chunks, usage = 0, None
    with httpx.stream(
        "POST", mtp_engine.url + "/v1/chat/completions", json=body, timeout=120
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                content_chunks += 1
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage["completion_tokens"] == 64
    # Under MTP one chunk carries 1 + accepted tokens, so chunks undercount the tokens.
    assert content_chunks < usage["completion_tokens"]
    assert content_chunks <= 64 / 2


def test_per_request_figures_equal_the_counter_delta(mtp_engine):
    body, d = measured_call(mtp_engine.url)
    exact = specdecode.from_response_metrics(body)
    assert exact is not None
    assert (exact.drafts, exact.draft_tokens, exact.accepted) == (
        d.drafts,
        d.draft_tokens,
        d.accepted,
    )
    assert exact.accepted_per_pos == d.accepted_per_pos
