"""One streamed chat completion, timed per SSE chunk, counted from ``usage``.

Definitions (vLLM's, as in ``vllm bench serve``; GuideLLM's TPOT differs, see
gotchas/benchmarking-mtp.md):

- TTFT: send -> first streamed chunk that carries a choice.
- E2EL: send -> last chunk that carries a choice (the trailing usage chunk carries no token).
- ITL: gaps between consecutive choice-bearing chunks. Under MTP one chunk carries 1 + accepted
  tokens, so ITL is per engine step, not per token.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), output_tokens = ``usage.completion_tokens``.

The request itself is :meth:`VLLMClient.generate`'s (``stream=True``), which records when each
chunk arrived; this module turns those times into the figures above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from ..engine_api import specdecode
from ..engine_api.vllm_client import Generation


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

    @classmethod
    def from_generation(cls, gen: Generation) -> StreamResult:
        """The timings of a streamed :class:`Generation` (its ``chunk_times``)."""
        t = gen.chunk_times
        return cls(
            ttft_s=t[0],
            e2el_s=t[-1],
            itl_s=[b - a for a, b in pairwise(t)],
            output_tokens=gen.completion_tokens,
            prompt_tokens=gen.prompt_tokens,
            chunks=len(t),
            text=gen.text,
            finish_reason=gen.finish_reason,
            request_spec=gen.spec,
            raw_usage=gen.usage,
        )

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
