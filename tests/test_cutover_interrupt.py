"""A cutover never strands an instance: signals, a kill, and an image pinned behind its back.

Real processes under real systemd (the session's one nspawn machine and instance,
tests/plugins/systemd_instance.py). The cutover is the real CLI, started on a pseudo-terminal
that is its controlling terminal, as in an operator's SSH session: Ctrl-C is the ^C byte typed
into it (the kernel's line discipline sends SIGINT), the hang-up is the terminal going away (the
kernel sends SIGHUP, and every later write to it fails), SIGTERM is sent to its PID.

Each signal costs about one engine start (the way back; the new image's start is cut short). The
target is the MTP image with its MTP label off (the same vLLM, no 9 GB pre-MTP image to wait for):
what is interrupted is the restart and the gates, whatever the image.

SIGTERM is not sent here end to end: the flow has one way back for every signal (it catches the
guard's ``Interrupted``, whatever its name), and tests/test_cutover_signals.py shows the guard
turning a real SIGTERM, like SIGINT and SIGHUP, into ``Interrupted``. The two sent here are the
ones a terminal adds to: the ^C byte, and the hang-up after which every write fails.
"""

from __future__ import annotations

import os
import pty
import select
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
from plugins.systemd_instance import MTP_IMAGE, REPO, SystemdInstance
from plugins.traffic import Traffic

from appliance.cutover import history
from appliance.engine_api import specdecode
from appliance.host.layout import Layout

pytestmark = [pytest.mark.systemd, pytest.mark.docker, pytest.mark.engine]

TIMEOUT = "600"
# The cutover the signal tests interrupt: MTP image -> the same image with MTP off, no canary (the
# signal lands in the gates, not in the canary's recording).
MOVE = ("--allow-no-mtp", "--no-canary", "--timeout", TIMEOUT)


def _history(inst: SystemdInstance) -> list[history.Entry]:
    return history.entries(Layout(inst.root).history_file(inst.instance))


def _serves(inst: SystemdInstance, image: str, speculative: bool) -> None:
    """The running container is ``image``, it answers a chat, with or without MTP counters."""
    assert inst.container_image() == image
    resp = inst.chat("after the interruption", max_tokens=8)
    assert resp.status_code == 200, resp.text
    assert specdecode.parse(inst.metrics()).speculative is speculative


# Runs ARGV in a new session whose controlling terminal is the pty on fd 0 (same PID: exec).
IN_SESSION = (
    "import fcntl, os, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


class TerminalCutover:
    """``appliance cutover`` running in its own session on a pseudo-terminal."""

    def __init__(self, inst: SystemdInstance, *args: str) -> None:
        argv, env = inst.appliance_argv("cutover", inst.instance, *args)
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", IN_SESSION, *argv],
            env=env,
            cwd=REPO,
            stdin=slave,
            stdout=slave,
            stderr=slave,
        )
        os.close(slave)
        self.out = bytearray()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the child side is closed
                return
            if not chunk:
                return
            self.out += chunk

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def wait_for(self, needle: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert self.proc.poll() is None, f"cutover exited {self.proc.returncode}:\n{self.text}"
            assert time.monotonic() < deadline, f"never saw {needle!r}:\n{self.text}"
            time.sleep(0.1)

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def hang_up(self) -> None:
        """Close the terminal: the kernel sends SIGHUP to the session; writes now fail."""
        self._stop.set()
        self._reader.join()
        os.close(self.master)
        self.master = -1

    def wait(self, timeout: float = 900) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._stop.set()
        self._reader.join()
        if self.master >= 0:
            # What was still buffered in the terminal.
            while select.select([self.master], [], [], 0)[0]:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                self.out += chunk
            os.close(self.master)
            self.master = -1
        return rc


def _in_the_gates(
    inst: SystemdInstance, cut: TerminalCutover, invocation: str, passed: tuple[str, ...] = ()
) -> None:
    """Wait until the env file was written and systemd has the restart (the unit is mid-way),
    then until each gate in ``passed`` printed its ``ok`` line."""
    cut.wait_for("restarting")
    deadline = time.monotonic() + 60
    while inst.show("InvocationID") == invocation and inst.show("ActiveState") == "active":
        assert time.monotonic() < deadline, "the cutover never restarted the unit"
        time.sleep(0.2)
    for gate in passed:
        cut.wait_for(f"] {gate}: ok (")


@pytest.fixture
def off_image(canary_images) -> str:
    """The MTP image with its MTP label off: where the interrupted cutovers were going."""
    return canary_images["label-off"]


# The gates of the interrupted cutover, in order.
GATES = ["unit", "image", "health", "model", "generation", "mtp"]


# Signalled as soon as the unit leaves `active` (in the restart or the unit gate: a probe in
# flight, health while its engine starts), or once every gate before the canary passed: the new
# image's container serves and the signal lands in the canary's prompts.
@pytest.mark.parametrize(
    ("how", "name", "passed"),
    [
        ("ctrl-c", "SIGINT", ()),
        ("hang-up", "SIGHUP", ()),
        # Every HTTP gate passed: the signal lands in the canary's prompts (seconds), not in
        # the instant the health, model and generation probes take (a SIGINT sent once `image`
        # passed arrived after the last gate on a quiet host, too late to matter).
        ("ctrl-c", "SIGINT", tuple(GATES)),
    ],
    ids=["ctrl-c", "hang-up", "ctrl-c-after-unit"],
)
def test_a_signal_during_the_gates_rolls_back(systemd_instance, off_image, how, name, passed):
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    layout = Layout(inst.root)
    env_before = inst.env_path.read_bytes()
    slot = layout.rollback_slot(inst.instance)
    slot_before = slot.read_bytes() if slot.exists() else None
    invocation, count = inst.show("InvocationID"), len(_history(inst))

    move = tuple(a for a in MOVE if a != "--no-canary") if passed else MOVE
    cut = TerminalCutover(inst, off_image, *move)
    _in_the_gates(inst, cut, invocation, passed)
    new_env = inst.env_path.read_bytes()
    assert f"VLLM_IMAGE={off_image}".encode() in new_env  # really mid-cutover
    if how == "ctrl-c":
        cut.ctrl_c()
    else:
        cut.hang_up()
    rc = cut.wait()
    print(cut.text)

    # Back where it was: the env file byte-identical, the old image running and gated.
    assert inst.env_path.read_bytes() == env_before
    e = _history(inst)[-1]
    assert len(_history(inst)) == count + 1
    assert (e.kind, e.outcome, e.interrupted) == ("cutover", "rolled_back", name)
    assert (e.from_image, e.to_image) == (MTP_IMAGE, off_image)
    assert e.gates[-1].name == "interrupted" and not e.gates[-1].ok
    # Before it, the gates that passed, in order: at least those seen passing before the signal.
    recorded = [g.name for g in e.gates[:-1]]
    assert recorded == GATES[: len(recorded)] and all(g.ok for g in e.gates[:-1]), e.gates
    assert recorded[: len(passed)] == list(passed), e.gates
    assert e.rollback_gates and all(g.ok for g in e.rollback_gates)
    assert [g.name for g in e.rollback_gates][:2] == ["unit", "image"]
    assert f"interrupted by {name} during the gates of {off_image}" in e.error
    assert rc == 1, cut.text
    assert inst.machine.is_active(inst.unit) == "active"
    _serves(inst, MTP_IMAGE, speculative=True)
    assert (slot.read_bytes() if slot.exists() else None) == slot_before
    assert not layout.saved_env(inst.instance).exists()
    if how != "hang-up":  # after a hang-up nobody reads the terminal any more
        assert f"rolled back to {MTP_IMAGE}, which passed the gates and is serving" in cut.text
    s = inst.appliance("status", inst.instance)
    assert "INTERRUPTED" not in s.stdout and f"running:    {MTP_IMAGE}" in s.stdout
    h = inst.appliance("history", inst.instance)
    assert f"interrupted by {name}" in h.stdout


@pytest.mark.traffic
def test_a_killed_cutover_status_names_its_state_and_the_recovery_command(
    systemd_instance, off_image
):
    """SIGKILL (or power loss) cannot be caught: status reads what the cutover wrote and prints
    the one command; that command brings the instance back, gated."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    layout = Layout(inst.root)
    env_before = inst.env_path.read_bytes()
    # No rollback target yet (as on an instance's first cutover): after the recovery, a second
    # `appliance rollback` then has nothing to do and must say so, not restart anything.
    slot = layout.rollback_slot(inst.instance)
    slot.unlink(missing_ok=True)
    invocation, count = inst.show("InvocationID"), len(_history(inst))

    # Clients call the instance from before the cutover to after the recovery: the cutover's
    # restart, its kill and the rollback's restart keep every request whole or refused.
    with Traffic(inst.url, inst.api_key, label="killed cutover, appliance rollback") as traffic:
        cut = TerminalCutover(inst, off_image, *MOVE)
        _in_the_gates(inst, cut, invocation)
        os.kill(cut.proc.pid, signal.SIGKILL)
        assert cut.wait(timeout=30) == -signal.SIGKILL
        new_env = env_before.replace(
            f"VLLM_IMAGE={MTP_IMAGE}".encode(), f"VLLM_IMAGE={off_image}".encode()
        )
        assert inst.env_path.read_bytes() == new_env

        s = inst.appliance("status", inst.instance)
        assert s.stderr == "", s.stderr  # exit 0 or 1: serving or not, as the kill left it
        print(s.stdout)
        assert (
            f"INTERRUPTED cutover {MTP_IMAGE} -> {off_image} (pid {cut.proc.pid} was killed); "
            f"env file is the new: the env file names {off_image} (the cutover's target, "
            "never gated); "
        ) in s.stdout
        recover = next(ln for ln in s.stdout.splitlines() if ln.startswith("  recover:"))
        command = recover.split(":", 1)[1].strip()
        assert command == f"appliance rollback {inst.instance} --root {inst.root}"
        assert f"returns to {MTP_IMAGE} through the gates; writes back" in s.stdout
        assert _history(inst)[-1].outcome == "interrupted"

        argv = shlex.split(command)
        assert argv[0] == "appliance"
        r = inst.appliance(*argv[1:])
        traffic.wait_back()
    print(r.stderr)
    assert r.returncode == 0, r.stderr
    assert (broke := traffic.report.promise(down=True, back=True)) is None, broke
    assert f"recovered the interrupted cutover ({MTP_IMAGE} -> {off_image})" in r.stdout
    assert inst.env_path.read_bytes() == env_before
    _serves(inst, MTP_IMAGE, speculative=True)
    entries = _history(inst)
    assert len(entries) == count + 1  # the killed entry is closed, not a new one
    e = entries[-1]
    assert (e.outcome, e.interrupted, e.from_image) == ("rolled_back", "killed", MTP_IMAGE)
    assert e.rollback_gates and all(g.ok for g in e.rollback_gates)
    assert f"was killed; recovered by `{command}`: on {MTP_IMAGE}" in e.error
    assert not slot.exists()  # as it was before the killed cutover
    assert not layout.saved_env(inst.instance).exists()
    s = inst.appliance("status", inst.instance)
    assert s.returncode == 0, s.stdout  # serving again
    assert "INTERRUPTED" not in s.stdout and "recover:" not in s.stdout
    # Nothing left to recover: a second run says so instead of restarting anything.
    invocation = inst.show("InvocationID")
    again = inst.appliance("rollback", inst.instance)
    assert again.returncode == 1, again.stdout + again.stderr  # a refusal
    assert f"instance {inst.instance} has no rollback target" in again.stderr
    assert again.stdout == "" and inst.show("InvocationID") == invocation
    assert len(_history(inst)) == count + 1


PIN = "/etc/gemma4-vllm/systest.pin"
DROP_IN = "/etc/systemd/system/gemma4-vllm@systest.service.d/pin.conf"


@pytest.fixture
def pinned(systemd_instance):
    """A drop-in adding a second env file that pins the MTP image (read last, so it wins)."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    inst.machine.write(PIN, f"VLLM_IMAGE={MTP_IMAGE}\n")
    inst.machine.write(DROP_IN, f"[Service]\nEnvironmentFile={PIN}\n")
    inst.machine.daemon_reload()
    try:
        yield inst
    finally:
        (inst.root / DROP_IN.lstrip("/")).unlink(missing_ok=True)
        (inst.root / PIN.lstrip("/")).unlink(missing_ok=True)
        inst.machine.daemon_reload()


def test_preflight_refuses_a_drop_in_that_pins_the_image(pinned, canary_images):
    inst = pinned
    target = canary_images["label-off"]  # the same engine, vLLM 0.32: every other gate passes
    env_before, count = inst.env_path.read_bytes(), len(_history(inst))
    invocation = inst.show("InvocationID")
    r = inst.appliance("cutover", inst.instance, target, "--allow-no-mtp", "--no-canary")
    assert r.returncode == 1, r.stderr
    assert f"{inst.unit} may not run the image systest.env names" in r.stderr
    assert f"{PIN} sets VLLM_IMAGE={MTP_IMAGE}" in r.stderr
    assert "--allow-unit-overrides" in r.stderr
    assert inst.env_path.read_bytes() == env_before and len(_history(inst)) == count
    assert inst.show("InvocationID") == invocation


def test_the_running_image_gate_rolls_back_what_a_drop_in_keeps_running(pinned, canary_images):
    """Told to go ahead, the cutover restarts; the drop-in keeps the old image running, with the
    same vLLM version and a working engine, so only the running-image gate can tell."""
    inst = pinned
    target = canary_images["label-off"]
    env_before = inst.env_path.read_bytes()
    s = inst.appliance("status", inst.instance)
    assert f"running:    {MTP_IMAGE}" in s.stdout and "MISMATCH" not in s.stdout
    r = inst.appliance(
        "cutover",
        inst.instance,
        target,
        "--allow-no-mtp",
        "--no-canary",
        "--allow-unit-overrides",
        "--timeout",
        TIMEOUT,
    )
    print(r.stderr)
    assert r.returncode == 1, r.stderr
    assert f"warning: {inst.unit} reads 2 EnvironmentFile(s)" in r.stderr
    assert f"{target} failed gate 'image': container {inst.container} runs image" in r.stderr
    e = _history(inst)[-1]
    assert (e.outcome, e.to_image) == ("rolled_back", target)
    assert [g.name for g in e.gates] == ["unit", "image"] and not e.gates[-1].ok
    assert inst.env_path.read_bytes() == env_before
    _serves(inst, MTP_IMAGE, speculative=True)


def test_status_flags_a_running_image_that_is_not_the_env_files(pinned, canary_images):
    """The env file names one image, the container runs another (what the raw path with an
    override leaves): status shows both and flags it. No restart: only the file changes."""
    inst = pinned
    env_before = inst.env_path.read_bytes()
    try:
        inst.set_image(canary_images["label-off"])
        s = inst.appliance("status", inst.instance)
        assert f"image:      {canary_images['label-off']}" in s.stdout
        # The running image's tags (another run may have given it more), then its short ID.
        [running] = [ln for ln in s.stdout.splitlines() if ln.startswith("  running:")]
        tags = running.removeprefix("  running:").split("(")[0].split(",")
        assert MTP_IMAGE in [t.strip() for t in tags], running
        assert "MISMATCH: not the env file's image" in s.stdout
    finally:
        inst.env_path.write_bytes(env_before)
