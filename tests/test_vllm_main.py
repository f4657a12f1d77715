"""The image's entry point (appliance/engine/vllm_main.py) leaves SIGTERM to vLLM's drain.

vLLM before 0.32 serves through a plain ``uvicorn.Server``, whose ``capture_signals`` (uvicorn
0.54 here, as in the 0.19 image's lock) replaces the handler vLLM's ``serve_http`` registered
with ``loop.add_signal_handler``: uvicorn exits at the SIGTERM and vLLM never drains. A child
process serves the way vLLM 0.19's ``serve_http`` does (a real uvicorn server on a socket of its
own, the loop's SIGTERM handler registered beside it) and gets a real SIGTERM.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

from appliance.engine import vllm_main

REPO = Path(__file__).resolve().parents[1]

# vLLM 0.19's serve_http in small: its handler starts the drain; the server exits only when the
# drain is over (here: when the test asks /finish).
SERVER = textwrap.dedent(
    """
    import asyncio, signal, socket, sys
    import uvicorn
    sys.path.insert(0, sys.argv[1])
    if sys.argv[2] == "entry-point":
        from appliance.engine import vllm_main
        vllm_main._leave_signals_to_vllm()

    server = None

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/finish":
            server.should_exit = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"serving"})

    async def main():
        global server
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        loop = asyncio.get_running_loop()
        task = loop.create_task(server.serve(sockets=[sock]))
        loop.add_signal_handler(signal.SIGTERM, lambda: print("drain begins", flush=True))
        while not server.started:
            await asyncio.sleep(0.01)
        print("port", sock.getsockname()[1], flush=True)
        await task
        print("exited", flush=True)

    import uvloop  # as vLLM serves (`uvloop.run(run_server(args))`)

    uvloop.run(main())
    """
)


def serve(mode: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(REPO), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    assert line.startswith("port "), line
    return p, int(line.split()[1])


def test_through_the_entry_point_a_sigterm_starts_vllms_drain_and_the_server_keeps_serving():
    p, port = serve("entry-point")
    try:
        os.kill(p.pid, signal.SIGTERM)
        assert p.stdout.readline() == "drain begins\n"
        # The drain runs: the server still answers (vLLM's stop gate answers 503 here).
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "serving"
        httpx.get(f"http://127.0.0.1:{port}/finish", timeout=10)
        assert p.wait(timeout=30) == 0
        assert p.stdout.read() == "exited\n"
    finally:
        p.kill()


def test_without_it_uvicorn_ends_the_server_at_the_sigterm_before_any_drain():
    """What the entry point fixes, shown on the same uvicorn: uvicorn's own handler ends the
    server at the SIGTERM, though the drain never ended (nobody asked /finish)."""
    p, _ = serve("plain")
    try:
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        assert "exited\n" in p.stdout.read()
    finally:
        p.kill()


# ---- a drained engine core sends its last outputs before it exits ---------------------------


def _sender(outputs: queue.Queue, sent: list, each_s: float) -> threading.Thread:
    """The engine core's output thread, as vLLM runs it: a daemon taking each output off the
    queue and sending it (here: into ``sent``), ``each_s`` a send."""

    def run() -> None:
        while True:
            item = outputs.get()
            time.sleep(each_s)
            sent.append(item)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_core_exits_only_once_its_output_thread_took_the_last_outputs():
    """vLLM 0.19's drained engine core exited with its last step's outputs still queued: a
    stream in flight at the stop then never finished (benchmarks/stop_streams.py). The patched
    drain returns only once the sender took everything off the queue, and gave the last send
    its moment."""
    outputs: queue.Queue = queue.Queue()
    sent: list = []
    thread = _sender(outputs, sent, each_s=0.01)
    for i in range(20):
        outputs.put(i)
    assert vllm_main.flush(outputs, thread, grace_s=0.05) is True
    assert sent == list(range(20))


def test_a_wedged_sender_bounds_the_wait_and_a_dead_one_is_not_waited_for():
    outputs: queue.Queue = queue.Queue()
    wedged = _sender(outputs, [], each_s=3600)
    outputs.put("taken, never sent")
    outputs.put("never taken")
    assert vllm_main.flush(outputs, wedged, limit_s=0.2) is False  # (unbounded: a hang)
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    assert vllm_main.flush(outputs, gone) is False  # not alive: returns at once
    assert vllm_main.flush(queue.Queue(), None) is True


def test_the_entry_point_patches_the_engine_cores_drain():
    from vllm.v1.engine.core import EngineCoreProc

    before = EngineCoreProc._handle_shutdown
    try:
        vllm_main._send_the_last_outputs_at_a_drained_stop()
        assert EngineCoreProc._handle_shutdown is not before
        assert EngineCoreProc._handle_shutdown.__qualname__.startswith(
            "_send_the_last_outputs_at_a_drained_stop"
        )
    finally:
        EngineCoreProc._handle_shutdown = before
