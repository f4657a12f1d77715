"""One streamed chat completion, timed per SSE chunk, counted from ``usage``.

Definitions (vLLM's, as in ``vllm bench serve``; GuideLLM's TPOT differs, see
gotchas/benchmarking-mtp.md):

- TTFT: send -> first streamed chunk that carries a choice.
- E2EL: send -> last chunk that carries a choice (the trailing usage chunk carries no token).
- ITL: gaps between consecutive choice-bearing chunks. Under MTP one chunk carries 1 + accepted
  tokens, so ITL is per engine step, not per token.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), output_tokens = ``usage.completion_tokens``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from .. import specdecode
from ..errors import EngineError


@dataclass
class StreamResult:
    """Timings and usage of one streamed request."""

    ttft_s: float
    e2el_s: float
    itl_s: list[float]
    output_tokens: int
    prompt_tokens: int | None
    chunks: int  # choice-bearing chunks: for information only, never used as a token count
    text: str
    finish_reason: str | None
    request_spec: specdecode.Delta | None = None  # per-request metrics, when the server sends them
    raw_usage: dict = field(default_factory=dict)

    @property
    def tpot_s(self) -> float | None:
        """vLLM's TPOT; ``None`` for a single-token output."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def output_tps(self) -> float:
        """End-to-end output tokens per second (TTFT and HTTP streaming included)."""
        return self.output_tokens / self.e2el_s if self.e2el_s > 0 else 0.0


def http_client(timeout_s: float, api_key: str | None = None) -> httpx.Client:
    """The client to stream with; ``api_key`` goes in ``Authorization`` (vLLM's ``--api-key``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)


def stream_chat(
    http: httpx.Client,
    base_url: str,
    model: str,
    messages: list[dict] | tuple[dict, ...],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> StreamResult:
    """Send one streamed chat completion and time it; raises EngineError on HTTP failures."""
    payload: dict = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is not None:
        payload["seed"] = seed
    url = base_url + "/v1/chat/completions"
    ttft = last = None
    itl: list[float] = []
    parts: list[str] = []
    chunks = 0
    usage: dict | None = None
    final: dict | None = None
    finish = None
    start = time.perf_counter()
    try:
        with http.stream("POST", url, json=payload) as resp:
            if resp.status_code == 401:
                raise EngineError(f"{url} answered 401: the API key is missing or wrong",
                                  fix="give --api-key-file (or --api-key) with the server's key")
            if resp.status_code != 200:
                body = resp.read().decode(errors="replace")[:300]
                raise EngineError(f"{url} answered {resp.status_code}: {body}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError as exc:
                    raise EngineError(f"{url} streamed a chunk that is not JSON: {data[:80]}") \
                        from exc
                if obj.get("choices"):
                    chunks += 1
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    choice = obj["choices"][0]
                    parts.append((choice.get("delta") or {}).get("content") or "")
                    finish = choice.get("finish_reason") or finish
                elif obj.get("usage"):
                    usage = obj["usage"]
                    final = obj
    except httpx.HTTPError as exc:
        raise EngineError(f"streaming from {url} failed: {exc}") from exc
    if ttft is None or last is None:
        raise EngineError(f"{url} streamed no tokens")
    if usage is None or "completion_tokens" not in usage:
        # Counting chunks instead would be wrong under MTP; refuse rather than guess.
        raise EngineError(f"{url} sent no usage (stream_options.include_usage unsupported?)")
    return StreamResult(
        ttft_s=ttft,
        e2el_s=last - start,
        itl_s=itl,
        output_tokens=int(usage["completion_tokens"]),
        prompt_tokens=usage.get("prompt_tokens"),
        chunks=chunks,
        text="".join(parts),
        finish_reason=finish,
        request_spec=specdecode.from_response_metrics(final),
        raw_usage=usage,
    )
