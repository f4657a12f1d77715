"""The stop gate (appliance/engine/stop_gate.py) inside vLLM's own HTTP launcher.

vLLM's ``serve_http`` (vllm/entrypoints/launchers/launcher.py) runs here as the API server runs
it: uvloop, its SIGTERM handler, uvicorn, a real socket on 127.0.0.1 and a real SIGTERM to this
process. Only the engine client is a stand-in (FAKE: a tiny engine's drain needs a minute-long
engine start; the systemd stop test drains the real one): its ``shutdown`` blocks as vLLM's
drain does until the request in flight ends, and a request that reaches it after the SIGTERM
gets HTTP 500 as vLLM's does (``cannot schedule new futures after shutdown``). What the gate
must do around it: new requests and /health 503 with Retry-After from the SIGTERM on, the
request in flight whole, /metrics open, vLLM's own shutdown still run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import types

import httpx

from appliance.engine import stop_gate
from appliance.engine.stop_gate import StopGate

CHUNKS = 5


class DrainingEngine:
    """FAKE engine client (see the module docstring): what vLLM's launcher and watchdog read."""

    def __init__(self) -> None:
        self.vllm_config = types.SimpleNamespace(shutdown_timeout=50)
        self.errored, self.is_running = False, True
        self.draining = threading.Event()
        self.drained = threading.Event()

    def shutdown(self, timeout: float) -> None:
        self.draining.set()  # vLLM's renderer pool is shut from here on
        assert self.drained.wait(30), "the request in flight never ended"


def engine_app(engine: DrainingEngine, release: asyncio.Event, entered: asyncio.Event):
    """vLLM's behaviour during a drain, as the gate meets it: /health 200, a new generation
    500, a request already streaming goes on, and one admitted just before the SIGTERM but
    added to the engine after it ends ``abort`` with no token."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI()
    app.state.engine_client = engine

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("vllm:num_requests_running 1\n")

    @app.post("/v1/chat/completions")
    async def chat():
        if engine.draining.is_set():
            error = "RuntimeError: cannot schedule new futures after shutdown"
            return JSONResponse({"error": {"message": error}}, status_code=500)
        return JSONResponse({"ok": True})

    @app.post("/v1/completions")
    async def rejected_by_the_engine_core():
        entered.set()
        await release.wait()  # its prompt is still being rendered when the SIGTERM comes

        async def events():
            abort = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
            yield f"data: {json.dumps(abort)}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 0}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/stream")
    async def stream():
        async def chunks():
            for i in range(CHUNKS):
                if i == 1:
                    await release.wait()  # in flight across the SIGTERM
                yield f"chunk {i}\n"
            engine.drained.set()

        return StreamingResponse(chunks())

    app.add_middleware(StopGate)  # what vLLM's --middleware does with a class
    return app


def refused(resp: httpx.Response) -> bool:
    return (
        resp.status_code == 503
        and resp.headers.get("retry-after") == str(stop_gate.RETRY_AFTER_S)
        and resp.headers.get("connection") == "close"
        and resp.json()["error"]["code"] == 503
    )


async def _stop_while_streaming() -> dict:
    from vllm.entrypoints.launchers.launcher import create_server_socket, serve_http

    engine, release, entered = DrainingEngine(), asyncio.Event(), asyncio.Event()
    app = engine_app(engine, release, entered)
    sock = create_server_socket(("127.0.0.1", 0), reuse_port=False)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    served = asyncio.create_task(
        serve_http(app, sock, host="127.0.0.1", port=sock.getsockname()[1], log_level="warning")
    )
    out: dict = {}

    async def answer(client: httpx.AsyncClient, method: str, path: str) -> object:
        try:
            return await client.request(method, path, json={} if method == "POST" else None)
        except httpx.ConnectError:
            return "refused"

    # One client per check that meets a connection opened before the SIGTERM (each keeps one
    # alive), one for the request admitted before it, one for the stream in flight.
    names = ("chat", "health", "metrics", "main", "fresh")
    clients = [httpx.AsyncClient(base_url=url, timeout=30) for _ in names]
    kept = dict(zip(names, clients, strict=True))
    try:
        for _ in range(200):
            if await answer(kept["main"], "GET", "/health") != "refused":
                break
            await asyncio.sleep(0.05)
        for name, method, path in (
            ("chat", "POST", "/v1/chat/completions"),
            ("health", "GET", "/health"),
            ("metrics", "GET", "/metrics"),
        ):
            out[f"{name} before"] = (await answer(kept[name], method, path)).status_code
        admitted = asyncio.create_task(answer(kept["main"], "POST", "/v1/completions"))
        await entered.wait()
        got: list[str] = []
        # The stream holds the "fresh" client's one connection: its next request opens another.
        async with kept["fresh"].stream("GET", "/stream") as stream:
            lines = stream.aiter_lines()
            got.append(await anext(lines))
            os.kill(os.getpid(), signal.SIGTERM)  # what docker stop sends
            while not engine.draining.is_set():  # vLLM's handler ran: its drain began
                await asyncio.sleep(0.01)
            for name, method, path in (
                ("chat", "POST", "/v1/chat/completions"),
                ("health", "GET", "/health"),
                ("metrics", "GET", "/metrics"),
                ("fresh", "GET", "/health"),
            ):
                out[f"{name} during"] = await answer(kept[name], method, path)
            release.set()
            out["admitted"] = await admitted
            got += [line async for line in lines]
        out["stream"] = got
        shutdown = await asyncio.wait_for(served, 30)  # vLLM's serve_http returns at the end
        await shutdown
        out["after"] = await answer(kept["fresh"], "GET", "/health")
    finally:
        for client in clients:
            await client.aclose()
    return out


def test_from_the_sigterm_on_arrivals_are_refused_and_the_request_in_flight_ends_whole():
    import uvloop  # vLLM's API server runs on it (entrypoints/launchers/api_server/entry.py)

    before = signal.getsignal(signal.SIGTERM)
    try:
        out = uvloop.run(_stop_while_streaming())
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [out[f"{n} before"] for n in ("chat", "health", "metrics")] == [200, 200, 200]
    # Without the gate: chat 500, /health 200.
    assert refused(out["chat during"]), (out["chat during"], out["chat during"].text)
    assert refused(out["health during"]), out["health during"]
    assert refused(out["fresh during"]), out["fresh during"]  # on a new connection
    assert out["metrics during"].status_code == 200
    # Admitted before the SIGTERM, rejected by the engine core after it: a 503, not a 200
    # that ends "abort" with no token.
    assert refused(out["admitted"]), (out["admitted"], out["admitted"].text)
    assert out["stream"] == [f"chunk {i}" for i in range(CHUNKS)]  # whole
    assert out["after"] == "refused"


def test_an_answer_that_starts_after_the_sigterm_is_held_until_it_shows_a_token():
    """Started after the gate shut: a 500, or an answer that ends with no token, goes out as
    the refusal; one that shows a token (a request drained whole) goes out as it came."""

    def through_the_gate(*messages: dict) -> list[dict]:
        sent: list[dict] = []
        gate = StopGate(None)
        gate._watching = True  # no signal handler here: the gate is shut by hand

        async def app(scope, receive, send):
            gate.shut = True  # the SIGTERM lands while this request is being handled
            for message in messages:
                await send(message)

        async def record(message):
            sent.append(message)

        gate.app = app
        asyncio.run(gate({"type": "http", "path": "/v1/chat/completions"}, None, record))
        return sent

    def answer(status: int, *bodies: bytes) -> list[dict]:
        start = {"type": "http.response.start", "status": status, "headers": []}
        parts = [{"type": "http.response.body", "body": b, "more_body": True} for b in bodies]
        return [start, *parts, {"type": "http.response.body", "body": b"", "more_body": False}]

    def event(doc: dict) -> bytes:
        return f"data: {json.dumps(doc)}\n\n".encode()

    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    token = event({"choices": [{"index": 0, "delta": {"content": "One"}}]})
    aborted = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
    plain_abort = json.dumps(
        {"choices": [{"message": {"content": ""}, "finish_reason": "abort"}],
         "usage": {"completion_tokens": 0}}
    ).encode()  # fmt: skip
    plain_whole = json.dumps(
        {"choices": [{"message": {"content": "One two"}, "finish_reason": "length"}],
         "usage": {"completion_tokens": 2}}
    ).encode()  # fmt: skip
    for refused_answer in (
        answer(500, b'{"error": {"message": "cannot schedule new futures after shutdown"}}'),
        answer(200, role, aborted, b"data: [DONE]\n\n"),
        answer(200, plain_abort),
    ):
        sent = through_the_gate(*refused_answer)
        assert [m.get("status") for m in sent] == [503, None], sent
        assert b"vLLM is stopping" in sent[1]["body"]
    for passed in (answer(200, role, token, aborted), answer(200, plain_whole)):
        assert through_the_gate(*passed) == passed
    # Not a generation's answer: not the gate's to judge.
    other = answer(200, b'{"tokens": [1, 2], "count": 2}')
    assert through_the_gate(*other) == other


def test_with_no_handler_to_follow_the_gate_says_so_and_never_shuts(capsys):
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert StopGate(None).watch() is False
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # left as it was
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "no SIGTERM handler to follow" in capsys.readouterr().err


def test_a_generation_whose_200_was_not_yet_sent_when_the_gate_shut_is_refused_not_aborted():
    """vLLM starts a stream's 200 before its first token: a request admitted an instant before
    the SIGTERM, then aborted by the engine core with no token (``_reject_add_in_shutdown``),
    read as a cut stream (seen in a fleet roll under traffic). The gate holds a generation's
    answer until a token, so such a one goes out as the refusal; with the gate open the same
    tokenless answer passes as it came."""
    start = {"type": "http.response.start", "status": 200, "headers": []}
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    abort = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}\n\n'
    bodies = [
        {"type": "http.response.body", "body": role, "more_body": True},
        {"type": "http.response.body", "body": abort, "more_body": True},
        {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False},
    ]

    def through_the_gate(shut_after_start: bool) -> list[dict]:
        sent: list[dict] = []
        gate = StopGate(None)
        gate._watching = True  # no signal handler here: the gate is shut by hand

        async def app(scope, receive, send):
            await send(start)
            gate.shut = shut_after_start  # the SIGTERM lands after vLLM started the answer
            for message in bodies:
                await send(message)

        async def record(message):
            sent.append(message)

        gate.app = app
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
        asyncio.run(gate(scope, None, record))
        return sent

    refused_ = through_the_gate(shut_after_start=True)
    assert [m.get("status") for m in refused_] == [503, None], refused_
    assert through_the_gate(shut_after_start=False) == [start, *bodies]


def test_an_exception_that_vllm_019_answers_outside_the_gate_is_refused_once_shut():
    """vLLM 0.19 registers a handler for every exception (``app.exception_handler(Exception)``
    in vllm/entrypoints/openai/api_server.py), which Starlette runs in its ServerErrorMiddleware,
    outside every middleware: its renderer's ``cannot schedule new futures after shutdown`` went
    out past the gate as that 500 (3 of 359 requests, a cutover from the 0.19 image under
    traffic). A request the SIGTERM meets inside vLLM whose handling raises is now refused by
    the gate itself; with the gate open the exception goes on to vLLM's handler as before."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    gates: list[StopGate] = []

    class Gate(StopGate):
        def __init__(self, app) -> None:
            super().__init__(app)
            self._watching = True  # no signal handler here: the gate is shut by hand
            gates.append(self)

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(sigterm: bool = False):
        gates[0].shut = sigterm  # the SIGTERM lands while vLLM renders the request
        raise RuntimeError("cannot schedule new futures after shutdown")

    async def vllm_019_handler(request, exc):
        body = {"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}
        return JSONResponse(body, status_code=500)

    app.exception_handler(Exception)(vllm_019_handler)
    app.add_middleware(Gate)

    async def calls() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gate") as client:
            open_ = await client.post("/v1/chat/completions", json={})
            shut = await client.post("/v1/chat/completions?sigterm=true", json={})
        return open_, shut

    open_, shut = asyncio.run(calls())
    assert open_.status_code == 500 and "cannot schedule new futures" in open_.text
    assert shut.status_code == 503 and shut.headers["retry-after"] == "5", shut.text
    assert json.loads(shut.text)["error"]["message"] == stop_gate.MESSAGE
