"""The agent's figures through the OpenTelemetry meter API, beside its Prometheus metrics (E7).

An application that exports metrics over OTLP (or through the OpenTelemetry Prometheus exporter)
gets the GenAI conventions' client metrics and the MTP figures from its own meter provider. The
figures of a real engine's calls are checked in tests/test_agent.py (engine tier); here, with
no engine, a call refused by a port nothing listens on (a real failure) through the real OpenAI
SDK, read by the SDK's in-memory metric reader.
"""

from __future__ import annotations

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import NoOpTracerProvider
from prometheus_client import CollectorRegistry

from appliance import agent
from appliance.agent import metrics
from appliance.engine.local import free_port


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    """metric name -> its data points, from one collection."""
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


@pytest.fixture()
def refused() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_a_failed_call_is_one_duration_with_its_error_type(refused):
    reader = InMemoryMetricReader()
    registry = CollectorRegistry()
    client = agent.instrument(
        openai.OpenAI(base_url=refused + "/v1", api_key="unused", max_retries=0),
        role="worker",
        config=agent.AgentConfig(attribution="request"),
        tracer_provider=NoOpTracerProvider(),
        registry=registry,
        meter_provider=MeterProvider(metric_readers=[reader]),
    )
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(
            model="gemma4-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    assert agent.flush(30)
    got = points(reader)
    assert set(got) == {metrics.OTEL_DURATION}  # no usage, no figures: nothing else
    (point,) = got[metrics.OTEL_DURATION]
    port = int(refused.rsplit(":", 1)[1])
    assert dict(point.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "gemma4-tiny",
        "server.address": "127.0.0.1",
        "server.port": port,
        "appliance.agent.role": "worker",
        "error.type": "APIConnectionError",
    }
    assert point.count == 1
    assert tuple(point.explicit_bounds) == metrics.GEN_AI_DURATION_BUCKETS
    # The Prometheus side counted the same call.
    labels = {"role": "worker", "model": "gemma4-tiny", "source": "unknown", "outcome": "error"}
    assert registry.get_sample_value("gemma4_agent_calls_total", labels) == 1
    assert registry.get_sample_value(
        "gemma4_agent_call_duration_seconds_sum", {"role": "worker", "model": "gemma4-tiny"}
    ) == pytest.approx(point.sum)
    # No figures, no per-call MTP series: a child made ahead would show a count of 0.
    for name in (
        "gemma4_agent_call_acceptance_count",
        "gemma4_agent_call_tokens_per_step_count",
        "gemma4_agent_drafted_tokens_total",
        "gemma4_agent_accepted_tokens_total",
    ):
        assert registry.get_sample_value(name, {"role": "worker", "model": "gemma4-tiny"}) is None


def test_the_mtp_instruments_carry_the_prometheus_buckets():
    reader = InMemoryMetricReader()
    o = metrics.build_otel(MeterProvider(metric_readers=[reader]))
    o.acceptance.record(0.5)
    o.acceptance_length.record(2.0)
    o.draft_tokens.add(6)
    o.accepted.add(4)
    got = points(reader)
    assert tuple(got[metrics.OTEL_ACCEPTANCE][0].explicit_bounds) == metrics.ACCEPTANCE_BUCKETS
    bounds = tuple(got[metrics.OTEL_ACCEPTANCE_LENGTH][0].explicit_bounds)
    assert bounds == metrics.TOKENS_PER_STEP_BUCKETS
    assert (got[metrics.OTEL_DRAFT_TOKENS][0].value, got[metrics.OTEL_ACCEPTED][0].value) == (6, 4)
