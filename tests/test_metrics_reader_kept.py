"""The agent's kept-alive /metrics reader (metrics_reader.KeptReader) reads an HTTP/1.x answer
by hand (issue 56 §2: http.client's header parse through the email package was a fifth of the
agent's background CPU per call). Here it meets a server that writes raw bytes: every way an
answer's body is framed (Content-Length, chunks with extensions and a trailer, the connection's
close), answers cut into pieces at any byte, a kept connection reused and one the server closed,
and the answers it must refuse or time out on, each as the one typed error the agent counts.
The reading is always the one :func:`metrics_reader.parse` makes of the same body."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine_api import metrics_reader

PAGE = (Path(__file__).parent / "data/metrics-vllm-0.32-mtp.txt").read_bytes()
EXPECTED = metrics_reader.parse(200, PAGE)


def same(a: metrics_reader.Reading, b: metrics_reader.Reading) -> bool:
    """Equal but for ``at`` (when the body was complete)."""
    return (a.snapshot, a.generation_tokens, a.finished_requests) == (
        b.snapshot,
        b.generation_tokens,
        b.finished_requests,
    )


# An answer: the byte pieces written one after another (``pause`` s apart), then whether the
# server closes the connection.
@dataclass
class Answer:
    pieces: list[bytes]
    close: bool = False
    pause: float = 0.0


@dataclass
class RawServer:
    """A loopback server that reads each request's head and writes the next scripted answer
    (the last one repeated) as raw bytes."""

    answers: list[Answer]
    url: str = ""
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    _sock: socket.socket | None = None

    def start(self) -> RawServer:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/metrics/"
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                try:
                    for piece in answer.pieces:
                        conn.sendall(piece)
                        if answer.pause:
                            time.sleep(answer.pause)
                except OSError:
                    return
                if answer.close:
                    return

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def raw_server() -> Iterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    def make(*answers: Answer) -> RawServer:
        servers.append(RawServer(list(answers)).start())
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def with_length(body: bytes = PAGE, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body
    )


def chunked(body: bytes = PAGE, sizes: tuple[int, ...] = (100, 7, 4000)) -> bytes:
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"]
    at, i = 0, 0
    while at < len(body):
        n = sizes[i % len(sizes)]
        part = body[at : at + n]
        out.append(f"{len(part):x};ext=1\r\n".encode() + part + b"\r\n")
        at, i = at + n, i + 1
    out.append(b"0\r\nX-Trailer: yes\r\n\r\n")
    return b"".join(out)


def test_an_answer_by_length_is_read_and_the_connection_kept(raw_server):
    srv = raw_server(Answer([with_length()]))
    reader = metrics_reader.KeptReader(srv.url)
    for _ in range(3):
        assert same(reader.read(2.0), EXPECTED)
    assert srv.connections == 1 and len(srv.requests) == 3
    # The request http.client sent: the filtered path, the Host the URL names.
    line, *headers = srv.requests[0].decode().split("\r\n")
    assert line.startswith("GET /metrics/?name%5B%5D=vllm%3Aspec_decode") and line.endswith(
        " HTTP/1.1"
    )
    assert f"Host: {srv.url.split('/')[2]}" in headers


def test_a_chunked_answer_with_extensions_and_a_trailer_is_read(raw_server):
    srv = raw_server(Answer([chunked()]))
    reader = metrics_reader.KeptReader(srv.url)
    assert same(reader.read(2.0), EXPECTED) and same(reader.read(2.0), EXPECTED)
    assert srv.connections == 1


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n",
    ],
    ids=["close", "http/1.0"],
)
def test_an_answer_ended_by_the_close_is_read_and_a_new_connection_made(raw_server, head):
    srv = raw_server(Answer([head + PAGE], close=True))
    reader = metrics_reader.KeptReader(srv.url)
    assert same(reader.read(2.0), EXPECTED) and same(reader.read(2.0), EXPECTED)
    assert srv.connections == 2


def test_a_kept_connection_the_server_closed_is_read_again_on_a_fresh_one(raw_server):
    """The server answers (keep-alive) and then drops the connection, as a server whose idle
    timeout ran out: the next read finds it closed and reads once more on a fresh one."""
    srv = raw_server(Answer([with_length()], close=True))
    reader = metrics_reader.KeptReader(srv.url)
    assert same(reader.read(2.0), EXPECTED)
    time.sleep(0.05)  # the server's side is closed by now
    assert same(reader.read(2.0), EXPECTED)
    assert srv.connections == 2


def test_an_interim_answer_is_skipped(raw_server):
    srv = raw_server(Answer([b"HTTP/1.1 100 Continue\r\n\r\n" + with_length()]))
    assert same(metrics_reader.KeptReader(srv.url).read(2.0), EXPECTED)


def test_bytes_past_the_answer_close_the_connection(raw_server):
    """A server that wrote more than its Content-Length: the next answer on that connection
    would be read out of step, so the next read takes a fresh connection."""
    srv = raw_server(Answer([with_length() + b"HTTP/1.1 200 OK\r\n"]))
    reader = metrics_reader.KeptReader(srv.url)
    assert same(reader.read(2.0), EXPECTED) and same(reader.read(2.0), EXPECTED)
    assert srv.connections == 2


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        pytest.param(
            Answer([with_length(b"no", b"500 Internal Server Error")]), "status", id="500"
        ),
        pytest.param(Answer([with_length(b"\x00\xffnot prometheus")]), "parse", id="garbage"),
        pytest.param(Answer([b"SSH-2.0-OpenSSH_9.2\r\n\r\n"]), "unreachable", id="not-http"),
        pytest.param(
            Answer([b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\n"]), "unreachable", id="length"
        ),
        pytest.param(
            Answer([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"]),
            "unreachable",
            id="coding",
        ),
        pytest.param(Answer([chunked()[:-40]], close=True), "unreachable", id="cut-inside-a-chunk"),
        pytest.param(
            Answer([with_length()[:-10]], close=True), "unreachable", id="cut-inside-the-body"
        ),
        pytest.param(Answer([b""], close=True), "unreachable", id="closed-at-once"),
        pytest.param(Answer([b"HTTP/1.1 200 OK\r\n"], pause=5.0), "timeout", id="hang"),
    ],
)
def test_what_is_not_an_answer_is_one_typed_error(raw_server, answer, kind):
    srv = raw_server(answer)
    reader = metrics_reader.KeptReader(srv.url)
    t0 = time.monotonic()
    with pytest.raises(metrics_reader.MetricsReadError) as err:
        reader.read(0.5)
    assert err.value.kind == kind, err.value
    assert time.monotonic() - t0 < 2.0
    # The reader is free again (no read outstanding) and keeps no half-read connection.
    with pytest.raises(metrics_reader.MetricsReadError):
        reader.read(0.5)


def test_a_server_that_trickles_is_cut_off_by_the_whole_reads_deadline(raw_server):
    """Each piece comes well inside the socket's timeout; the answer as a whole does not."""
    pieces = [with_length()[i : i + 200] for i in range(0, len(with_length()), 200)]
    srv = raw_server(Answer(pieces, pause=0.05))
    t0 = time.monotonic()
    with pytest.raises(metrics_reader.MetricsReadError) as err:
        metrics_reader.KeptReader(srv.url).read(0.3)
    assert err.value.kind == "timeout"
    assert time.monotonic() - t0 < 1.0


def test_a_server_that_is_not_there_is_unreachable():
    from appliance.engine.local import free_port

    reader = metrics_reader.KeptReader(f"http://127.0.0.1:{free_port()}/metrics/")
    with pytest.raises(metrics_reader.MetricsReadError) as err:
        reader.read(0.5)
    assert err.value.kind == "unreachable"


@settings(max_examples=40, deadline=None)
@given(
    framing=st.sampled_from(["length", "chunked"]),
    cuts=st.lists(st.integers(1, len(chunked()) - 1), max_size=6, unique=True),
)
def test_an_answer_cut_into_pieces_anywhere_reads_the_same(framing, cuts):
    """TCP may deliver an answer in any pieces: the head split inside a CRLF, a chunk size
    apart from its chunk. Two answers on one connection, each cut at the same bytes."""
    whole = with_length() if framing == "length" else chunked()
    at = [0, *sorted(c for c in cuts if c < len(whole)), len(whole)]
    pieces = [whole[a:b] for a, b in itertools.pairwise(at) if b > a]
    srv = RawServer([Answer(pieces, pause=0.001)]).start()
    try:
        reader = metrics_reader.KeptReader(srv.url)
        assert same(reader.read(2.0), EXPECTED) and same(reader.read(2.0), EXPECTED)
        assert srv.connections == 1
    finally:
        srv.close()
