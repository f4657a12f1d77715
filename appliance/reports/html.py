"""One self-contained HTML page per bench, k-sweep or demo record.

The input is the record the JSON artifact is written from (``bench.report.artifact(...)`` or
``DemoReport.to_dict()``), never the live result objects, so the page and the artifact cannot
disagree. Every value printed is an element carrying ``data-path`` (where in the record it was
read) and ``data-scale`` (ms from s, percent from a fraction): the tests resolve each path in the
artifact and compare. No script, no stylesheet or font from elsewhere: viewable offline.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..bench import report as bench_report
from ..errors import UsageError
from ..fsutil import write_atomic
from . import charts
from .figures import get, key, resolve

CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:60rem;color:#1f2328;
  padding:0 1rem;line-height:1.45}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}
th,td{border:1px solid #d0d7de;padding:.25rem .5rem;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f6f8fa}
figure.chart{margin:1rem 0}figure.chart svg{max-width:100%;height:auto}
figcaption,.note{color:#57606a;font-size:.85rem}.good{color:#1a7f37}.bad{color:#cf222e}
dl{display:grid;grid-template-columns:max-content auto;gap:.2rem 1rem;font-size:.9rem}
dt{font-weight:600}dd{margin:0}
"""

Path_ = tuple[str | int, ...]


class Page:
    """Builds the page body from one record; every printed value names its path in it."""

    def __init__(self, record: dict, title: str) -> None:
        self.record = record
        self.title = title
        self.parts: list[str] = []
        self.chart_ids: list[str] = []

    def v(self, path: Path_, fmt: str = ".3f", scale: float = 1.0, suffix: str = "") -> str:
        """The value at ``path``, formatted, in an element naming the path ("-" when null)."""
        value = resolve(self.record, path)
        dotted = ".".join(str(p) for p in path)
        if value is None:
            return f'<span class="val" data-path="{html.escape(dotted)}" data-null="1">-</span>'
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            text = html.escape(str(value))
            return f'<span class="val" data-path="{html.escape(dotted)}">{text}</span>'
        text = format(value * scale if scale != 1.0 else value, fmt)
        return (
            f'<span class="val" data-path="{html.escape(dotted)}" data-scale="{scale!r}" '
            f'data-fmt="{fmt}">{text}</span>{suffix}'
        )

    def add(self, *parts: str) -> None:
        self.parts.extend(parts)

    def chart(self, chart_id: str, svg: str, caption: str) -> None:
        self.chart_ids.append(chart_id)
        self.add(
            f'<figure class="chart" id="chart-{chart_id}">{svg}'
            f"<figcaption>{caption}</figcaption></figure>"
        )

    def table(self, head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        th = "".join(f"<th>{h}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
        self.add(f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>")

    def html(self) -> str:
        charts_attr = " ".join(self.chart_ids)
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            # No network at view time: the policy blocks any fetch the page might still try.
            '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
            "style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{html.escape(self.title)}</title><style>{CSS}</style></head>"
            f'<body data-charts="{charts_attr}"><h1>{html.escape(self.title)}</h1>\n'
            + "\n".join(self.parts)
            + "\n</body></html>\n"
        )


def _as_json(record: dict) -> dict:
    """The record exactly as its JSON file reads back (tuples become lists, and so on)."""
    return json.loads(json.dumps(record))


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --- bench ------------------------------------------------------------------------------------


def _endpoints(p: Page) -> None:
    rows = []
    for i, ep in enumerate(p.record.get("endpoints") or []):
        base = ("endpoints", i)
        rows.append(
            [
                p.v((*base, "label")),
                p.v((*base, "url")),
                p.v((*base, "model")),
                p.v((*base, "vllm_version")),
                p.v((*base, "speculative")),
            ]
        )
    if rows:
        p.add("<h2>Endpoints</h2>")
        p.table(["side", "URL", "model", "vLLM", "speculative decoding"], rows)


def _config(p: Page) -> None:
    cfg = p.record["config"]
    p.add("<h2>Configuration</h2><dl>")
    p.add(f"<dt>runs per prompt</dt><dd>{p.v(('config', 'runs'), 'd')}</dd>")
    p.add(f"<dt>warm-ups</dt><dd>{p.v(('config', 'warmups'), 'd')}</dd>")
    p.add(
        "<dt>max_tokens</dt><dd>"
        + ", ".join(p.v(("config", "max_tokens", i), "d") for i in range(len(cfg["max_tokens"])))
        + "</dd>"
    )
    p.add(f"<dt>temperature</dt><dd>{p.v(('config', 'temperature'), 'g')}</dd>")
    p.add(f"<dt>seed</dt><dd>{p.v(('config', 'seed'), 'd')}</dd></dl>")


def _definitions(p: Page) -> None:
    p.add("<h2>Definitions</h2><dl>")
    for name in sorted(p.record.get("definitions") or {}):
        p.add(f"<dt>{html.escape(name)}</dt><dd>{p.v(('definitions', name))}</dd>")
    p.add("</dl>")


def _per_position(p: Page, base: Path_, label: str, chart_id: str) -> None:
    spec = resolve(p.record, base)
    pk = key(spec, "per_position")
    pos = spec.get(pk) or []
    if not pos:
        p.add(
            f'<p class="note">{html.escape(label)}: no per-position figures (no speculative '
            "decoding, or no exact figures).</p>"
        )
        return
    cats = [f"position {i}" for i in range(len(pos))]
    p.chart(
        chart_id,
        charts.bars(
            f"Acceptance by draft position: {label}",
            cats,
            {label: [_num(x) for x in pos]},
            "accepted at i / drafts",
            ylim=(0, 1.05),
        ),
        "vLLM's per-position acceptance: accepted at position i / drafts. Falls with i; "
        "the first position bounds all others.",
    )
    p.table(
        ["position", "acceptance"], [[f"pos {i}", p.v((*base, pk, i))] for i in range(len(pos))]
    )


def _groups_section(
    p: Page, side: str, base: Path_, other: Path_ | None = None, other_label: str = ""
) -> None:
    """Per prompt shape (prompt set x max_tokens): acceptance, tokens per step, TPOT, tok/s."""
    groups = resolve(p.record, (*base, "groups"))
    others = resolve(p.record, (*other, "groups")) if other else []
    if not groups:
        return
    cats = [f"{g['prompt_set']}/{g['max_tokens']}" for g in groups]
    p.add("<h2>Per prompt shape</h2>")
    acc = [_num(get(g["spec"], "acceptance")) for g in groups]
    if any(a is not None for a in acc):
        p.chart(
            "shape-acceptance",
            charts.bars(
                f"Acceptance by prompt shape: {side}",
                cats,
                {side: acc},
                "accepted / draft tokens",
                ylim=(0, 1.05),
                xlabel="prompt set / max_tokens",
            ),
            "Draft acceptance (accepted / draft tokens) per prompt set and output length.",
        )

    def tpot(gs, i):
        return _num((gs[i]["tpot_s"] or {}).get("median")) if i < len(gs) else None

    series = {
        side: [None if (t := tpot(groups, i)) is None else t * 1000 for i in range(len(groups))]
    }
    if other:
        series[other_label] = [
            None if (t := tpot(others, i)) is None else t * 1000 for i in range(len(groups))
        ]
    p.chart(
        "shape-tpot",
        charts.bars(
            "TPOT by prompt shape (median)",
            cats,
            series,
            "TPOT ms",
            xlabel="prompt set / max_tokens",
        ),
        "Time per output token, vLLM's definition: (end-to-end latency - TTFT) / (output "
        "tokens minus one), "
        "median over runs. Lower is better.",
    )
    head = [
        "prompt set",
        "max_tokens",
        "runs",
        f"acceptance ({side})",
        f"tokens per step ({side})",
        f"TPOT ms median ({side})",
        f"output tok/s ({side})",
    ]
    if other:
        head += [f"TPOT ms median ({other_label})", f"output tok/s ({other_label})"]
    rows = []
    for i, g in enumerate(groups):
        gb = (*base, "groups", i)
        row = [
            p.v((*gb, "prompt_set")),
            p.v((*gb, "max_tokens"), "d"),
            p.v((*gb, "runs"), "d"),
            p.v((*gb, "spec", key(g["spec"], "acceptance"))),
            p.v((*gb, "spec", key(g["spec"], "tokens_per_step"))),
            _summary(p, (*gb, "tpot_s"), "median", 1000.0, ".2f"),
            _summary(p, (*gb, "output_tps"), "median", 1.0, ".1f"),
        ]
        if other:
            ob = (*other, "groups", i)
            row += [
                _summary(p, (*ob, "tpot_s"), "median", 1000.0, ".2f"),
                _summary(p, (*ob, "output_tps"), "median", 1.0, ".1f"),
            ]
        rows.append(row)
    p.table(head, rows)


def _summary(p: Page, path: Path_, field: str, scale: float, fmt: str) -> str:
    node = resolve(p.record, path)
    return "-" if node is None else p.v((*path, field), fmt, scale)


def _spec_totals(p: Page, base: Path_, side: str) -> None:
    spec = resolve(p.record, base)
    rows = [
        [html.escape(name), p.v((*base, key(spec, fig)), fmt)]
        for name, fig, fmt in (
            ("drafts", "drafts", "d"),
            ("draft tokens", "draft_tokens", "d"),
            ("accepted tokens", "accepted", "d"),
            ("acceptance", "acceptance", ".3f"),
            ("mean acceptance length (tokens per step)", "tokens_per_step", ".3f"),
        )
    ]
    p.add(f"<h2>Speculative decoding: {html.escape(side)}</h2>")
    p.table(["figure", "value"], rows)


def _paired(p: Page) -> None:
    sp = p.record["paired"]["speedup"]
    p.add("<h2>MTP against the baseline</h2>")
    names, pts, lows, highs, rows = [], [], [], [], []
    for name, fig in (
        ("output tok/s (MTP / baseline)", "output_tps"),
        ("TPOT (baseline / MTP)", "tpot"),
    ):
        s = sp.get(fig)
        names.append(name)
        pts.append(_num(s and s["ratio"]))
        lows.append(_num(s and s["low"]))
        highs.append(_num(s and s["high"]))
        base = ("paired", "speedup", fig)
        if s is None:
            rows.append([html.escape(name), "-", "-", "-", "-"])
        else:
            rows.append(
                [
                    html.escape(name),
                    p.v((*base, "ratio"), ".3f", suffix="x"),
                    p.v((*base, "low")),
                    p.v((*base, "high")),
                    p.v((*base, "n"), "d"),
                ]
            )
    p.chart(
        "speedup",
        charts.intervals(
            "Speedup with 95% confidence interval",
            names,
            pts,
            lows,
            highs,
            "ratio (> 1: MTP faster)",
        ),
        "Geometric mean of paired ratios (same prompt, output length and run), 95% "
        "Student-t interval on the log ratios. The dashed line is no change.",
    )
    p.table(["speedup", "ratio", "95% CI low", "95% CI high", "pairs"], rows)
    par = p.record["paired"]["parity"]
    pb = ("paired", "parity")
    if par["checked"]:
        ok = par["differ"] == 0
        cls = "good" if ok else "bad"
        p.add(
            f'<h2>Output parity</h2><p class="{cls}">At temperature zero, '
            f"{p.v((*pb, 'equal'), 'd')} pairs equal, {p.v((*pb, 'differ'), 'd')} differ "
            "(the drafter may change speed, never the greedy output).</p>"
        )
        if par["differing"]:
            p.add(
                "<ul>"
                + "".join(
                    f"<li>{p.v((*pb, 'differing', i))}</li>" for i in range(len(par["differing"]))
                )
                + "</ul>"
            )
    else:
        p.add(f"<h2>Output parity</h2><p>Not checked: {p.v((*pb, 'reason'))}</p>")
    mtp, base = ("paired", "mtp"), ("paired", "baseline")
    _spec_totals(p, (*mtp, "spec_totals"), "MTP")
    _per_position(p, (*mtp, "spec_totals"), "MTP", "per-position")
    _groups_section(p, "MTP", mtp, base, "baseline")


def _single(p: Page) -> None:
    base = ("single",)
    _spec_totals(p, (*base, "spec_totals"), "endpoint")
    _per_position(p, (*base, "spec_totals"), "endpoint", "per-position")
    _groups_section(p, "endpoint", base)


def _sweep(p: Page) -> None:
    sw = p.record["sweep"]
    rows_ = sw["rows"]
    ks = [r["k"] for r in rows_]
    rec = sw.get("recommended_k")
    p.add("<h2>k sweep</h2>")
    if rec is not None:
        p.add(
            f"<p>Recommended num_speculative_tokens: <strong>{p.v(('sweep', 'recommended_k'), 'd')}"
            f"</strong> ({p.v(('sweep', 'criterion'))}).</p>"
        )

    def ci(row: dict, name: str, part: str, scale: float = 1.0) -> float | None:
        c = row.get(name)
        return None if not c or c.get(part) is None else c[part] * scale

    tps_name, tpot_name = "output_tps_mean_ci", "tpot_mean_ci_s"
    p.chart(
        "sweep-tps",
        charts.against_k(
            "Output tokens per second against k",
            ks,
            [ci(r, tps_name, "mean") for r in rows_],
            [ci(r, tps_name, "low") for r in rows_],
            [ci(r, tps_name, "high") for r in rows_],
            [_num(r["output_tps_median"]) for r in rows_],
            "output tok/s (end to end)",
            rec,
        ),
        "Per-request output tokens / end-to-end latency: mean with its 95% Student-t interval, "
        "and the median.",
    )
    p.chart(
        "sweep-tpot",
        charts.against_k(
            "TPOT against k",
            ks,
            [ci(r, tpot_name, "mean", 1000) for r in rows_],
            [ci(r, tpot_name, "low", 1000) for r in rows_],
            [ci(r, tpot_name, "high", 1000) for r in rows_],
            [None if r["tpot_median_s"] is None else r["tpot_median_s"] * 1000 for r in rows_],
            "TPOT ms",
            rec,
        ),
        "vLLM's TPOT, (end-to-end latency - TTFT) / (output tokens minus one): mean with its "
        "95% interval, and the "
        "median (the recommendation's criterion).",
    )
    width = max((len(get(r, "per_position") or []) for r in rows_), default=0)
    if width:
        series = {
            f"k={r['k']}": [_num(x) for x in (get(r, "per_position") or [])]
            + [None] * (width - len(get(r, "per_position") or []))
            for r in rows_
        }
        p.chart(
            "sweep-per-position",
            charts.bars(
                "Acceptance by draft position, each k",
                [f"position {i}" for i in range(width)],
                series,
                "accepted at i / drafts",
                ylim=(0, 1.05),
            ),
            "Per-position acceptance for each k: later positions are accepted only when every "
            "earlier one was.",
        )
    head = [
        "k",
        "TPOT ms median",
        "TPOT ms mean",
        "95% CI",
        "output tok/s median",
        "output tok/s mean",
        "95% CI",
        "tokens per step",
        "acceptance",
        "per position",
    ]
    rows = []
    for i, r in enumerate(rows_):
        b = ("sweep", "rows", i)
        pk = key(r, "per_position")
        pos = r.get(pk) or []
        rows.append(
            [
                p.v((*b, "k"), "d"),
                p.v((*b, "tpot_median_s"), ".2f", 1000.0),
                *_ci_cells(p, b, r, tpot_name, 1000.0, ".2f"),
                p.v((*b, "output_tps_median"), ".1f"),
                *_ci_cells(p, b, r, tps_name, 1.0, ".1f"),
                p.v((*b, key(r, "tokens_per_step"))),
                p.v((*b, key(r, "acceptance"))),
                " / ".join(p.v((*b, pk, j), ".2f") for j in range(len(pos))) or "-",
            ]
        )
    p.table(head, rows)


def _ci_cells(p: Page, base: Path_, row: dict, name: str, scale: float, fmt: str) -> list[str]:
    if not row.get(name):
        return ["-", "-"]
    b = (*base, name)
    interval = f"{p.v((*b, 'low'), fmt, scale)} - {p.v((*b, 'high'), fmt, scale)}"
    return [p.v((*b, "mean"), fmt, scale), interval]


def render_bench(artifact: dict) -> str:
    """The HTML page for a bench artifact (``bench.report.artifact``'s dict)."""
    artifact = _as_json(artifact)
    kind = artifact.get("kind")
    if kind not in ("paired", "sweep", "single"):
        raise UsageError(f"no report for a bench artifact of kind {kind!r}")
    titles = {"paired": "MTP against its baseline", "sweep": "k sweep", "single": "one endpoint"}
    p = Page(artifact, f"appliance bench: {titles[kind]}")
    p.add(
        f'<p class="note">Kind <code>{p.v(("kind",))}</code>, appliance '
        f"{p.v(('environment', 'versions', 'appliance'))}. Same record as the JSON "
        "artifact; figures in vLLM's terms (definitions at the end).</p>"
    )
    _endpoints(p)
    {"paired": _paired, "sweep": _sweep, "single": _single}[kind](p)
    _config(p)
    _definitions(p)
    return p.html()


# --- demo -------------------------------------------------------------------------------------


def render_demo(record: dict) -> str:
    """The HTML page for the demo's calls (``DemoReport.to_dict()``)."""
    record = _as_json(record)
    p = Page(record, "appliance demo: per-call MTP figures")
    p.add(f"<p>Model {p.v(('model',))} at {p.v(('url',))}, calls through the telemetry agent.</p>")
    calls = record["calls"]
    cats = [f"call {c['call']}" for c in calls]
    p.chart(
        "call-acceptance",
        charts.bars(
            "Per-call draft acceptance",
            cats,
            {"acceptance": [_num(get(c, "acceptance")) for c in calls]},
            "accepted / draft tokens",
            ylim=(0, 1.05),
        ),
        "Each call's accepted / draft tokens, from the agent (vLLM's per-request figures when "
        "the server sends them).",
    )
    p.chart(
        "call-tokens-per-step",
        charts.bars(
            "Per-call tokens per step",
            cats,
            {"tokens per step": [_num(get(c, "tokens_per_step")) for c in calls]},
            "1 + accepted / drafts",
        ),
        "Mean acceptance length per call: one plus accepted / drafts (the bonus token); one "
        "means MTP gained nothing, the ceiling is one plus k.",
    )
    rows = []
    for i, c in enumerate(calls):
        b = ("calls", i)
        rows.append(
            [
                p.v((*b, "call"), "d"),
                "stream" if c["stream"] else "plain",
                p.v((*b, "output_tokens"), "d"),
                p.v((*b, key(c, "drafts")), "d"),
                p.v((*b, key(c, "draft_tokens")), "d"),
                p.v((*b, key(c, "accepted")), "d"),
                p.v((*b, key(c, "acceptance"))),
                p.v((*b, key(c, "tokens_per_step"))),
                p.v((*b, "source")),
            ]
        )
    t = record["totals"]
    tb = ("totals",)
    rows.append(
        [
            "all",
            "",
            p.v((*tb, "output_tokens"), "d"),
            p.v((*tb, key(t, "drafts")), "d"),
            p.v((*tb, key(t, "draft_tokens")), "d"),
            p.v((*tb, key(t, "accepted")), "d"),
            p.v((*tb, key(t, "acceptance"))),
            p.v((*tb, key(t, "tokens_per_step"))),
            "",
        ]
    )
    p.add("<h2>Calls</h2>")
    p.table(
        [
            "call",
            "mode",
            "output tokens",
            "drafts",
            "draft tokens",
            "accepted",
            "acceptance",
            "tokens per step",
            "source",
        ],
        rows,
    )
    eng = record.get("engine_counters_delta")
    if eng:
        eb = ("engine_counters_delta",)
        p.add(
            f"<p>The engine's own counters over the demo: {p.v((*eb, 'status'))}, drafts "
            f"{p.v((*eb, key(eng, 'drafts')), 'd')}, draft tokens "
            f"{p.v((*eb, key(eng, 'draft_tokens')), 'd')}, accepted "
            f"{p.v((*eb, key(eng, 'accepted')), 'd')}: with calls one after another the "
            "per-call figures add up to these.</p>"
        )
    return p.html()


def check_target(path: Path | str, option: str = "--report") -> Path:
    """Refuse, before any work, a report path that cannot be written (a file in the way)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(
            f"{option} {path} is a directory", fix="give a file name, e.g. report.html"
        )
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(
            f"{option} {path}: {parent} is not a writable directory",
            fix="choose a path in a writable directory",
        )
    return path


def write(path: Path | str, page: str) -> Path:
    """Replace ``path`` with the rendered page atomically (never a half-written file)."""
    return write_atomic(path, page, mode=0o644)


def load_artifact(path: Path | str) -> dict:
    """A bench artifact from its JSON file, to render it again later (checked: a wrong type is
    one UsageError naming the file and the field)."""
    return bench_report.load(path).to_dict()
