"""The image's entry point (appliance/engine/vllm_main.py) leaves SIGTERM to vLLM's drain.

vLLM before 0.32 serves through a plain ``uvicorn.Server``, whose ``capture_signals`` (uvicorn
0.54 here, as in the 0.19 image's lock) replaces the handler vLLM's ``serve_http`` registered
with ``loop.add_signal_handler``: uvicorn exits at the SIGTERM and vLLM never drains. A child
process serves the way vLLM 0.19's ``serve_http`` does (a real uvicorn server on a socket of its
own, the loop's SIGTERM handler registered beside it) and gets a real SIGTERM.
"""

from __future__ import annotations

import gc
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
import pytest
from plugins.traffic import Traffic

from appliance.engine import local, vllm_main

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


# ---- the requests in flight end before the engine core is signalled --------------------------


def test_the_wait_ends_when_nothing_is_in_flight_or_the_engine_is_dead_or_time_ran_out():
    ends = [time.monotonic() + 0.1]
    left = vllm_main.wait_for(lambda: time.monotonic() < ends[0], 30, poll_s=0.005)
    assert time.monotonic() >= ends[0] and 29 < left <= 30
    assert vllm_main.wait_for(lambda: True, 0.1, poll_s=0.005) == 0.0  # (unbounded: a hang)
    assert vllm_main.wait_for(lambda: True, 30, dead=lambda: True) > 29  # nothing to wait for


# ---- vLLM's modules load with the garbage collector off, and stay frozen ----------------------


class _Node:
    """An object the collector tracks (a plain ``object()`` is not)."""


def test_what_loads_at_start_is_frozen_and_the_collector_is_on_again():
    while_loading = []

    def load() -> list[_Node]:
        while_loading.append(gc.isenabled())
        return [_Node() for _ in range(100)]

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        built = vllm_main.load_frozen(load)
        assert while_loading == [False]
        assert gc.isenabled()
        # What it built is in the permanent generation: no collection walks it again.
        assert gc.get_freeze_count() >= frozen + len(built)
    finally:
        gc.unfreeze()


def test_a_load_that_fails_leaves_the_collector_on():
    def load() -> None:
        raise ImportError("no vllm here")

    with pytest.raises(ImportError):
        vllm_main.load_frozen(load)
    gc.unfreeze()
    assert gc.isenabled()


# FAKE fault: vLLM 0.19's engine core died in glibc at its SIGTERM in 1 of 16 stops
# (benchmarks/stop_streams.py); no release does it on demand. Here the engine core, a process
# forked from the API server, aborts (a real SIGABRT) at every SIGTERM it gets.
ABORT_AT_SIGTERM = textwrap.dedent(
    """
    import os, signal, sys

    os.environ.setdefault("FAKE_API_SERVER_PID", str(os.getpid()))
    _set_handler = signal.signal

    def _abort(signum, frame):
        print("FAKE: the engine core aborts at its SIGTERM", file=sys.stderr, flush=True)
        os.abort()

    def _signal(sig, handler):
        if sig == signal.SIGTERM and os.getpid() != int(os.environ["FAKE_API_SERVER_PID"]):
            handler = _abort
        return _set_handler(sig, handler)

    signal.signal = _signal
    """
)


@pytest.mark.engine
@pytest.mark.own_engines  # an engine of its own only, no session engine: either stream may run it
@pytest.mark.traffic
def test_a_stop_finishes_the_requests_in_flight_even_if_the_engine_core_dies_at_its_sigterm(
    tmp_path,
):
    """The container's stop as docker makes it (a SIGTERM to the API server only; the engine
    core hears of it from vLLM's shutdown) under steady traffic, with the image's drain
    (``--shutdown-timeout``) and stop gate: every request in flight ends whole although the
    engine core dies at its SIGTERM, because it gets that SIGTERM only once they ended. Before,
    vLLM signalled the core at once and every stream in flight was cut."""
    (tmp_path / "sitecustomize.py").write_text(ABORT_AT_SIGTERM)
    gate_dir = REPO / "appliance" / "engine"  # as the images carry stop_gate.py beside the entry
    path = os.pathsep.join(
        filter(None, (str(tmp_path), str(gate_dir), os.environ.get("PYTHONPATH")))
    )
    args = ["--shutdown-timeout", "50", "--middleware", "stop_gate.StopGate"]
    log = tmp_path / "vllm.log"
    with (
        local.serve(extra_args=args, env={"PYTHONPATH": path}, log_path=log) as engine,
        Traffic(engine.url, clients=4, label="stop, engine core dies at SIGTERM") as traffic,
    ):
        time.sleep(2)  # the long streams are running
        engine.process.send_signal(signal.SIGTERM)
        try:
            engine.process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # the streams cut hung the server: they end now
            engine.stop()
    text = log.read_text(errors="replace")
    assert "FAKE: the engine core aborts at its SIGTERM" in text, text[-3000:]
    assert "requests in flight end before the engine core is signalled" in text, text[-3000:]
    broke = traffic.report.promise(down=True)
    assert broke is None, f"{broke}\n{text[-3000:]}"
