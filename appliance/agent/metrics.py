"""The agent's metrics: Prometheus (names fixed by the metric contract between engineers) and the
same figures through the OpenTelemetry meter API (:class:`OTelMetrics`).

Histograms and token counters take only EXACT figures (source ``request`` or ``counters``): a
shared window's delta also holds other calls' drafts, so observing it would both double-count
tokens and smear the per-role distributions. Shared, absent and unknown calls still count in
``gemma4_agent_calls_total`` under their ``source``.

The meter API's instruments reach whatever meter provider the application set up (an SDK
exporting OTLP, or the OpenTelemetry Prometheus exporter); with none, the API's no-op. Besides
the MTP figures (``vllm.spec_decode.*``) they are the GenAI conventions' client metrics,
``gen_ai.client.operation.duration`` and ``gen_ai.client.token.usage``: for a call to vLLM the
agent's span takes the upstream OpenAI instrumentation's place (ADR 0006), so these take its
metrics' place too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from opentelemetry import metrics as otel_metrics
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from .. import __version__

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
    # The label children already looked up, by their label values: ``labels(**kw)`` builds and
    # checks the label tuple under the metric's lock on every call (six times per call), a dict
    # lookup does not. Never stale: the agent removes no label set.
    _children: dict = field(default_factory=dict, repr=False)

    def error(self, kind: str) -> None:
        """Count one of the agent's own failures (never the call's)."""
        self.errors.labels(kind=kind).inc()

    def of(self, name: str, role: str, model: str) -> Counter | Histogram:
        """The child of per-call instrument ``name`` (``acceptance``, ``tokens_per_step``,
        ``draft_tokens``, ``accepted``, ``duration``) for ``role`` and ``model``. Each is made
        at its first use, as ``labels()`` makes it: a role whose calls have no figures of their
        own shows no acceptance series, not one that counts 0."""
        key = (name, role, model)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = getattr(self, name).labels(role=role, model=model)
        return found

    def count(self, role: str, model: str, source: str, outcome: str) -> None:
        """One call in ``gemma4_agent_calls_total``."""
        key = (role, model, source, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.calls.labels(role, model, source, outcome)
        child.inc()


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


# The GenAI conventions' advice for their client histograms' buckets.
GEN_AI_DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 0.01 ... 81.92 s
GEN_AI_TOKEN_BUCKETS = tuple(4**i for i in range(14))  # 1 ... 67108864 tokens

OTEL_DURATION = "gen_ai.client.operation.duration"
OTEL_TOKEN_USAGE = "gen_ai.client.token.usage"
OTEL_ACCEPTANCE = "vllm.spec_decode.acceptance_rate"
OTEL_ACCEPTANCE_LENGTH = "vllm.spec_decode.acceptance_length"
OTEL_DRAFT_TOKENS = "vllm.spec_decode.num_draft_tokens"
OTEL_ACCEPTED = "vllm.spec_decode.num_accepted_tokens"


@dataclass
class OTelMetrics:
    """The agent's instruments on one meter provider (the meter API's)."""

    duration: otel_metrics.Histogram
    token_usage: otel_metrics.Histogram
    acceptance: otel_metrics.Histogram
    acceptance_length: otel_metrics.Histogram
    draft_tokens: otel_metrics.Counter
    accepted: otel_metrics.Counter


def build_otel(meter_provider: otel_metrics.MeterProvider | None = None) -> OTelMetrics:
    """The instruments on ``meter_provider`` (the global one when ``None``: the API's proxy,
    which follows a provider the application sets later)."""
    meter = otel_metrics.get_meter(
        "appliance.agent",
        __version__,
        meter_provider,
        schema_url="https://opentelemetry.io/schemas/1.44.0",
    )
    return OTelMetrics(
        duration=meter.create_histogram(
            OTEL_DURATION,
            "s",
            "GenAI operation duration",
            explicit_bucket_boundaries_advisory=GEN_AI_DURATION_BUCKETS,
        ),
        token_usage=meter.create_histogram(
            OTEL_TOKEN_USAGE,
            "{token}",
            "Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=GEN_AI_TOKEN_BUCKETS,
        ),
        acceptance=meter.create_histogram(
            OTEL_ACCEPTANCE,
            "1",
            "Per-call speculative decoding draft acceptance (accepted / draft tokens)",
            explicit_bucket_boundaries_advisory=ACCEPTANCE_BUCKETS,
        ),
        acceptance_length=meter.create_histogram(
            OTEL_ACCEPTANCE_LENGTH,
            "{token}",
            "Per-call mean acceptance length: tokens per engine step (1 + accepted / drafts)",
            explicit_bucket_boundaries_advisory=TOKENS_PER_STEP_BUCKETS,
        ),
        draft_tokens=meter.create_counter(
            OTEL_DRAFT_TOKENS, "{token}", "Draft tokens proposed for exact calls"
        ),
        accepted=meter.create_counter(
            OTEL_ACCEPTED, "{token}", "Draft tokens accepted for exact calls"
        ),
    )


_otel: dict[int, tuple[object, OTelMetrics]] = {}  # id(provider) -> (provider, instruments)


def otel_for(meter_provider: otel_metrics.MeterProvider | None = None) -> OTelMetrics:
    """The agent's meter-API instruments on ``meter_provider`` (global when ``None``), created
    once per provider."""
    with _lock:
        found = _otel.get(id(meter_provider))
        if found is None or found[0] is not meter_provider:
            found = _otel[id(meter_provider)] = (meter_provider, build_otel(meter_provider))
        return found[1]
