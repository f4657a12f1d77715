"""The one rule for a request turned away at the queue bound (appliance/engine_api/shed.py), fast
tier.

The server here is a STAND-IN for an overloaded engine: a real HTTP server on 127.0.0.1 that
answers vLLM's admission 503 (its body as vllm/exceptions.py's QueueOverflowError words it), or
vLLM's streamed error event with code 503 (vLLM #58192), a given number of times and then a
completion. A real engine's 503s depend on when other requests end; the count here is exact.
The same rule on the real CPU engine at its bound: tests/test_overload_engine.py.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from appliance.engine_api import shed
from appliance.engine_api.vllm_client import VLLMClient
from appliance.errors import EngineError, OverloadedError
from appliance.serve import health

BUSY = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
ANSWER = {
    "choices": [{"message": {"content": "hello"}, "finish_reason": "length", "text": "hello"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2},
}

STREAMED = [
    {"choices": [{"delta": {"content": "hello"}, "finish_reason": "length"}]},
    {"choices": [], "usage": ANSWER["usage"]},
]


class StandIn:
    """Answers the first ``busy`` POSTs as an engine at its bound would, then completions;
    ``how``: ``status`` (HTTP 503) or ``event`` (HTTP 200 and a streamed error event)."""

    def __init__(self, busy: int, how: str = "status", retry_after: str | None = None) -> None:
        self.busy, self.how, self.retry_after = busy, how, retry_after
        self.posts = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.posts += 1
                error = {"error": {"message": BUSY, "type": "ServiceUnavailable", "code": 503}}
                if owner.how == "status" and owner.posts > owner.busy:
                    self._send(200, json.dumps(ANSWER).encode(), "application/json")
                elif owner.how == "status":
                    self._send(503, json.dumps(error).encode(), "application/json")
                else:
                    events = [error] if owner.posts <= owner.busy else STREAMED
                    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
                    self._send(200, f"{body}data: [DONE]\n\n".encode(), "text/event-stream")

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                if status == 503 and owner.retry_after is not None:
                    self.send_header("Retry-After", owner.retry_after)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def stand_in() -> Iterator:
    servers: list[StandIn] = []

    def start(busy: int, how: str = "status", retry_after: str | None = None) -> StandIn:
        servers.append(StandIn(busy, how, retry_after))
        return servers[-1]

    yield start
    for s in servers:
        s.server.shutdown()
        s.server.server_close()


@pytest.mark.parametrize("how", ["status", "event"])
def test_a_shed_request_is_sent_again_and_counted(stand_in, how):
    server = stand_in(busy=3, how=how)
    pauses: list[float] = []
    tally = shed.Tally(sleep=pauses.append)
    with VLLMClient(server.url, timeout=10) as client:
        gen = shed.retry(
            lambda: client.generate("gemma4-tiny", "hi", 2, stream=how == "event"),
            time.monotonic() + 60,
            tally,
        )
    assert (gen.completion_tokens, server.posts) == (2, 4)
    assert tally.shed == 3 and tally.summary() == "3 probes shed at the queue bound"
    assert BUSY in tally.last.message
    assert pauses == [0.25, 0.5, 0.5]  # the backoff doubles (to MAX_BACKOFF_S)


def test_one_tally_over_many_calls_starts_each_calls_backoff_afresh(stand_in):
    """The canary sends its prompts one by one through one tally: a prompt that was answered
    ends its backoff, so the next prompt's first wait is the shortest again (kept at its most,
    every later prompt waited the longest pause, then 2 s, a try and lost each freed place to
    clients that retry sooner: a canary record beside six clients at a bound of 2 ran out its
    300 s)."""
    server = stand_in(busy=3)
    pauses: list[float] = []
    tally = shed.Tally("prompt", sleep=pauses.append)
    with VLLMClient(server.url, timeout=10) as client:
        for _ in range(2):
            shed.retry(
                lambda: client.generate("gemma4-tiny", "hi", 2), time.monotonic() + 60, tally
            )
            server.posts = 0  # the next call is turned away three times too
    assert pauses == [0.25, 0.5, 0.5] * 2
    assert tally.summary() == "6 prompts shed at the queue bound"


def test_the_servers_retry_after_is_honoured(stand_in):
    server = stand_in(busy=2, retry_after="3")
    pauses: list[float] = []
    with VLLMClient(server.url, timeout=10) as client:
        shed.retry(
            lambda: client.generate("gemma4-tiny", "hi", 2),
            time.monotonic() + 60,
            shed.Tally(sleep=pauses.append),
        )
    assert pauses == [3.0, 3.0]


def test_turned_away_until_the_deadline_fails_and_says_so(stand_in):
    server = stand_in(busy=1000)
    tally = shed.Tally(sleep=lambda _s: None)
    with VLLMClient(server.url, timeout=10) as client, pytest.raises(shed.TurnedAway) as out:
        # A Retry-After past the deadline: no try is left that could be answered in time.
        shed.retry(lambda: client.generate("gemma4-tiny", "hi", 2), time.monotonic(), tally)
    assert out.value.message.startswith(
        "turned away at the queue bound for 0 s (1 probe shed at the queue bound): "
    )
    assert BUSY in out.value.message and "gotchas/queue-bound.md" in str(out.value)
    assert not isinstance(out.value, OverloadedError)  # no "again" left for an outer loop
    assert server.posts == 1


def test_another_failure_is_not_retried(routed_http_server):
    # A stand-in that answers a POST 501 (http.server's unsupported method): not the queue
    # bound, so not sent again.
    url = routed_http_server({})
    tally = shed.Tally(sleep=lambda _s: pytest.fail("slept on a 404"))
    with VLLMClient(url, timeout=10) as client, pytest.raises(EngineError, match="answered 501"):
        shed.retry(lambda: client.generate("m", "hi", 2), time.monotonic() + 60, tally)
    assert tally.shed == 0


def test_the_heads_generation_probe_sends_a_shed_request_again(stand_in):
    """The serve program's probe (a multi-node head's wait-generates and probe timer)."""
    server = stand_in(busy=2, retry_after="0")
    notes: list[str] = []
    tally = shed.Tally(note=notes.append)
    code = health.generate("127.0.0.1", server.port, "gemma4-tiny", None, tally=tally)
    assert (code, tally.shed, server.posts) == (200, 2, 3)
    assert notes == ["1 probe shed at the queue bound, trying again"]  # then every 15 s
    busy = stand_in(busy=1000, retry_after="0")
    with pytest.raises(shed.TurnedAway, match="turned away at the queue bound for"):
        health.generate("127.0.0.1", busy.port, "gemma4-tiny", None, within=0)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("2", 2.0), ("0.5", 0.5), (None, None), ("", None), ("nan", None), ("-1", None),
     ("inf", None), ("Wed, 21 Oct 2026 07:28:00 GMT", None)],
)  # fmt: skip
def test_retry_after_reads_its_delay_seconds_form_only(header, seconds):
    assert shed.retry_after(header) == seconds
