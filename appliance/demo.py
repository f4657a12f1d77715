"""The demo: real chat completions against the real engine, with per-call MTP figures.

Calls run one after another, so a counter snapshot before and after each call is that call's
exact figure (nothing overlaps it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import openai

from . import specdecode
from .vllm_client import VLLMClient

PROMPTS = (
    "Write a short poem about the sea.",
    "Explain speculative decoding in two sentences.",
    "List three uses of a paperclip.",
    "Summarise the plot of a heist film.",
)


@dataclass(frozen=True)
class CallRecord:
    """One demo call and what MTP did for it."""

    call: int
    stream: bool
    output_tokens: int
    chunks: int | None
    drafts: int | None
    drafted: int | None
    accepted: int | None
    acceptance: float | None
    tokens_per_step: float | None
    source: str  # "counters", "absent" (no speculative decoding) or "reset"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DemoReport:
    url: str
    model: str
    calls: list[CallRecord]

    @property
    def totals(self) -> dict:
        drafts = sum(c.drafts or 0 for c in self.calls)
        drafted = sum(c.drafted or 0 for c in self.calls)
        accepted = sum(c.accepted or 0 for c in self.calls)
        return {
            "calls": len(self.calls),
            "output_tokens": sum(c.output_tokens for c in self.calls),
            "drafts": drafts,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": specdecode.acceptance(accepted, drafted),
            "tokens_per_step": specdecode.tokens_per_step(accepted, drafts),
        }

    def to_dict(self) -> dict:
        return {"url": self.url, "model": self.model,
                "calls": [c.to_dict() for c in self.calls], "totals": self.totals}


def run(url: str, calls: int = 4, max_tokens: int = 64) -> DemoReport:
    """Send ``calls`` chat completions (every other one streamed) and measure each."""
    observer = VLLMClient(url)
    model = observer.models()[0].id
    client = openai.OpenAI(base_url=observer.base_url + "/v1", api_key="unused")
    records = []
    for i in range(calls):
        stream = i % 2 == 1
        before = observer.snapshot()
        tokens, chunks = _call(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, stream)
        d = specdecode.delta(before, observer.snapshot())
        records.append(
            CallRecord(
                call=i + 1, stream=stream, output_tokens=tokens, chunks=chunks,
                drafts=d.drafts, drafted=d.draft_tokens, accepted=d.accepted,
                acceptance=d.acceptance, tokens_per_step=d.tokens_per_step,
                source={"ok": "counters"}.get(d.status, d.status),
            )
        )
    observer.close()
    return DemoReport(url, model, records)


def _call(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, stream: bool):
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        resp = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        return resp.usage.completion_tokens, None
    chunks, tokens = 0, 0
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    ):
        if chunk.choices:
            chunks += 1
        if chunk.usage is not None:
            # Under MTP one chunk carries 1 + accepted tokens: count from usage, never chunks.
            tokens = chunk.usage.completion_tokens
    return tokens, chunks


def format_table(report: DemoReport) -> str:
    """The per-call table and totals, as printed by ``appliance demo``."""
    head = f"{'call':>4} {'mode':<6} {'out_tok':>7} {'drafts':>6} {'drafted':>7} " \
           f"{'accepted':>8} {'accept':>7} {'tok/step':>8}"
    lines = [f"model {report.model} at {report.url}", head]
    for c in report.calls:
        lines.append(
            f"{c.call:>4} {'stream' if c.stream else 'plain':<6} {c.output_tokens:>7} "
            f"{_n(c.drafts):>6} {_n(c.drafted):>7} {_n(c.accepted):>8} "
            f"{_f(c.acceptance):>7} {_f(c.tokens_per_step):>8}"
        )
    t = report.totals
    lines.append(
        f"{'all':>4} {'':<6} {t['output_tokens']:>7} {t['drafts']:>6} {t['drafted']:>7} "
        f"{t['accepted']:>8} {_f(t['acceptance']):>7} {_f(t['tokens_per_step']):>8}"
    )
    return "\n".join(lines)


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
