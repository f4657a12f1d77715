"""Does every metric a dashboard, rule or alert reads exist somewhere real?

Known names come from a real vLLM ``/metrics`` page, the agent exporter's registry, the state
metrics' registry, Prometheus' own synthetic series, and our recording rules.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from . import names, rules
from .dashboards import DASHBOARDS


def exposition_names(text: str) -> set[str]:
    """Sample names in a Prometheus exposition (``*_total``, ``*_bucket``, gauges as they are)."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(text):
        out |= {s.name for s in fam.samples}
        out |= _sample_names(fam.name, fam.type)
    return out


def registry_names(reg: CollectorRegistry) -> set[str]:
    """Sample names a registry will expose, including labelled metrics with no child yet."""
    out: set[str] = set()
    for fam in reg.collect():
        out |= _sample_names(fam.name, fam.type)
        out |= {s.name for s in fam.samples}
    return out


def _sample_names(family: str, kind: str) -> set[str]:
    if kind == "counter":
        return {family + "_total"}
    if kind == "histogram":
        return {family + s for s in ("_bucket", "_count", "_sum")}
    if kind == "summary":
        return {family, family + "_count", family + "_sum"}
    return {family}


def used_metrics() -> dict[str, set[str]]:
    """Source metric name -> where it is used (dashboard panels, annotations, rules, alerts)."""
    recorded = {r.name for r in rules.all_rules() if not r.alert}
    uses: dict[str, set[str]] = {}

    def note(metrics: Iterable[str], where: str) -> None:
        for m in metrics:
            if m not in recorded:
                uses.setdefault(m, set()).add(where)

    for fname, build in DASHBOARDS.items():
        d = build()
        for p in d.panels():
            note(p.metrics, f"{fname}: {p.title}")
        for a in d.annotations:
            note(a.expr.metrics, f"{fname}: annotation {a.name}")
    for r in rules.all_rules():
        note(r.expr.metrics, f"rule {r.name}")
    return uses


def undefined_recorded() -> set[str]:
    """Recorded series a dashboard or alert reads that no recording rule defines."""
    recorded = {r.name for r in rules.all_rules() if not r.alert}
    read: set[str] = set()
    for build in DASHBOARDS.values():
        for p in build().panels():
            read |= {m for m in p.metrics if ":" in m and not m.startswith("vllm:")}
    for r in rules.all_rules():
        read |= {m for m in r.expr.metrics if ":" in m and not m.startswith("vllm:")}
    return read - recorded


def missing(known: set[str]) -> dict[str, set[str]]:
    """Used metrics absent from ``known`` (plus Prometheus' synthetic series)."""
    have = known | names.SYNTHETIC | names.NODE_EXPORTER
    return {m: w for m, w in sorted(used_metrics().items()) if m not in have}
