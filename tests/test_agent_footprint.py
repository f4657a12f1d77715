"""The agent installs light and imports light (issue 56 section 2, ADR 0020).

As in the upstream instrumentations, the agent needs the OpenTelemetry API only: the SDK and the
OTLP exporters are the application's choice (the ``otlp`` extras), the report charts' matplotlib
is the ``reports`` extra, and a client SDK is imported only when the program hands the agent one
of its clients. Each program runs in a child Python, so its ``sys.modules`` is its own. The
sizes and import times side by side: ``benchmarks/agent_footprint.py``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from appliance.engine.local import free_port

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("openai", "pydantic", "opentelemetry.sdk", "matplotlib")


def _child(code: str, **env: str) -> dict:
    """Run ``code`` in a child Python; the JSON it prints last."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "APPLIANCE_"))}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=base | env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


_LOADED = """
import json, sys
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def test_importing_the_agent_loads_no_client_sdk_no_otel_sdk_no_matplotlib():
    loaded = _child("import appliance.agent\n" + _LOADED.format(heavy=HEAVY))
    assert loaded == []


def test_an_anthropic_only_program_loads_neither_openai_nor_matplotlib():
    """The zero-code path an Anthropic-only program takes: the instrumentor patches the SDK's
    classes and traces one call to a server listed as vLLM. Nothing listens there: the call is
    refused (a real failure) and goes through the agent's whole counters path (window, a
    ``/metrics`` read that fails and is counted, the span ended with the error)."""
    server = f"http://127.0.0.1:{free_port()}"
    code = """
    import os
    import anthropic
    from prometheus_client import CollectorRegistry
    from appliance import agent
    from appliance.agent.instrumentor import AnthropicInstrumentor

    registry = CollectorRegistry()
    records = []
    AnthropicInstrumentor().instrument(registry=registry, on_call=records.append)
    client = anthropic.Anthropic(base_url=os.environ["SERVER"], api_key="unused", max_retries=0)
    try:
        client.messages.create(
            model="gemma4-tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    except anthropic.APIConnectionError:
        pass
    assert agent.flush(30)
    assert [(r.operation, r.outcome, r.error_type) for r in records] == [
        ("messages", "error", "APIConnectionError")
    ], records
    errors = registry.get_sample_value("gemma4_agent_errors_total", {"kind": "metrics_unreachable"})
    assert errors == 1, errors
    """
    loaded = _child(
        textwrap.dedent(code) + _LOADED.format(heavy=("openai", "matplotlib")),
        SERVER=server,
        APPLIANCE_AGENT_SERVERS=server,
        OTEL_TRACES_EXPORTER="none",
    )
    assert loaded == []


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, read from this environment's metadata."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or name == "gemma4-appliance":
            continue
        seen.add(name)
        for text in md.requires(req.name) or []:
            dep = Requirement(text)
            if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                todo.append(dep)
    return seen


def test_the_plain_install_brings_no_otel_sdk_no_exporter_no_matplotlib():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plain = _closure(project["dependencies"])
    assert {"opentelemetry-api", "opentelemetry-instrumentation", "prometheus-client"} <= plain
    for name in (
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
        "opentelemetry-exporter-otlp-proto-grpc",
        "grpcio",
        "matplotlib",
        "numpy",
    ):
        assert name not in plain, name
    extras = project["optional-dependencies"]
    assert "matplotlib" in _closure(extras["reports"])
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"} <= _closure(
        extras["otlp"]
    )
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc"} <= _closure(
        extras["otlp-grpc"]
    )
