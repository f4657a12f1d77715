"""The appliance's state as Prometheus metrics, written as a node_exporter textfile.

The cutover command (issue 5) calls :func:`write_textfile` after every cutover or rollback; the
node's Prometheus reads it through node_exporter's textfile collector (``honor_labels`` keeps
our ``instance`` label, the appliance instance name). Grafana draws the image per instance and
annotates cutovers and rollbacks from these series.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

from .errors import UsageError

IMAGE_INFO = "gemma4_appliance_image_info"
CUTOVER_EVENTS = "gemma4_appliance_cutover_events"  # exposed as ..._total
LAST_CUTOVER = "gemma4_appliance_last_cutover_timestamp_seconds"

KINDS = ("cutover", "rollback")
OUTCOMES = ("ok", "rolled_back", "failed")


@dataclass(frozen=True)
class InstanceState:
    """One appliance instance: the image it runs now and its cutover history counts."""

    instance: str
    image: str
    vllm_version: str
    mtp: bool
    # (kind, outcome) -> how many times; kinds in KINDS, outcomes in OUTCOMES.
    events: Mapping[tuple[str, str], int] = field(default_factory=dict)
    last_cutover: float | None = None  # unix seconds of the last cutover or rollback


def build_registry(states: Iterable[InstanceState] = ()) -> CollectorRegistry:
    """A fresh registry with the state metrics registered and set from ``states``."""
    reg = CollectorRegistry()
    info = Gauge(IMAGE_INFO, "The image an appliance instance runs (value 1).",
                 ["instance", "image", "vllm_version", "mtp"], registry=reg)
    events = Counter(CUTOVER_EVENTS, "Cutovers and rollbacks by outcome.",
                     ["instance", "kind", "outcome"], registry=reg)
    last = Gauge(LAST_CUTOVER, "Unix time of the instance's last cutover or rollback.",
                 ["instance"], registry=reg)
    for s in states:
        info.labels(s.instance, s.image, s.vllm_version, "true" if s.mtp else "false").set(1)
        for (kind, outcome), count in sorted(s.events.items()):
            if kind not in KINDS or outcome not in OUTCOMES:
                raise UsageError(f"unknown cutover event {kind}/{outcome} for {s.instance}",
                                 fix=f"kind in {KINDS}, outcome in {OUTCOMES}")
            if count < 0:
                raise UsageError(f"negative event count {count} for {s.instance}")
            events.labels(s.instance, kind, outcome).inc(count)
        if s.last_cutover is not None:
            last.labels(s.instance).set(s.last_cutover)
    return reg


def write_textfile(path: str | Path, states: Iterable[InstanceState]) -> Path:
    """Write the textfile for ``states`` atomically (temp file + rename, as node_exporter needs).

    node_exporter reads only ``*.prom`` files, so ``path`` must end in ``.prom``.
    """
    path = Path(path)
    if path.suffix != ".prom":
        raise UsageError(f"{path}: the textfile collector reads only *.prom files")
    path.parent.mkdir(parents=True, exist_ok=True)
    # prometheus_client writes a temp file beside the target and renames it over: atomic.
    write_to_textfile(str(path), build_registry(list(states)))
    return path
