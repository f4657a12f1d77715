"""The span started on the agent's thread is the one the request's ``traceparent`` named.

The caller's thread makes the span's ids, the sampler's decision and ``traceparent``; the SDK
span itself starts and ends on the agent's thread with those ids (overhead review #2). No
engine: a real HTTP server on 127.0.0.1 that records each request's headers and answers 404 as
vLLM does for an unknown model (the call fails, as bare), through the real OpenAI SDK.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry

from appliance import agent


@pytest.fixture()
def not_found() -> Iterator[tuple[str, list[dict]]]:
    """A server answering every POST 404 (vLLM's body for an unknown model); the headers of
    each request it got."""
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(dict(self.headers))
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps(
                {"object": "error", "message": "The model `x` does not exist.", "code": 404}
            ).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def _client(url: str, provider: TracerProvider):
    return agent.instrument(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
        config=agent.AgentConfig(attribution="request"),
        tracer_provider=provider,
        registry=CollectorRegistry(),
    )


def _call(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def test_the_exported_span_carries_the_ids_traceparent_sent(not_found):
    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = _client(url, provider)
    parent = provider.get_tracer("app").start_span("app work")
    with agent.role("architect"), trace.use_span(parent):
        _call(client)
    _call(client)  # a root span of its own
    parent.end()
    assert agent.flush(30)
    ours = [s for s in exporter.get_finished_spans() if s.name == "chat x"]
    assert len(ours) == 2 and len(seen) == 2
    for span, headers in zip(ours, seen, strict=True):
        _version, trace_id, span_id, flags = headers["traceparent"].split("-")
        ctx = span.get_span_context()
        assert (trace_id, span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
        assert int(flags, 16) & 1 == 1  # sampled, as the span was
        assert span.attributes["error.type"] == "NotFoundError"
        assert span.attributes["gen_ai.request.model"] == "x"
        assert span.start_time < span.end_time
    nested, root = ours
    assert nested.parent.span_id == parent.get_span_context().span_id
    assert nested.context.trace_id == parent.get_span_context().trace_id
    assert nested.attributes["appliance.agent.role"] == "architect"
    assert root.parent is None and root.context.trace_id != nested.context.trace_id


def test_an_unsampled_call_sends_an_unsampled_traceparent_and_exports_nothing(not_found):
    url, seen = not_found
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _call(_client(url, provider))
    assert agent.flush(30)
    assert exporter.get_finished_spans() == ()
    assert int(seen[0]["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0
