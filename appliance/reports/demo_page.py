"""The page of the demo's calls: per-call MTP figures from ``DemoReport.to_dict()``."""

from __future__ import annotations

from . import charts
from .figures import get, key
from .page import Cell, Reader, as_json, number, render


def render_demo(record: dict) -> str:
    """The HTML page for the demo's calls (``DemoReport.to_dict()``)."""
    record = as_json(record)
    r = Reader(record)
    calls = record["calls"]
    figures = [c["figures"] for c in calls]  # the agent's, as its call record holds them
    cats = [f"call {c['call']}" for c in calls]
    acceptance = r.chart(
        "call-acceptance",
        charts.bars(
            "Per-call draft acceptance",
            cats,
            {"acceptance": [number(get(f, "acceptance")) for f in figures]},
            "accepted / draft tokens",
            ylim=(0, 1.05),
        ),
    )
    tokens_per_step = r.chart(
        "call-tokens-per-step",
        charts.bars(
            "Per-call tokens per step",
            cats,
            {"tokens per step": [number(get(f, "tokens_per_step")) for f in figures]},
            "1 + accepted / drafts",
        ),
    )
    rows: list[list[Cell]] = []
    for i, (c, f) in enumerate(zip(calls, figures, strict=True)):
        b, fb = ("calls", i), ("calls", i, "figures")
        rows.append(
            [
                r.v((*b, "call"), "d"),
                "stream" if c["stream"] else "plain",
                r.v((*b, "output_tokens"), "d"),
                r.v((*fb, key(f, "drafts")), "d"),
                r.v((*fb, key(f, "draft_tokens")), "d"),
                r.v((*fb, key(f, "accepted")), "d"),
                r.v((*fb, key(f, "acceptance"))),
                r.v((*fb, key(f, "tokens_per_step"))),
                r.v((*fb, "source")),
            ]
        )
    t = record["totals"]
    tb = ("totals",)
    rows.append(
        [
            "all",
            "",
            r.v((*tb, "output_tokens"), "d"),
            r.v((*tb, key(t, "drafts")), "d"),
            r.v((*tb, key(t, "draft_tokens")), "d"),
            r.v((*tb, key(t, "accepted")), "d"),
            r.v((*tb, key(t, "acceptance"))),
            r.v((*tb, key(t, "tokens_per_step"))),
            "",
        ]
    )
    eng = record.get("engine_counters_delta")
    engine = None
    if eng:
        eb = ("engine_counters_delta",)
        engine = {
            "status": r.v((*eb, "status")),
            **{f: r.v((*eb, key(eng, f)), "d") for f in ("drafts", "draft_tokens", "accepted")},
        }
    return render(
        "demo.html.j2",
        r,
        "appliance dev demo: per-call MTP figures",
        model=r.v(("model",)),
        url=r.v(("url",)),
        acceptance_chart=acceptance,
        tokens_per_step_chart=tokens_per_step,
        rows=rows,
        engine=engine,
    )
