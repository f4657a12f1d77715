"""The page of a bench artifact: paired (MTP against its baseline), k sweep, or one endpoint.

Reads ``bench.report.artifact``'s dict into what ``templates/bench.html.j2`` shows; the shape of
that dict is the bench's, read here through :mod:`.figures`.
"""

from __future__ import annotations

from ..errors import UsageError
from . import charts
from .figures import get, key, resolve
from .page import Cell, Path_, Reader, Value, as_json, joined, number, render


def _endpoints(r: Reader) -> list[list[Cell]]:
    return [
        [r.v(("endpoints", i, f)) for f in ("label", "url", "model", "vllm_version", "speculative")]
        for i in range(len(r.record.get("endpoints") or []))
    ]


def _config(r: Reader) -> dict:
    n = len(r.record["config"]["max_tokens"])
    return {
        "runs": r.v(("config", "runs"), "d"),
        "warmups": r.v(("config", "warmups"), "d"),
        "max_tokens": joined([r.v(("config", "max_tokens", i), "d") for i in range(n)], ", "),
        "temperature": r.v(("config", "temperature"), "g"),
        "seed": r.v(("config", "seed"), "d"),
    }


def _definitions(r: Reader) -> list[tuple[str, Value]]:
    return [(n, r.v(("definitions", n))) for n in sorted(r.record.get("definitions") or {})]


def _per_position(r: Reader, base: Path_, label: str, chart_id: str) -> dict:
    """Per-position acceptance of one side: a chart and a table, or nothing to show."""
    spec = resolve(r.record, base)
    pk = key(spec, "per_position")
    pos = spec.get(pk) or []
    if not pos:
        return {"label": label, "chart": None, "rows": []}
    chart = r.chart(
        chart_id,
        charts.bars(
            f"Acceptance by draft position: {label}",
            [f"position {i}" for i in range(len(pos))],
            {label: [number(x) for x in pos]},
            "accepted at i / drafts",
            ylim=(0, 1.05),
        ),
    )
    rows = [[f"pos {i}", r.v((*base, pk, i))] for i in range(len(pos))]
    return {"label": label, "chart": chart, "rows": rows}


def _summary(r: Reader, path: Path_, field: str, scale: float, fmt: str) -> Cell:
    return "-" if resolve(r.record, path) is None else r.v((*path, field), fmt, scale)


def _groups(r: Reader, side: str, base: Path_, other: Path_ | None = None, other_label: str = ""):
    """Per prompt shape (prompt set x max_tokens): acceptance, tokens per step, TPOT, tok/s."""
    groups = resolve(r.record, (*base, "groups"))
    others = resolve(r.record, (*other, "groups")) if other else []
    if not groups:
        return None
    cats = [f"{g['prompt_set']}/{g['max_tokens']}" for g in groups]
    acc = [number(get(g["spec"], "acceptance")) for g in groups]
    acc_chart = None
    if any(a is not None for a in acc):
        acc_chart = r.chart(
            "shape-acceptance",
            charts.bars(
                f"Acceptance by prompt shape: {side}",
                cats,
                {side: acc},
                "accepted / draft tokens",
                ylim=(0, 1.05),
                xlabel="prompt set / max_tokens",
            ),
        )

    def tpot_ms(gs: list, i: int) -> float | None:
        t = number((gs[i]["tpot_s"] or {}).get("median")) if i < len(gs) else None
        return None if t is None else t * 1000

    series = {side: [tpot_ms(groups, i) for i in range(len(groups))]}
    if other:
        series[other_label] = [tpot_ms(others, i) for i in range(len(groups))]
    tpot_chart = r.chart(
        "shape-tpot",
        charts.bars(
            "TPOT by prompt shape (median)",
            cats,
            series,
            "TPOT ms",
            xlabel="prompt set / max_tokens",
        ),
    )
    rows = []
    for i, g in enumerate(groups):
        gb = (*base, "groups", i)
        row: list[Cell] = [
            r.v((*gb, "prompt_set")),
            r.v((*gb, "max_tokens"), "d"),
            r.v((*gb, "runs"), "d"),
            r.v((*gb, "spec", key(g["spec"], "acceptance"))),
            r.v((*gb, "spec", key(g["spec"], "tokens_per_step"))),
            _summary(r, (*gb, "tpot_s"), "median", 1000.0, ".2f"),
            _summary(r, (*gb, "output_tps"), "median", 1.0, ".1f"),
        ]
        if other:
            ob = (*other, "groups", i)
            row += [
                _summary(r, (*ob, "tpot_s"), "median", 1000.0, ".2f"),
                _summary(r, (*ob, "output_tps"), "median", 1.0, ".1f"),
            ]
        rows.append(row)
    return {
        "side": side,
        "other": other_label if other else None,
        "acceptance_chart": acc_chart,
        "tpot_chart": tpot_chart,
        "rows": rows,
    }


SPEC_FIGURES = (
    ("drafts", "drafts", "d"),
    ("draft tokens", "draft_tokens", "d"),
    ("accepted tokens", "accepted", "d"),
    ("acceptance", "acceptance", ".3f"),
    ("mean acceptance length (tokens per step)", "tokens_per_step", ".3f"),
)


def _side(r: Reader, base: Path_, side: str, other: Path_ | None = None, other_label: str = ""):
    """One side's speculative-decoding totals, per-position acceptance and prompt shapes."""
    totals = (*base, "spec_totals")
    spec = resolve(r.record, totals)
    return {
        "side": side,
        "totals": [[name, r.v((*totals, key(spec, f)), fmt)] for name, f, fmt in SPEC_FIGURES],
        "per_position": _per_position(r, totals, side, "per-position"),
        "groups": _groups(r, side, base, other, other_label),
    }


def _paired(r: Reader) -> dict:
    sp = r.record["paired"]["speedup"]
    names, pts, lows, highs, rows = [], [], [], [], []
    for name, fig in (
        ("output tok/s (MTP / baseline)", "output_tps"),
        ("TPOT (baseline / MTP)", "tpot"),
    ):
        s = sp.get(fig)
        names.append(name)
        pts.append(number(s and s["ratio"]))
        lows.append(number(s and s["low"]))
        highs.append(number(s and s["high"]))
        base = ("paired", "speedup", fig)
        if s is None:
            rows.append([name, "-", "-", "-", "-"])
        else:
            rows.append(
                [
                    name,
                    r.v((*base, "ratio"), ".3f", suffix="x"),
                    r.v((*base, "low")),
                    r.v((*base, "high")),
                    r.v((*base, "n"), "d"),
                ]
            )
    chart = r.chart(
        "speedup",
        charts.intervals(
            "Speedup with 95% confidence interval",
            names,
            pts,
            lows,
            highs,
            "ratio (> 1: MTP faster)",
        ),
    )
    par = r.record["paired"]["parity"]
    pb = ("paired", "parity")
    parity = {"checked": bool(par["checked"]), "reason": None}
    if par["checked"]:
        parity |= {
            "ok": par["differ"] == 0,
            "equal": r.v((*pb, "equal"), "d"),
            "differ": r.v((*pb, "differ"), "d"),
            "differing": [r.v((*pb, "differing", i)) for i in range(len(par["differing"]))],
        }
    else:
        parity["reason"] = r.v((*pb, "reason"))
    mtp, base = ("paired", "mtp"), ("paired", "baseline")
    return {
        "speedup_chart": chart,
        "speedup_rows": rows,
        "parity": parity,
        "side": _side(r, mtp, "MTP", base, "baseline"),
    }


def _sweep(r: Reader) -> dict:
    sw = r.record["sweep"]
    rows_ = sw["rows"]
    ks = [row["k"] for row in rows_]
    rec = sw.get("recommended_k")
    recommended = None
    if rec is not None:
        recommended = {
            "k": r.v(("sweep", "recommended_k"), "d"),
            "criterion": r.v(("sweep", "criterion")),
        }

    def ci(row: dict, name: str, part: str, scale: float = 1.0) -> float | None:
        c = row.get(name)
        return None if not c or c.get(part) is None else c[part] * scale

    tps_name, tpot_name = "output_tps_mean_ci", "tpot_mean_ci_s"
    tps_chart = r.chart(
        "sweep-tps",
        charts.against_k(
            "Output tokens per second against k",
            ks,
            [ci(row, tps_name, "mean") for row in rows_],
            [ci(row, tps_name, "low") for row in rows_],
            [ci(row, tps_name, "high") for row in rows_],
            [number(row["output_tps_median"]) for row in rows_],
            "output tok/s (end to end)",
            rec,
        ),
    )
    tpot_chart = r.chart(
        "sweep-tpot",
        charts.against_k(
            "TPOT against k",
            ks,
            [ci(row, tpot_name, "mean", 1000) for row in rows_],
            [ci(row, tpot_name, "low", 1000) for row in rows_],
            [ci(row, tpot_name, "high", 1000) for row in rows_],
            [
                None if row["tpot_median_s"] is None else row["tpot_median_s"] * 1000
                for row in rows_
            ],
            "TPOT ms",
            rec,
        ),
    )
    width = max((len(get(row, "per_position") or []) for row in rows_), default=0)
    pos_chart = None
    if width:
        series = {
            f"k={row['k']}": [number(x) for x in (get(row, "per_position") or [])]
            + [None] * (width - len(get(row, "per_position") or []))
            for row in rows_
        }
        pos_chart = r.chart(
            "sweep-per-position",
            charts.bars(
                "Acceptance by draft position, each k",
                [f"position {i}" for i in range(width)],
                series,
                "accepted at i / drafts",
                ylim=(0, 1.05),
            ),
        )
    rows = []
    for i, row in enumerate(rows_):
        b = ("sweep", "rows", i)
        pk = key(row, "per_position")
        pos = row.get(pk) or []
        rows.append(
            [
                r.v((*b, "k"), "d"),
                r.v((*b, "tpot_median_s"), ".2f", 1000.0),
                *_ci_cells(r, b, row, tpot_name, 1000.0, ".2f"),
                r.v((*b, "output_tps_median"), ".1f"),
                *_ci_cells(r, b, row, tps_name, 1.0, ".1f"),
                r.v((*b, key(row, "tokens_per_step"))),
                r.v((*b, key(row, "acceptance"))),
                joined([r.v((*b, pk, j), ".2f") for j in range(len(pos))], " / ") or "-",
            ]
        )
    return {
        "recommended": recommended,
        "tps_chart": tps_chart,
        "tpot_chart": tpot_chart,
        "per_position_chart": pos_chart,
        "rows": rows,
    }


def _ci_cells(r: Reader, base: Path_, row: dict, name: str, scale: float, fmt: str) -> list[Cell]:
    if not row.get(name):
        return ["-", "-"]
    b = (*base, name)
    interval = [r.v((*b, "low"), fmt, scale), " - ", r.v((*b, "high"), fmt, scale)]
    return [r.v((*b, "mean"), fmt, scale), interval]


TITLES = {"paired": "MTP against its baseline", "sweep": "k sweep", "single": "one endpoint"}


def render_bench(artifact: dict) -> str:
    """The HTML page for a bench artifact (``bench.report.artifact``'s dict)."""
    artifact = as_json(artifact)
    kind = artifact.get("kind")
    if kind not in TITLES:
        raise UsageError(f"no report for a bench artifact of kind {kind!r}")
    r = Reader(artifact)
    intro = {"kind": r.v(("kind",)), "version": r.v(("environment", "versions", "appliance"))}
    endpoints = _endpoints(r)
    body = {
        "paired": _paired,
        "sweep": _sweep,
        "single": lambda r: {"side": _side(r, ("single",), "endpoint")},
    }[kind](r)
    return render(
        "bench.html.j2",
        r,
        f"appliance bench: {TITLES[kind]}",
        kind=kind,
        intro=intro,
        endpoints=endpoints,
        body=body,
        config=_config(r),
        definitions=_definitions(r),
    )
