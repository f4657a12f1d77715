"""The demo: real chat completions against the real engine, through the telemetry agent.

Every call goes through :func:`appliance.agent.instrument`, so the figures are the agent's: the
response's per-request block when the server sends it (source ``request``), else counter
snapshots around the call (``counters``; the calls run one after another, so nothing overlaps).
Spans go to the OTLP endpoint when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import openai

from .. import agent
from ..engine_api import specdecode
from ..engine_api.vllm_client import VLLMClient
from ..tables import table

PROMPTS = (
    "Write a short poem about the sea.",
    "Explain speculative decoding in two sentences.",
    "List three uses of a paperclip.",
    "Summarise the plot of a heist film.",
)


@dataclass(frozen=True)
class DemoCall:
    """One demo call and what MTP did for it: the agent's figures as it recorded them (vLLM's
    names, and where they came from: request | counters | shared | absent | unknown)."""

    call: int
    stream: bool
    output_tokens: int
    chunks: int | None
    figures: agent.Figures
    role: str = "demo"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DemoReport:
    url: str
    model: str
    calls: list[DemoCall]
    # The engine's own counter movement over the whole demo, read independently of the agent:
    # with calls one after another, the per-call figures must add up to exactly this.
    engine_delta: specdecode.Delta | None = None

    @property
    def totals(self) -> dict:
        """The calls' figures added up; the ratios are over the sums (specdecode's)."""
        total = specdecode.summed([c.figures.counts for c in self.calls])
        total = total or specdecode.Delta("absent")
        figures = total.to_dict()
        return {
            "calls": len(self.calls),
            "output_tokens": sum(c.output_tokens for c in self.calls),
            **{
                k: figures[k]
                for k in ("drafts", "draft_tokens", "accepted", "acceptance", "tokens_per_step")
            },
        }

    def to_dict(self) -> dict:
        d = self.engine_delta
        return {
            "url": self.url,
            "model": self.model,
            "calls": [c.to_dict() for c in self.calls],
            "totals": self.totals,
            "engine_counters_delta": None if d is None else d.to_dict(),
        }


def run(url: str, calls: int = 4, max_tokens: int = 64, *, role: str = "demo") -> DemoReport:
    """Send ``calls`` chat completions (every other one streamed) through the agent."""
    observer = VLLMClient(url)
    model = observer.models()[0].id
    base = observer.base_url
    start = observer.snapshot()
    provider = agent.setup_tracing() if agent.exporting() else None
    seen: list[agent.CallRecord] = []
    client = agent.instrument(
        openai.OpenAI(base_url=base + "/v1", api_key="unused"),
        role=role,
        tracer_provider=provider,
        on_call=seen.append,
    )
    records = []
    try:
        for i in range(calls):
            stream = i % 2 == 1
            _call(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, stream)
            agent.flush()  # a /metrics-attributed call's record arrives from the agent's thread
            rec = seen[-1]
            out = rec.output_tokens or 0
            records.append(DemoCall(i + 1, stream, out, rec.chunks, rec.figures, rec.role))
        engine_delta = specdecode.delta(start, observer.snapshot())
    finally:
        client.close()
        observer.close()
        if provider is not None:
            provider.shutdown()  # flushes the batch of spans to the exporter
    return DemoReport(base, model, records, engine_delta)


def _call(client, model: str, prompt: str, max_tokens: int, stream: bool) -> None:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        return
    for _chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        pass  # the agent counts output tokens from usage: under MTP a chunk holds several


def format_table(report: DemoReport) -> str:
    """The per-call table and totals, as printed by ``appliance dev demo``."""
    headers = ("call", "mode", "out_tok", "drafts", "draft_tok", "accepted", "accept")
    headers += ("tok/step", "source")
    rows = [
        (
            c.call,
            "stream" if c.stream else "plain",
            c.output_tokens,
            _n(f.drafts),
            _n(f.draft_tokens),
            _n(f.accepted),
            _f(f.acceptance),
            _f(f.tokens_per_step),
            f.source + ("*" if f.shared else ""),
        )
        for c, f in ((c, c.figures) for c in report.calls)
    ]
    t = report.totals
    rows.append(
        ("all", "", t["output_tokens"], _n(t["drafts"]), _n(t["draft_tokens"]))
        + (_n(t["accepted"]), _f(t["acceptance"]), _f(t["tokens_per_step"]), "")
    )
    lines = [
        f"model {report.model} at {report.url}",
        table(headers, rows, ">" + "<" + ">" * 6 + "<"),
    ]
    d = report.engine_delta
    if d is not None:
        lines.append(
            f"engine counters over the demo: {d.status}, drafts {_n(d.drafts)}, "
            f"draft tokens {_n(d.draft_tokens)}, accepted {_n(d.accepted)}"
        )
    return "\n".join(lines)


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
