"""The per-instance lock, between real processes: one holder, a clear error, freed on death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cutover import lock

_HOLDER = """
import sys, time
from pathlib import Path
from appliance.cutover import lock
with lock.hold(Path(sys.argv[1]), "i1", "cutover to gemma4-vllm:mtp") as held:
    held.note("abc123")
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout.readline() == b"held\n"
    return proc


def test_second_holder_gets_a_clear_error_naming_the_first(tmp_path):
    path = tmp_path / "locks" / "i1.lock"
    proc = _holder(path)
    try:
        with pytest.raises(lock.LockBusy) as err, lock.hold(path, "i1", "cutover to x:1"):
            pass
        assert "instance i1 is busy" in str(err.value)
        assert f"pid {proc.pid}, cutover to gemma4-vllm:mtp" in str(err.value)
        assert err.value.exit_code == 3
        holder = lock.current_holder(path)
        assert holder is not None and (holder.pid, holder.entry_id) == (proc.pid, "abc123")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # The kernel released the dead holder's lock: no stale lock, no cleanup needed.
    assert lock.current_holder(path) is None
    with lock.hold(path, "i1", "cutover to x:1") as held:
        assert held.holder.pid == os.getpid()


def test_lock_is_per_instance(tmp_path):
    proc = _holder(tmp_path / "i1.lock")
    try:
        with lock.hold(tmp_path / "i2.lock", "i2", "rollback"):
            pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_no_holder_when_the_file_does_not_exist(tmp_path):
    assert lock.current_holder(tmp_path / "none.lock") is None
