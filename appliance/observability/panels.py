"""Typed Grafana panel, variable and layout builders that serialise to dashboard JSON.

Only the fields this project uses are modelled; the output is checked against Grafana's
published schema types (``@grafana/schema``) by the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .promql import Expr

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


@dataclass(frozen=True)
class Target:
    """One query of a panel; ``legend`` is Grafana's legendFormat."""

    expr: Expr
    legend: str = ""
    instant: bool = False

    def to_json(self, ref_id: str) -> dict[str, Any]:
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr.text,
            "instant": self.instant,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "refId": ref_id,
        }


@dataclass(frozen=True)
class Panel:
    """A panel: kind (timeseries, stat, table, ...), what it reads, and how it displays."""

    kind: str
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    stack: bool = False

    @property
    def metrics(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for t in self.targets:
            out |= t.expr.metrics
        return out

    def full_description(self) -> str:
        """The description, ending with the series it reads (every panel names its metrics)."""
        names = ", ".join(f"`{m}`" for m in sorted(self.metrics))
        return f"{self.description}\n\nMetrics: {names}"

    def to_json(self, panel_id: int, pos: dict[str, int]) -> dict[str, Any]:
        defaults: dict[str, Any] = {"unit": self.unit}
        if self.min is not None:
            defaults["min"] = self.min
        if self.max is not None:
            defaults["max"] = self.max
        if self.decimals is not None:
            defaults["decimals"] = self.decimals
        if self.kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "fillOpacity": 20 if self.stack else 0,
                "lineWidth": 1,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"group": "A", "mode": "normal" if self.stack else "none"},
            }
        options = {
            "timeseries": {
                "legend": {
                    "calcs": ["mean", "lastNotNull"],
                    "displayMode": "table",
                    "placement": "bottom",
                    "showLegend": True,
                },
                "tooltip": {"mode": "multi", "sort": "desc"},
            },
            "stat": {
                "colorMode": "value",
                "graphMode": "none",
                "justifyMode": "auto",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "textMode": "value_and_name",
            },
            "table": {"showHeader": True},
        }.get(self.kind, {})
        return {
            "datasource": DATASOURCE,
            "description": self.full_description(),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "gridPos": pos,
            "id": panel_id,
            "options": options,
            "targets": [t.to_json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
            "title": self.title,
            "type": self.kind,
        }


@dataclass(frozen=True)
class Row:
    """A collapsible row heading the panels that follow it."""

    title: str


@dataclass(frozen=True)
class Variable:
    """A dashboard variable: the datasource picker or a label_values query with All."""

    name: str
    label: str
    query: str = ""  # label_values(...); empty for the datasource variable

    def to_json(self) -> dict[str, Any]:
        if not self.query:
            return {
                "hide": 0,
                "includeAll": False,
                "label": self.label,
                "multi": False,
                "name": self.name,
                "options": [],
                "query": "prometheus",
                "refresh": 1,
                "regex": "",
                "type": "datasource",
            }
        return {
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "datasource": DATASOURCE,
            "hide": 0,
            "includeAll": True,
            "label": self.label,
            "multi": True,
            "name": self.name,
            "options": [],
            "query": {"query": self.query, "refId": f"{self.name}-query"},
            "refresh": 2,
            "regex": "",
            "sort": 1,
            "type": "query",
        }


@dataclass(frozen=True)
class Annotation:
    """A Prometheus-backed annotation (e.g. a cutover): marks where ``expr`` has a series."""

    name: str
    expr: Expr
    color: str
    title: str
    text: str

    def to_json(self) -> dict[str, Any]:
        return {
            "datasource": DATASOURCE,
            "enable": True,
            "iconColor": self.color,
            "name": self.name,
            # The query in `target` (Grafana >= 10's form); the format fields stay top-level,
            # where Grafana's Prometheus plugin reads them.
            "tagKeys": "host,instance,kind,outcome",
            "target": {"expr": self.expr.text, "interval": "30s", "refId": "Anno"},
            "textFormat": self.text,
            "titleFormat": self.title,
            "useValueForTime": False,
        }


class Layout:
    """Places panels left to right on Grafana's 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.items: list[Panel | Row] = []

    def row(self, title: str) -> Layout:
        self.items.append(Row(title))
        return self

    def add(self, *panels: Panel) -> Layout:
        self.items.extend(panels)
        return self

    def panels(self) -> list[Panel]:
        return [p for p in self.items if isinstance(p, Panel)]

    def to_json(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        x = y = row_h = 0
        for i, item in enumerate(self.items, start=1):
            if isinstance(item, Row):
                y += row_h
                x = row_h = 0
                out.append(
                    {
                        "collapsed": False,
                        "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                        "id": i,
                        "panels": [],
                        "title": item.title,
                        "type": "row",
                    }
                )
                y += 1
                continue
            if x + item.width > GRID_WIDTH:
                y += row_h
                x = row_h = 0
            out.append(item.to_json(i, {"h": item.height, "w": item.width, "x": x, "y": y}))
            x += item.width
            row_h = max(row_h, item.height)
        return out


@dataclass(frozen=True)
class Dashboard:
    """A whole dashboard with a stable uid."""

    uid: str
    title: str
    description: str
    layout: Layout
    variables: tuple[Variable, ...]
    annotations: tuple[Annotation, ...] = ()
    tags: tuple[str, ...] = ("gemma4", "mtp", "vllm")

    def panels(self) -> list[Panel]:
        return self.layout.panels()

    def to_json(self) -> dict[str, Any]:
        builtin = {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }
        return {
            "annotations": {"list": [builtin, *(a.to_json() for a in self.annotations)]},
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,
            "links": [],
            "panels": self.layout.to_json(),
            "refresh": "30s",
            "schemaVersion": 39,
            "tags": list(self.tags),
            "templating": {"list": [v.to_json() for v in self.variables]},
            "time": {"from": "now-6h", "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }
