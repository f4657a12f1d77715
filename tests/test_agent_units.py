"""The agent's parts that need no engine: settings, names, attribution rules on real captures."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as g
from opentelemetry.semconv.attributes import error_attributes, server_attributes

from appliance import specdecode
from appliance.agent import AgentConfig, attribution, build_registry, metrics, spans, tracing
from appliance.errors import UsageError

CAPTURE = (Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp.txt").read_text()


def test_registry_has_exactly_the_contract_names():
    reg = build_registry()
    names = {fam.name for fam in reg.collect()}
    # prometheus-client reports counter families without ``_total``.
    expected = {n.removesuffix("_total") for n in metrics.METRIC_NAMES}
    assert names == expected
    samples = {s.name for fam in build_registry().collect() for s in fam.samples}
    assert samples == set()  # labelled metrics have no samples until used


def test_contract_buckets():
    assert metrics.ACCEPTANCE_BUCKETS == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    assert metrics.TOKENS_PER_STEP_BUCKETS[0] == 1.0 and metrics.TOKENS_PER_STEP_BUCKETS[-1] == 9.0
    assert metrics.TOKENS_PER_STEP_BUCKETS[1] == 1.25


def test_pinned_semconv_names_match_the_package():
    pairs = [
        (spans.GEN_AI_OPERATION_NAME, g.GEN_AI_OPERATION_NAME),
        (spans.GEN_AI_PROVIDER_NAME, g.GEN_AI_PROVIDER_NAME),
        (spans.GEN_AI_REQUEST_MODEL, g.GEN_AI_REQUEST_MODEL),
        (spans.GEN_AI_REQUEST_MAX_TOKENS, g.GEN_AI_REQUEST_MAX_TOKENS),
        (spans.GEN_AI_REQUEST_TEMPERATURE, g.GEN_AI_REQUEST_TEMPERATURE),
        (spans.GEN_AI_REQUEST_TOP_P, g.GEN_AI_REQUEST_TOP_P),
        (spans.GEN_AI_REQUEST_STREAM, g.GEN_AI_REQUEST_STREAM),
        (spans.GEN_AI_RESPONSE_MODEL, g.GEN_AI_RESPONSE_MODEL),
        (spans.GEN_AI_RESPONSE_ID, g.GEN_AI_RESPONSE_ID),
        (spans.GEN_AI_RESPONSE_FINISH_REASONS, g.GEN_AI_RESPONSE_FINISH_REASONS),
        (spans.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, g.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK),
        (spans.GEN_AI_USAGE_INPUT_TOKENS, g.GEN_AI_USAGE_INPUT_TOKENS),
        (spans.GEN_AI_USAGE_OUTPUT_TOKENS, g.GEN_AI_USAGE_OUTPUT_TOKENS),
        (spans.GEN_AI_INPUT_MESSAGES, g.GEN_AI_INPUT_MESSAGES),
        (spans.GEN_AI_OUTPUT_MESSAGES, g.GEN_AI_OUTPUT_MESSAGES),
        (spans.SERVER_ADDRESS, server_attributes.SERVER_ADDRESS),
        (spans.SERVER_PORT, server_attributes.SERVER_PORT),
        (spans.ERROR_TYPE, error_attributes.ERROR_TYPE),
    ]
    for ours, theirs in pairs:
        assert ours == theirs


def test_config_from_env_and_bad_values():
    cfg = AgentConfig.from_env({
        "APPLIANCE_AGENT_ATTRIBUTION": "counters", "APPLIANCE_AGENT_SNAPSHOT_TIMEOUT": "0.1",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true",
    })
    assert (cfg.attribution, cfg.snapshot_timeout, cfg.capture_content) == ("counters", 0.1, True)
    assert AgentConfig.from_env({}).capture_content is False
    with pytest.raises(UsageError):
        AgentConfig.from_env({"APPLIANCE_AGENT_ATTRIBUTION": "guess"})
    with pytest.raises(UsageError):
        AgentConfig.from_env({"APPLIANCE_AGENT_SNAPSHOT_TIMEOUT": "soon"})


def test_tracing_from_otel_env():
    assert not tracing.exporting({})
    assert tracing.exporting({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.exporting({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"})
    p = tracing.setup_tracing({"OTEL_SERVICE_NAME": "svc", "OTEL_RESOURCE_ATTRIBUTES": "a=1,b=2",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    attrs = dict(p.resource.attributes)
    assert (attrs["service.name"], attrs["a"], attrs["b"]) == ("svc", "1", "2")
    p.shutdown()
    assert tracing._endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318/"}, "http/protobuf") == {
        "endpoint": "http://h:4318/v1/traces"}
    with pytest.raises(UsageError):
        tracing.setup_tracing({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def _with(text: str, **changes: str) -> str:
    """The real capture with some sample values replaced (``name{labels}`` prefix -> value)."""
    out = []
    for line in text.splitlines():
        for prefix, value in changes.items():
            if line.startswith((prefix + "{", prefix + " ")):
                line = line.rsplit(" ", 1)[0] + " " + value
        out.append(line)
    return "\n".join(out) + "\n"


def test_snapshot_rules_on_the_real_capture():
    before = specdecode.parse(CAPTURE)
    moved = specdecode.parse(_with(
        CAPTURE, **{"vllm:spec_decode_num_drafts_total": "31.0",
                    "vllm:spec_decode_num_draft_tokens_total": "62.0",
                    "vllm:spec_decode_num_accepted_tokens_total": "62.0"}))
    b = before.total()
    exact = attribution.from_snapshots(before, moved, "gemma4-tiny", overlapped=False)
    assert exact.source == "counters" and exact.drafts == 31 - b.drafts
    assert attribution.from_snapshots(before, moved, "gemma4-tiny", overlapped=True).source == "shared"
    busy = specdecode.parse(_with(CAPTURE, **{"vllm:num_requests_running": "1.0"}))
    assert attribution.from_snapshots(busy, moved, "gemma4-tiny", False).shared
    # A model name the server does not know still uses the server's counters.
    assert attribution.from_snapshots(before, moved, "alias", False).source == "counters"
    assert attribution.from_snapshots(moved, before, None, False).status == "reset"
    assert attribution.from_snapshots(None, moved, None, False).source == "unknown"
    no_spec = specdecode.parse("vllm:num_requests_running{engine=\"0\"} 0.0\n")
    assert attribution.from_snapshots(no_spec, no_spec, None, False).source == "absent"
