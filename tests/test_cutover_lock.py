"""The per-instance lock, between real processes: one holder, a clear error, freed on death."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from subprocess import PIPE

import pytest

from appliance.host import lock

_HOLDER = """
import sys, time
from pathlib import Path
from appliance.host import lock
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
from appliance.host import lock
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
from appliance.host import lock
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


# Holds a shared flock on the lock file for as long as it lives, the way any process that can
# open the file can: `flock -s` in a user's shell would do the same.
_SQUATTER = """
import fcntl, sys, time
try:
    f = open(sys.argv[1])
except PermissionError:
    print("refused", flush=True)
    sys.exit(0)
fcntl.flock(f, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(600)
"""


def _squatter(path: Path, *user: str) -> tuple[subprocess.Popen, str]:
    # The system python: another user may not enter the venv's home.
    proc = subprocess.Popen([*user, "/usr/bin/python3", "-c", _SQUATTER, str(path)], stdout=PIPE)
    return proc, proc.stdout.readline().decode().strip()


@pytest.fixture
def state_dir():
    """A state directory other users may enter, like /var/lib/gemma4-appliance (0755)."""
    d = Path(tempfile.mkdtemp(prefix="appliance-state-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_another_user_cannot_open_the_lock_and_keep_cutovers_busy(state_dir):
    path = state_dir / "locks" / "i1.lock"
    with lock.hold(path, "i1", "cutover to x:1"):
        pass
    nobody = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
    proc, said = _squatter(path, *nobody)
    try:
        assert said == "refused"  # else its shared flock makes the rollback below busy
        with lock.hold(path, "i1", "rollback"):
            pass
    finally:
        proc.kill()
        proc.wait()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_lock_made_by_an_older_appliance_is_tightened(state_dir):
    path = state_dir / "locks" / "i1.lock"
    path.parent.mkdir(mode=0o755)
    path.touch(mode=0o644)
    with lock.hold(path, "i1", "cutover to x:1"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_holder_that_never_wrote_is_unknown_not_the_last_writers_dead_pid(tmp_path):
    path = tmp_path / "locks" / "i1.lock"
    gone = _holder(path)  # writes its pid and action, then dies
    os.kill(gone.pid, signal.SIGKILL)
    gone.wait()
    proc, said = _squatter(path)
    try:
        assert said == "held"
        with pytest.raises(lock.LockBusy) as err, lock.hold(path, "i1", "rollback"):
            pass
        assert str(err.value) == (
            "instance i1 is busy: a cutover or rollback is in progress (an unknown process) "
            "(wait for it to finish, then check `appliance status`)"
        )
    finally:
        proc.kill()
        proc.wait()


_PURGE = """
import sys
from pathlib import Path
from appliance import units
units.uninstall("a1", root=Path(sys.argv[1]), purge=True)
"""


def test_a_purge_keeps_the_lock_it_holds_until_it_has_released_it(tmp_path):
    """`uninstall --purge` holds the instance's lock while it removes its files (review S10).
    A rollback started meanwhile must be busy, not take a fresh file's lock and run beside it.

    The purge is held inside its locked part for real: the other instance's env file is a FIFO,
    which the purge reads (for the scrape targets) until this test writes it; opening the FIFO
    for writing returns only once the purge has opened it."""
    from appliance import units
    from appliance.host.layout import Layout

    layout = Layout(tmp_path)
    for name, port in (("a1", 18301), ("b1", 18302)):
        units.install("cpu-tiny-mtp", name, root=tmp_path, options=units.Options(port=port))
    path = layout.lock_file("a1")
    with lock.hold(path, "a1", "cutover to x:1"):  # a cutover ran once: the file is there
        pass
    other = layout.env_file("b1")
    content = other.read_bytes()
    other.unlink()
    os.mkfifo(other)
    purge = subprocess.Popen(
        [sys.executable, "-c", _PURGE, str(tmp_path)], cwd=Path(__file__).resolve().parents[1]
    )
    try:
        with open(other, "wb") as fifo:
            with pytest.raises(lock.LockBusy), lock.hold(path, "a1", "rollback"):
                pass
            fifo.write(content)
        assert purge.wait(timeout=120) == 0
    finally:
        purge.kill()
        purge.wait()
    assert not path.exists()  # the purge still leaves no lock behind


_INSTALL = """
import sys
from pathlib import Path
from appliance import units
units.install("cpu-tiny-mtp", "a1", root=Path(sys.argv[1]), options=units.Options(port=18301))
"""


def test_an_install_holds_the_lock_where_no_cutover_ever_ran(tmp_path):
    """A first cutover of a1 starting while a re-install writes a1's files must be busy: it
    would read the env file before the write and write its old values back. Before, an install
    locked only where a cutover had once left the lock file.

    Held inside its locked part for real, as the purge above: a1's args file is a FIFO, which
    the install reads (is it unchanged?) while it writes a1's files."""
    from appliance import units
    from appliance.host.layout import Layout

    layout = Layout(tmp_path)
    units.install("cpu-tiny-mtp", "a1", root=tmp_path, options=units.Options(port=18301))
    path = layout.lock_file("a1")
    # As an older appliance's install left it, where no cutover of a1 ever ran.
    path.unlink(missing_ok=True)
    args = layout.args_file("a1")
    content = args.read_bytes()
    args.unlink()
    os.mkfifo(args)
    install = subprocess.Popen(
        [sys.executable, "-c", _INSTALL, str(tmp_path)], cwd=Path(__file__).resolve().parents[1]
    )
    try:
        with open(args, "wb") as fifo:
            with pytest.raises(lock.LockBusy) as busy, lock.hold(path, "a1", "cutover to x:1"):
                pass
            assert f"pid {install.pid}, install" in str(busy.value)
            fifo.write(content)
        assert install.wait(timeout=120) == 0
    finally:
        install.kill()
        install.wait()


def test_an_install_planned_before_a_cutover_ended_writes_nothing(tmp_path):
    """The plan reads the env file's values (VLLM_IMAGE among them) before the lock is taken;
    a cutover that ends in between moved the image, and the install would move it back. The
    cutover here is its own env-file write (the target's read, ``with_image``, ``write``),
    under the lock, while the install's preflight runs."""
    from appliance import units
    from appliance.cutover.target import InstanceTarget
    from appliance.host.layout import Layout
    from appliance.instance import installer
    from appliance.units.instance import read as read_instance

    layout = Layout(tmp_path)
    installer.install("cpu-tiny-mtp", "a1", root=tmp_path, options=units.Options(port=18301))
    moved: list[bytes] = []

    def a_cutover_ends(_plan) -> None:
        tgt = InstanceTarget(read_instance(tmp_path, "a1"), tmp_path)
        with lock.hold(layout.lock_file("a1"), "a1", "cutover to gemma4-vllm:next"):
            moved.append(tgt.read().with_image("gemma4-vllm:next"))
            tgt.write(moved[-1])

    with pytest.raises(lock.LockBusy, match="changed while this install was planned"):
        installer.install(
            "cpu-tiny-mtp",
            "a1",
            root=tmp_path,
            options=units.Options(port=18302),  # a change to write
            preflight=a_cutover_ends,
        )
    assert layout.env_file("a1").read_bytes() == moved[0]  # the cutover's, and only that
