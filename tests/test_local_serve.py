"""`appliance dev serve` in the foreground: serves, and SIGTERM leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance.engine import local
from appliance.engine.local import _alive, _descendants, free_port

pytestmark = [pytest.mark.engine, pytest.mark.own_engines]

APPLIANCE = str(Path(sys.executable).with_name("appliance"))


def test_sigterm_stops_every_engine_process(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [APPLIANCE, "dev", "serve", "--profile", "cpu-tiny-mtp", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once /health answers
        assert f"http://127.0.0.1:{port}/v1" in line, proc.stderr.read() if not line else line
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        engine_pids = _descendants(proc.pid)
        assert len(engine_pids) >= 2  # the API server and the engine core at least
        # The engine core is forked (appliance/engine/vllm_main.py): no spawned interpreter, and
        # so no resource tracker beside it.
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in engine_pids}
        assert not [c for c in cmdlines.values() if b"multiprocessing" in c], cmdlines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while _alive(engine_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(engine_pids) == set(), f"orphaned engine processes: {_alive(engine_pids)}"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            # A failed assert above: SIGKILL would orphan the engine, so its processes go too.
            for pid in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()


def test_unknown_profile_is_one_line_and_exit_2():
    result = subprocess.run(
        [APPLIANCE, "dev", "serve", "--profile", "nope"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("Error: unknown profile 'nope'")
    assert "appliance profiles list" in result.stderr and result.stderr.count("\n") == 1


def test_gpu_profile_is_refused_locally_with_the_fix():
    result = subprocess.run(
        [APPLIANCE, "dev", "serve", "--profile", "l4x4-31b-mtp"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "needs 4x NVIDIA L4" in result.stderr and "cpu-tiny-mtp" in result.stderr


def test_a_picked_port_taken_before_the_engine_binds_it_is_replaced(monkeypatch):
    """A FAKE of one step, the race itself: another socket binding the picked port in the minute
    before vLLM does cannot be made to happen on demand. So the first port handed out here is
    one this test already listens on (vLLM then fails to bind it, for real); the second is a
    real free one, where the engine must end up serving."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        real = local.free_port
        monkeypatch.setattr(local, "free_port", lambda: next(picks, None) or real())
        with local.serve("cpu-tiny", timeout=900) as eng:
            assert eng.port != taken and next(picks, None) is None  # the taken one was tried
            assert httpx.get(f"{eng.url}/health", timeout=5).status_code == 200
