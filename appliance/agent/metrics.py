"""The agent's Prometheus metrics (names fixed by the metric contract between engineers).

Histograms and token counters take only EXACT figures (source ``request`` or ``counters``): a
shared window's delta also holds other calls' drafts, so observing it would both double-count
tokens and smear the per-role distributions. Shared, absent and unknown calls still count in
``gemma4_agent_calls_total`` under their ``source``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# Both edges measurable: near 0 (drafter mismatch, garbled output) and near 1 (repetition loops)
# each get finer buckets than the middle, so "share of calls below 0.05 / above 0.95" is a
# ratio of two bucket counters, not an interpolation.
ACCEPTANCE_BUCKETS = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
TOKENS_PER_STEP_BUCKETS = tuple(1.0 + i * 0.25 for i in range(33))  # 1.0, 1.25, ..., 9.0
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class AgentMetrics:
    """The agent's instruments, registered in one registry."""

    registry: CollectorRegistry
    acceptance: Histogram
    tokens_per_step: Histogram
    draft_tokens: Counter
    accepted: Counter
    calls: Counter
    duration: Histogram
    errors: Counter

    def error(self, kind: str) -> None:
        """Count one of the agent's own failures (never the call's)."""
        self.errors.labels(kind=kind).inc()


def build(registry: CollectorRegistry | None = None) -> AgentMetrics:
    """Create the agent's instruments in ``registry`` (a fresh one when ``None``)."""
    reg = registry if registry is not None else CollectorRegistry()
    rm = ("role", "model")
    # prometheus-client appends ``_total`` to counters itself.
    return AgentMetrics(
        registry=reg,
        acceptance=Histogram(
            "gemma4_agent_call_acceptance",
            "Per-call MTP draft acceptance",
            rm,
            buckets=ACCEPTANCE_BUCKETS,
            registry=reg,
        ),
        tokens_per_step=Histogram(
            "gemma4_agent_call_tokens_per_step",
            "Per-call mean tokens per engine step (1 + accepted/drafts)",
            rm,
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=reg,
        ),
        draft_tokens=Counter(
            "gemma4_agent_drafted_tokens", "Draft tokens proposed for exact calls", rm, registry=reg
        ),
        accepted=Counter(
            "gemma4_agent_accepted_tokens",
            "Draft tokens accepted for exact calls",
            rm,
            registry=reg,
        ),
        calls=Counter(
            "gemma4_agent_calls",
            "Calls through the agent (outcome: ok, error, or rejected: the engine's 503 at its "
            "queue bound)",
            (*rm, "source", "outcome"),
            registry=reg,
        ),
        duration=Histogram(
            "gemma4_agent_call_duration_seconds",
            "Call duration as the caller saw it",
            rm,
            buckets=DURATION_BUCKETS,
            registry=reg,
        ),
        errors=Counter("gemma4_agent_errors", "The agent's own failures", ("kind",), registry=reg),
    )


def build_registry() -> CollectorRegistry:
    """A fresh registry with every agent metric registered (for the dashboards' name check)."""
    return build().registry


_lock = threading.Lock()
_by_registry: dict[CollectorRegistry, AgentMetrics] = {}  # registries hash by identity
_default: AgentMetrics | None = None


def for_registry(registry: CollectorRegistry | None) -> AgentMetrics:
    """The agent's instruments in ``registry`` (the agent's own when ``None``), created once."""
    global _default
    with _lock:
        if registry is None:
            if _default is None:
                _default = build()
            return _default
        if _default is not None and registry is _default.registry:
            return _default
        found = _by_registry.get(registry)
        if found is None:
            found = _by_registry[registry] = build(registry)
        return found


def serve(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None):
    """Serve the agent's metrics on ``addr:port`` (local only by default); returns the server."""
    reg = for_registry(registry).registry
    server, _thread = start_http_server(port, addr=addr, registry=reg)
    return server
