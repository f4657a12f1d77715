"""The README's trace settings deliver the agent's spans, over OTLP/HTTP and over OTLP/gRPC.

Each of the README's command lines (``OTEL_...=... opentelemetry-instrument python app.py``) runs
as written: the real launcher, the real exporter, a program that calls a vLLM server with the
OpenAI SDK. What listens is what the plane's collector (deploy/observability/otel-collector.yaml)
runs on the README's port, gRPC on 4317 and HTTP on 4318, on a free port of 127.0.0.1 instead
(the README's endpoint with only its port changed): an exporter speaking the wrong protocol for
its port loses its spans here as it does at the collector.

No engine: the server is listed in ``APPLIANCE_AGENT_SERVERS`` (the agent asks it nothing) and
refuses the connection, a real failure; the agent's span of that call carries the request's
attributes and its ``error.type``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from test_packaging import plain_python  # noqa: F401 - a fixture: the install without extras

from appliance.agent import tracing
from appliance.engine.local import free_port
from appliance.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
SECTION = "## The telemetry agent in your applications\n"
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)

# Any program: one call, then the spans are out before it exits (README: an application that
# shuts its provider down itself calls appliance.agent.flush() first); each flush waits up to
# 30 s for a slow export, and an export that failed leaves the receiver empty, whatever its time.
APP = textwrap.dedent(
    """
    import os, sys
    import openai
    from opentelemetry import trace
    from appliance import agent

    client = openai.OpenAI(base_url=os.environ["SERVER"] + "/v1", api_key="unused", max_retries=0)
    try:
        client.chat.completions.create(
            model="gemma4-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    except openai.APIConnectionError:
        pass
    if not (agent.flush(30) and trace.get_tracer_provider().force_flush(30_000)):
        sys.exit("the spans were not flushed")
    """
)


def _readme_settings() -> list[dict[str, str]]:
    """The variables of each ``VAR=value ... opentelemetry-instrument`` line of the agent's
    section of the README."""
    section = (REPO / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    out = []
    blocks = [m.group(1) for m in SH_BLOCK.finditer(section)]
    for line in "\n".join(blocks).splitlines():
        words = shlex.split(line, comments=True)
        if "opentelemetry-instrument" in words and "=" in words[0]:
            launcher = words.index("opentelemetry-instrument")
            out.append(dict(w.split("=", 1) for w in words[:launcher]))
    return out


def _protocol(settings: dict[str, str]) -> str:
    return settings.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")


def _collector_receivers() -> dict[int, str]:
    """The collector's OTLP receivers: port -> ``grpc`` or ``http``."""
    config = yaml.safe_load((REPO / "deploy/observability/otel-collector.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    return {int(p["endpoint"].rsplit(":", 1)[1]): name for name, p in protocols.items()}


def test_the_readme_shows_both_protocols_and_the_extra_exists():
    assert sorted(_protocol(s) for s in _readme_settings()) == ["grpc", "http/protobuf"]
    section = (REPO / "README.md").read_text().split(SECTION, 1)[1]
    install = tracing.EXPORTERS["grpc"][1]  # what the missing-exporter line says to run
    assert f"`{install}`" in section
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name, extra = install.split()[-1].strip("'").rstrip("]").split("[")
    assert name == project["name"]
    assert any(
        r.startswith("opentelemetry-exporter-otlp-proto-grpc")
        for r in project["optional-dependencies"][extra]
    )


@pytest.mark.parametrize("settings", _readme_settings(), ids=_protocol)
def test_the_readme_settings_deliver_the_agents_span(
    settings, otlp_receiver, otlp_grpc_receiver, tmp_path
):
    endpoint = urlsplit(settings["OTEL_EXPORTER_OTLP_ENDPOINT"])
    listening = _collector_receivers()[endpoint.port]
    receiver = {"grpc": otlp_grpc_receiver, "http": otlp_receiver}[listening]
    moved = endpoint._replace(netloc=f"{endpoint.hostname}:{urlsplit(receiver.url).port}")
    server_port = free_port()  # nothing listens there: the call is refused
    server = f"http://127.0.0.1:{server_port}"
    (tmp_path / "app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {
        **settings,
        "OTEL_EXPORTER_OTLP_ENDPOINT": moved.geturl(),
        "APPLIANCE_AGENT_SERVERS": server,
        "SERVER": server,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    }
    proc = subprocess.run(
        ["opentelemetry-instrument", "python", "app.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # only a hang fails here
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(receiver.spans) == 1, proc.stderr[-3000:]  # the exporter logged what went wrong
    (span,) = receiver.spans
    assert span.name == "chat gemma4-tiny"
    assert span.kind == 3 and span.status_code == 2  # CLIENT, ERROR in the OTLP protobuf
    assert span.resource["service.name"] == tracing.DEFAULT_SERVICE
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.request.model"] == "gemma4-tiny" and a["gen_ai.request.max_tokens"] == 8
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == server_port
    assert a["error.type"] == "APIConnectionError"
    assert a["appliance.agent.role"] == "default"


@pytest.mark.parametrize(
    ("generic", "traces"), [("http/protobuf", "grpc"), ("grpc", "http/protobuf")]
)
def test_the_traces_protocol_overrides_the_generic_one(
    generic, traces, otlp_receiver, otlp_grpc_receiver
):
    receiver = otlp_grpc_receiver if traces == "grpc" else otlp_receiver
    provider = tracing.setup_tracing(
        {
            "OTEL_EXPORTER_OTLP_PROTOCOL": generic,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": traces,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        }
    )
    provider.get_tracer("test").start_span("one", attributes={"protocol": traces}).end()
    assert provider.force_flush(30_000)
    provider.shutdown()
    assert [(s.name, s.attributes) for s in receiver.spans] == [("one", {"protocol": traces})]


def test_http_json_is_refused_in_one_line():
    with pytest.raises(UsageError) as refused:
        tracing.setup_tracing(
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
            }
        )
    assert str(refused.value) == (
        "OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported: Python's OTLP exporters send "
        "protobuf only (use http/protobuf, the default, to a collector's port 4318, or grpc to "
        "4317)"
    )


# The launcher's path (the instrumentor builds the agent's provider at the first call to vLLM),
# in code since the plain install has no entry points of its own; then setup_tracing() called
# by the program itself.
_WITHOUT_THE_GRPC_EXPORTER = textwrap.dedent(
    """
    import os
    import openai
    from appliance import agent
    from appliance.agent.instrumentor import OpenAIInstrumentor
    from appliance.errors import UsageError

    OpenAIInstrumentor().instrument()
    client = openai.OpenAI(base_url=os.environ["SERVER"] + "/v1", api_key="unused", max_retries=0)
    try:
        client.chat.completions.create(
            model="gemma4-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    except openai.APIConnectionError:
        print("the program went on")
    try:
        agent.setup_tracing()
    except UsageError as exc:
        print(exc)
    """
)


def test_a_missing_grpc_exporter_is_one_line_naming_the_extra(plain_python):  # noqa: F811
    """The package installed without extras (tests/test_packaging.py's plain install: the
    declared dependencies only, linked from this environment) has no grpcio: a real missing
    module. The ``opentelemetry`` namespace is linked whole, exporter included, so the import
    that fails is grpcio's ``grpc``, as where the exporter is installed without its wheel."""
    server = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
    env |= {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "APPLIANCE_AGENT_SERVERS": server,
        "SERVER": server,
    }
    proc = subprocess.run(
        [plain_python, "-c", _WITHOUT_THE_GRPC_EXPORTER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = (
        "OTLP over grpc needs an exporter that is not installed: no module named 'grpc' "
        "(pip install 'gemma4-appliance[otlp-grpc]')"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == f"spans are not exported: {line}\n"
    assert proc.stdout == f"the program went on\n{line}\n"


def test_percent_encoded_resource_attributes_arrive_decoded(otlp_receiver, monkeypatch):
    """The SDK parses ``OTEL_RESOURCE_ATTRIBUTES`` (the W3C baggage octet rules: a value's
    ``%20`` is a space, ``%2C`` a comma); the agent's hand parser sent them encoded (E7)."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod%20eu,team=a%2Cb")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.url)
    provider = tracing.setup_tracing()
    provider.get_tracer("test").start_span("one").end()
    assert provider.force_flush(30_000)
    provider.shutdown()
    (span,) = otlp_receiver.spans
    resource = span.resource
    assert (resource["deployment.environment"], resource["team"]) == ("prod eu", "a,b")
    assert resource["service.name"] == tracing.DEFAULT_SERVICE
