"""HTTP servers the doctor and bench tests point at, all bound to 127.0.0.1.

- ``plain_http_server``: a real HTTP server that is not vLLM (Python's ``http.server``).
- ``routed_http_server``: a factory for a real HTTP server answering fixed routes; only for
  faults a real vLLM cannot be made to produce (the test using it says which).
- ``loading_health``: a stand-in for an engine still loading (503 to everything), for the serve
  program's waits: a real vLLM cannot be held in its load on demand.

``API_KEY`` guards the session's ``api_key_engine`` (tests/conftest.py), as an installed instance's
key does.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

API_KEY = "test-key-7f3a9c"  # not a secret: it guards a throwaway engine on 127.0.0.1


def _start(handler: type[http.server.BaseHTTPRequestHandler]) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _stop(srv: http.server.ThreadingHTTPServer) -> None:
    srv.shutdown()
    srv.server_close()


@contextlib.contextmanager
def loading_health(port: int) -> Iterator[None]:
    """503 to every request on 127.0.0.1:``port``, as an engine still loading answers. A test
    signals the wait once /proc shows its handler set (:mod:`plugins.processes`): a request
    says only that some program asked."""

    class Loading(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Loading)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        _stop(srv)


@pytest.fixture()
def plain_http_server() -> Iterator[str]:
    """A real HTTP server that is not vLLM (Python's http.server on 127.0.0.1)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep the CLI's captured output clean
            pass

    srv = _start(Quiet)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    _stop(srv)


@dataclass(frozen=True)
class Route:
    status: int
    body: bytes
    content_type: str = "application/json"


@pytest.fixture()
def routed_http_server() -> Iterator[Callable[[dict[str, Route]], str]]:
    """``start({path: Route})`` -> base URL of a server answering those GET paths (else 404)."""
    servers = []

    def start(routes: dict[str, Route]) -> str:
        class Routed(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                route = routes.get(
                    self.path.split("?", 1)[0], Route(404, b"not found", "text/plain")
                )
                self.send_response(route.status)
                self.send_header("Content-Type", route.content_type)
                self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                self.wfile.write(route.body)

            def log_message(self, *args):
                pass

        servers.append(_start(Routed))
        return f"http://127.0.0.1:{servers[-1].server_address[1]}"

    yield start
    for srv in servers:
        _stop(srv)
