"""Fixtures of the telemetry agent's tests: real OTLP/HTTP and OTLP/gRPC receivers and misbehaving
/metrics.

The receivers decode what the real OTLP exporters send with ``opentelemetry-proto`` (the gRPC one
is a real ``grpc`` server implementing its ``TraceService``). The
misbehaving servers exist because a real vLLM cannot be made to answer /metrics with a 500,
garbage or a hang: the agent's metrics URL points at them while the chat call goes to the real
engine.
"""

from __future__ import annotations

import gzip
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    status_code: int
    attributes: dict
    resource: dict
    ended: bool


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class OTLPReceiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0

    def wait_for(self, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while len(self.spans) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.spans)

    def record(self, req: ExportTraceServiceRequest) -> None:
        """Keep the spans of one export request."""
        self.requests += 1
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        ReceivedSpan(
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            status_code=s.status.code,
                            attributes=_attrs(s.attributes),
                            resource=resource,
                            ended=s.end_time_unix_nano > 0,
                        )
                    )


def _serve(handler_cls) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def otlp_receiver() -> Iterator[OTLPReceiver]:
    """An OTLP/HTTP traces receiver on 127.0.0.1 (``url`` is the base endpoint)."""
    state = OTLPReceiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            state.record(req)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server, url = _serve(Handler)
    state.url = url
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def otlp_grpc_receiver() -> Iterator[OTLPReceiver]:
    """An OTLP/gRPC traces receiver on 127.0.0.1: a real ``grpc`` server with opentelemetry-proto's
    ``TraceService`` (``url`` is the endpoint, ``http://`` for a plaintext channel)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    state = OTLPReceiver(url="")

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # the service's method name
            state.record(request)
            return ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    state.url = f"http://127.0.0.1:{port}"
    yield state
    server.stop(grace=None)


@dataclass
class FakeMetrics:
    """A /metrics endpoint that misbehaves on purpose (see the module docstring for why)."""

    url: str
    hits: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    fetched: threading.Event = field(default_factory=threading.Event)  # "late": page taken
    answered_at: list[float] = field(default_factory=list)  # monotonic, per delayed answer


@pytest.fixture
def bad_metrics() -> Iterator[Callable[..., FakeMetrics]]:
    """Factory: ``bad_metrics(mode)`` with mode ``500``, ``garbage``, ``hang``, ``pages``
    (``pages=[text, ...]`` answered one per read, the last one repeated), ``slow``: the live
    page of ``upstream`` (a real engine), relayed with its query, after ``slow_s`` seconds on the
    reads numbered in ``slow_hits`` (a /metrics read slow enough to interrupt, on demand), or
    ``late``: the same, but the live page is taken at once (``fetched`` is set) and answered
    ``slow_s`` seconds later (a read still in flight long after the engine rendered it: a loaded
    server's answer queued behind its other work)."""
    servers: list[tuple[ThreadingHTTPServer, FakeMetrics]] = []

    def make(
        mode: str,
        pages: list[str] | None = None,
        hang_s: float = 30.0,
        upstream: str | None = None,
        slow_hits: tuple[int, ...] = (1,),
        slow_s: float = 3.0,
    ) -> FakeMetrics:
        state = FakeMetrics(url="")

        class Handler(BaseHTTPRequestHandler):
            # "late" keeps its connections open like vLLM's server (the agent then reads on
            # one kept-alive connection); the others close after each answer.
            protocol_version = "HTTP/1.1" if mode == "late" else "HTTP/1.0"

            def do_GET(self):
                state.hits += 1
                if mode == "hang":
                    state.release.wait(hang_s)
                    return
                if mode == "500":
                    body, code = b"internal error", 500
                elif mode == "slow":
                    if state.hits in slow_hits:
                        state.release.wait(slow_s)
                    live = urllib.request.urlopen(upstream + self.path, timeout=10)
                    body, code = live.read(), live.status
                elif mode == "late":
                    live = urllib.request.urlopen(upstream + self.path, timeout=10)
                    body, code = live.read(), live.status
                    if state.hits in slow_hits:
                        state.fetched.set()
                        state.release.wait(slow_s)
                        state.answered_at.append(time.monotonic())
                elif mode == "garbage":
                    body, code = b"\x00\xffnot { prometheus at all\n<html>", 200
                else:
                    page = pages[min(state.hits, len(pages)) - 1]
                    body, code = page.encode(), 200
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server, url = _serve(Handler)
        state.url = url
        servers.append((server, state))
        return state

    yield make
    for server, state in servers:
        state.release.set()
        server.shutdown()
        server.server_close()
