"""The traffic harness (tests/plugins/traffic.py) tells its four classes apart.

STAND-IN, and why: the classifier must be shown to name each way a request can end, and a real
vLLM cannot be made to cut a stream, truncate a body or drop a connection on demand. A scripted
HTTP server on 127.0.0.1 answers the harness's own requests each way; the ``traffic`` tests
then run the same harness against the real engines under systemd.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
from plugins.traffic import CUT, ERROR, REFUSED, WHOLE, Outcome, Report, Traffic

from appliance.engine.local import free_port


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers a chat completion as ``server.mode`` says."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        asked, mode = req["max_tokens"], self.server.mode
        tokens = asked - 1 if mode == "short-usage" else asked
        if mode == "drop":  # no answer at all
            self.close_connection = True
            return
        if mode in ("503", "500"):
            return self._send(int(mode), b'{"error": "busy"}')
        usage = {"completion_tokens": tokens}
        if not req.get("stream"):
            body = json.dumps(
                {"choices": [{"finish_reason": "length", "message": {}}], "usage": usage}
            ).encode()
            if mode == "truncated":  # the headers promise more than comes
                self._send(200, body[:20], length=len(body))
                self.close_connection = True
                return
            return self._send(200, body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # no length: the stream ends when the connection closes
        self.close_connection = True
        events = [{"choices": [{"delta": {"content": "x"}, "finish_reason": None}]}]
        if mode == "error-event-first":
            events = [{"error": {"code": 503, "message": "busy"}}]
        elif mode == "error-event-later":
            events.append({"error": {"code": 500, "message": "engine died"}})
        elif mode != "truncated":
            events += [{"choices": [{"delta": {}, "finish_reason": "length"}]}, {"usage": usage}]
        for ev in events:
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
        if mode not in ("truncated", "error-event-first", "error-event-later"):
            self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def scripted() -> Iterator[http.server.ThreadingHTTPServer]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    srv.mode = "whole"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _run(url: str) -> Report:
    """Four clients (two long streamers, two mixed) until at least two plain and two streamed
    calls ended, or 200 calls (the bound: each client then stops by itself)."""
    traffic = Traffic(url, "k", clients=4, max_requests=200, retry_s=0.01, read_timeout=10)
    traffic.start()
    while not traffic.wait_ended(0.05):
        kinds = Counter(o.stream for o in traffic.so_far())
        if min(kinds[True], kinds[False]) >= 2:
            break
    return traffic.stop()


@pytest.mark.parametrize(
    ("mode", "stream_cls", "plain_cls"),
    [
        ("whole", WHOLE, WHOLE),
        ("503", REFUSED, REFUSED),
        ("500", ERROR, ERROR),
        ("drop", ERROR, ERROR),
        ("truncated", CUT, CUT),
        ("short-usage", CUT, CUT),
        ("error-event-first", REFUSED, WHOLE),
        ("error-event-later", CUT, WHOLE),
    ],
)
def test_each_way_a_request_ends_has_its_class(scripted, mode, stream_cls, plain_cls):
    scripted.mode = mode
    report = _run(f"http://127.0.0.1:{scripted.server_address[1]}")
    by_kind = {(o.stream, o.cls) for o in report.outcomes}
    assert {cls for stream, cls in by_kind if stream} == {stream_cls}, report.summary()
    assert {cls for stream, cls in by_kind if not stream} == {plain_cls}, report.summary()
    assert min(Counter(o.stream for o in report.outcomes).values()) >= 2
    if mode == "503":  # answered: shed, not down
        assert report.shed() == len(report.outcomes) and report.down_seconds == 0
    if mode == "whole":
        assert report.promise() is None
    elif CUT in (stream_cls, plain_cls) or ERROR in (stream_cls, plain_cls):
        assert "the traffic promise broke" in report.promise()


def test_nothing_listening_is_refused_and_never_whole():
    report = _run(f"http://127.0.0.1:{free_port()}")
    assert report.counts() == {WHOLE: 0, REFUSED: len(report.outcomes), CUT: 0, ERROR: 0}
    assert {o.detail for o in report.outcomes} == {"connection refused"}
    assert report.shed() == 0 and report.down_seconds == report.refused_seconds > 0
    # Refused traffic alone keeps no promise: nothing was served.
    assert "the traffic promise broke" in report.promise()


def test_only_127_0_0_1():
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        Traffic("http://10.0.0.1:8000")


def _o(cls: str, start: float, end: float) -> Outcome:
    return Outcome(0, True, 8, start, end, cls)


def test_refusals_make_stretches_and_whole_requests_through_them_count_as_drained():
    report = Report(
        [
            _o(WHOLE, 0.0, 5.0),  # running when the first refusals came: drained
            _o(REFUSED, 2.0, 2.1),
            _o(REFUSED, 3.0, 3.2),  # within REFUSAL_GAP_S: one stretch, 2.0..3.2
            _o(WHOLE, 3.5, 4.0),  # between refusals, none while it ran
            _o(REFUSED, 10.0, 10.5),  # a second stretch
            _o(WHOLE, 11.0, 12.0),  # after the last refusal
        ],
        started=0.0,
        stopped=12.0,
    )
    assert report.refused_windows() == [(2.0, 3.2), (10.0, 10.5)]
    assert report.refused_seconds == pytest.approx(1.7)
    assert [o.start for o in report.drained()] == [0.0]
    assert [o.start for o in report.whole_after_refusals()] == [11.0]
    assert report.promise(down=True, back=True) is None
    assert "refused traffic for 1.7 s (+2.0..3.2 s, +10.0..10.5 s)" in report.summary()


def test_a_stop_that_drained_nothing_or_never_came_back_breaks_the_promise():
    whole_only = Report([_o(WHOLE, 0.0, 1.0)], started=0.0, stopped=1.0)
    assert whole_only.promise() is None
    assert "never refused" in whole_only.promise(down=True)
    # Refused, but nothing was running while it refused; nothing served after.
    nothing_drained = Report([_o(WHOLE, 0.0, 1.0), _o(REFUSED, 2.0, 2.1)], started=0.0, stopped=3.0)
    broke = nothing_drained.promise(down=True, back=True)
    assert "no request running while traffic was refused finished whole" in broke
    assert "nothing served whole after the last refusal" in broke
    # Where the drain is judged elsewhere (the fleet roll: on either host), refused is enough.
    assert nothing_drained.promise(down=True, drain=False) is None
    # What ran near the first refusal, to say why (a brand-new run's fleet roll, once).
    assert "in flight around the first refusal:\n    client 0 stream 8 +0.00..1.00 s whole" in broke
    cut = Report([_o(WHOLE, 0.0, 1.0), _o(CUT, 0.5, 2.0)], started=0.0, stopped=2.0)
    assert "cut and error must be 0" in cut.promise()
