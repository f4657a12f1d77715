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
        with lock.hold(tmp_path / "i2.lock", "i2", "rollback") as held:
            # i2 is ours while i1 stays the other process's: each lock file names its holder.
            assert (held.instance, held.holder.pid) == ("i2", os.getpid())
            i2 = lock.current_holder(tmp_path / "i2.lock")
            assert i2 is not None and (i2.pid, i2.action) == (os.getpid(), "rollback")
            i1 = lock.current_holder(tmp_path / "i1.lock")
            assert i1 is not None and (i1.pid, i1.entry_id) == (proc.pid, "abc123")
        assert lock.current_holder(tmp_path / "i2.lock") is None
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_no_holder_when_the_file_does_not_exist(tmp_path):
    assert lock.current_holder(tmp_path / "none.lock") is None


_READER = """
import sys
from pathlib import Path
from appliance.cutover import lock
path = Path(sys.argv[1])
print("reading", flush=True)
n = 0
while True:  # what `appliance status` and `history` do, as fast as they can, until killed
    lock.current_holder(path)
    n += 1
    if n == 2000:
        print("2000", flush=True)
"""

_ACQUIRER = """
import sys, time
from pathlib import Path
from appliance.cutover import lock
busy = held = 0
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # cutovers, one after another, for that long
    try:
        with lock.hold(Path(sys.argv[1]), "i1", "cutover to x:1"):
            held += 1
    except lock.LockBusy:
        busy += 1
print(busy, held, flush=True)
"""


def test_a_reader_never_makes_a_cutover_busy(tmp_path):
    path = tmp_path / "locks" / "i1.lock"
    path.parent.mkdir()
    path.touch()
    repo = Path(__file__).resolve().parents[1]
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(path)], stdout=subprocess.PIPE, cwd=repo
    )
    try:
        assert reader.stdout.readline() == b"reading\n"
        assert reader.stdout.readline() == b"2000\n"  # it is looping over the lock now
        acquirer = subprocess.run(
            [sys.executable, "-c", _ACQUIRER, str(path), "2"],
            capture_output=True,
            cwd=repo,
            timeout=300,
            check=True,
        )
        assert reader.poll() is None  # the reader was reading the whole time
    finally:
        os.kill(reader.pid, signal.SIGKILL)
        reader.wait()
    busy, held = map(int, acquirer.stdout.split())
    # Without the retry in hold(), thousands of these met the reader's shared lock (LockBusy).
    assert held > 200 and busy == 0, (busy, held)


@pytest.mark.parametrize("where", ["file-as-dir", "proc"])
def test_a_lock_that_cannot_be_created_is_one_clear_line(tmp_path, where):
    # As root, chmod stops nothing: a file where the lock directory belongs, or /proc (where
    # nobody can create files), gives the real OSError a non-root cutover gets.
    if where == "file-as-dir":
        (tmp_path / "locks").write_text("not a directory\n")
        path = tmp_path / "locks" / "i1.lock"
    else:
        path = Path("/proc/self/gemma4-appliance-i1.lock")
    with pytest.raises(lock.LockUnavailable) as err, lock.hold(path, "i1", "cutover to x:1"):
        pass
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot open the cutover lock {path}: ")
    assert f"cutover and rollback need root, or write access to {path.parent}" in msg
    assert err.value.exit_code == 1
