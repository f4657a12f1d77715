"""Real systemd for the ``systemd`` tier: a Debian bookworm rootfs booted with systemd-nspawn.

The host's PID 1 is not systemd here, so unit files are tested inside a container that boots
real systemd 252 (``systemd-nspawn --register=no --keep-unit -b``), sharing the host's network
namespace (a port published on 127.0.0.1 by a container is reachable from the tests) and bound
to the HOST's Docker engine (its socket, and the host's static docker client as
``/usr/bin/docker``): a unit that runs ``docker run`` inside starts its container on the host's
dockerd, next to the images the docker tier built.

API (for tests):

- ``ensure_rootfs(packages=()) -> Path``: the pristine rootfs (a minbase bookworm with
  systemd, systemd-sysv, dbus, openssh-server, python3, ...[, packages], made by
  ``appliance.images.base.bootstrap``), cached per machine
  under ``/var/cache/gemma4-appliance/nspawn/`` (first time 20-60 s, ~230 MB; one builder at a
  time, the others wait and reuse it). D-Bus, logind, sshd, node_exporter and the console getty
  are masked (see ``MASKED_UNITS``): boot to "running" then takes about a second on an idle host,
  poweroff as long as its units take to stop.
- ``boot(name, binds=(), docker=True, docker_stub_unit=True, packages=(), unmask=()) -> Machine``
  (a context manager): mounts an overlay on the rootfs (writes go to a temporary folder), boots
  it, waits until systemd is up, and powers it off (then unmounts and deletes the folder) on
  exit.
- ``Machine``: ``root`` (the container's / as a host path: write files there, e.g. with
  ``m.write("/etc/systemd/system/x.service", text)``), ``run(*argv)`` (runs a command inside, in
  all the container's namespaces, via nsenter: no machined needed), ``systemctl(*args)``,
  ``journal(unit, lines)``, ``wait_active(unit, timeout)``, ``daemon_reload()``, ``log_path``
  (the boot console), ``poweroff()``.

``docker_stub_unit`` installs ``/etc/systemd/system/docker.service``, a oneshot that stays
"active": units may ``Requires=docker.service`` as on a real host, while the engine they talk
to is the host's (bound in), not one inside the container.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.images import base
from appliance.images.files import held

from .docker_engine import machine_lock

# One rootfs for every machine: the fleet's hosts need sshd and a Python for Ansible, the bare
# host (tests/test_bare_host_systemd.py) Debian's venv and node_exporter; the others boot the
# same tree with those services masked (one bootstrap per machine, not one per variant).
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "prometheus-node-exporter",
)
CACHE = Path(os.environ.get("APPLIANCE_SYSTEM_CACHE", "/var/cache/gemma4-appliance")) / "nspawn"
DOCKER_SOCKET = Path("/var/run/docker.sock")


# The trees an install writes to (Machine.files), and what the machine's own life changes
# there (journals, systemd's timestamps, apt's and Python's caches): not the appliance's doing.
COMPARED_TREES = ("etc", "usr/local", "var/lib")
UNRELATED = ("var/lib/systemd/", "var/log/", "var/cache/", "var/lib/private/")


def vllm_cache_dir(fixture: str) -> Path:
    """The vLLM compile cache of one fixture's engines, kept across runs on this machine. One
    per fixture: engines of the same image and profile started at once by two fixtures (the
    two streams run side by side) would write one compile directory."""
    return CACHE.parent / "vllm-cache" / fixture


MASKED_UNITS = (
    "console-getty.service",
    "dbus.service",
    "dbus.socket",
    "systemd-logind.service",
    "ssh.service",
    "prometheus-node-exporter.service",
)

DOCKER_STUB_UNIT = """\
# Stand-in written by tests/plugins/nspawn.py: the Docker engine these units use is the HOST's,
# bound in at /run/docker.sock. This unit only lets `Requires=docker.service` resolve here.
[Unit]
Description=Docker Application Container Engine (host engine, bound in)

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/bin/docker version --format {{.Server.Version}}

[Install]
WantedBy=multi-user.target
"""


class NspawnError(RuntimeError):
    """The container could not be made, booted or reached."""


def ensure_rootfs(packages: Sequence[str] = ()) -> Path:
    """The pristine systemd rootfs with ``packages`` added, made once per machine."""
    include = sorted({*BASE_PACKAGES, *packages})
    extra = [p for p in include if p not in BASE_PACKAGES]
    # v5: made by mmdebstrap; bump it when the rootfs recipe changes.
    root = CACHE / "-".join([base.SUITE, *extra, "systemd-v5"])
    if (root / ".complete").exists():
        return root
    if shutil.which("systemd-nspawn") is None:
        raise NspawnError("needs systemd-container: run scripts/setup-system.sh")
    CACHE.mkdir(parents=True, exist_ok=True)
    # Two pytest processes and the prefetch (tests/prefetch.py) may all want it at once.
    with held(CACHE / "rootfs.lock"):
        if not (root / ".complete").exists():
            _bootstrap(root, include)
    return root


def _bootstrap(root: Path, include: list[str]) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=CACHE))
    staging.chmod(0o755)  # the machines' "/" (mkdtemp makes it 0700)
    try:
        try:
            base.bootstrap(staging, include)  # the CPU images' base is made the same way
        except ApplianceError as exc:
            raise NspawnError(str(exc)) from None
        # Masked: a login prompt on a console nobody reads; and D-Bus, which cannot set up
        # inotify or its fd limit in this sandbox and then holds boot ~90 s waiting for systemd
        # (logind needs it). Nothing the tests use needs the bus: systemctl as root talks to
        # systemd's private socket. sshd: only the fleet's hosts run it (boot(unmask=...)), and
        # node_exporter only the bare host.
        for unit in MASKED_UNITS:
            (staging / "etc/systemd/system" / unit).symlink_to("/dev/null")
        (staging / ".complete").write_text(" ".join(include) + "\n")
        if root.exists():  # a run killed half-way
            shutil.rmtree(root)
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _docker_client_binary() -> Path:
    """A static docker client to bind in (the rootfs has no libraries for a dynamic one)."""
    for cand in ("/usr/local/bin/docker", shutil.which("docker") or "", "/usr/bin/docker"):
        if cand and Path(cand).exists():
            return Path(cand)
    raise NspawnError("no docker client on the host")


@dataclass
class Machine:
    """A booted container (see the module docstring)."""

    name: str
    root: Path
    process: subprocess.Popen
    log_path: Path

    def enter_argv(self) -> list[str]:
        """The command prefix running a program inside the machine (namespaces, root, clean env)."""
        return [
            "nsenter",
            "--target",
            str(self.leader()),
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--root",
            "--wd",
            "--",
            "/usr/bin/env",
            "-i",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "SYSTEMD_PAGER=",
            "SYSTEMD_COLORS=0",
        ]

    def leader(self) -> int:
        """The host PID of the container's PID 1 (systemd)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.process.pid:
                return int(entry.name)
        raise NspawnError(f"{self.name}: no container init found (log: {self.log_path})")

    def run(
        self, *argv: str, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the container (all its namespaces, its root), capture output."""
        cmd = [*self.enter_argv(), *argv]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, input=input, check=False
        )
        if check and proc.returncode != 0:
            raise NspawnError(
                f"{self.name}: {' '.join(argv)} exited {proc.returncode}:\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        return proc

    def systemctl(self, *args: str, check: bool = True, timeout: float = 120):
        return self.run("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def journal(self, unit: str | None = None, lines: int = 50) -> str:
        args = ["journalctl", "--no-pager", "-n", str(lines)]
        if unit:
            args += ["-u", unit]
        return self.run(*args, check=False).stdout

    def is_active(self, unit: str) -> str:
        return self.systemctl("is-active", unit, check=False).stdout.strip()

    def wait_active(self, unit: str, timeout: float = 60) -> None:
        """Wait until ``unit`` is active; raise with its journal if it fails or times out."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.is_active(unit)
            if state == "active":
                return
            if state == "failed":
                break
            time.sleep(0.5)
        raise NspawnError(f"{unit} is {state!r}:\n{self.journal(unit)}")

    def tree_env(self) -> dict[str, str]:
        """What names the machine's own systemd and Docker to a command run from the host with
        ``--root`` at the machine's root (appliance/host/reach.py): its systemd, entered, and
        the Docker bound into it (the host's engine)."""
        return {
            "APPLIANCE_SYSTEMD_PREFIX": shlex.join(self.enter_argv()),
            "DOCKER_HOST": f"unix://{DOCKER_SOCKET}",
        }

    def files(self) -> set[str]:
        """Every path under the machine's /etc, /usr/local and /var/lib (type-tagged, so a file
        replaced by a link shows), less what the machine's own life changes there."""
        out = set()
        for tree in COMPARED_TREES:
            for path in (self.root / tree).rglob("*"):
                rel = str(path.relative_to(self.root))
                if rel.startswith(UNRELATED) or "__pycache__" in rel:
                    continue
                kind = "l" if path.is_symlink() else "d" if path.is_dir() else "f"
                out.add(f"{kind} {rel}")
        return out

    def compare(self, before: set[str]) -> tuple[list[str], list[str]]:
        """What :meth:`files` has now that ``before`` had not, and what it lost."""
        after = self.files()
        return sorted(after - before), sorted(before - after)

    def write(self, path: str, text: str, mode: int = 0o644) -> Path:
        """Write a file at container path ``path`` (from the host, atomically)."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        tmp.replace(target)
        return target

    def wait_booted(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NspawnError(
                    f"{self.name} exited at boot:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                state = self.systemctl("is-system-running", check=False, timeout=10).stdout.strip()
            except (NspawnError, subprocess.TimeoutExpired):
                state = "no init yet"
            if state in ("running", "degraded"):
                return
            time.sleep(0.3)
        raise NspawnError(f"{self.name} not booted after {timeout:.0f}s (state {state!r})")

    def poweroff(self, timeout: float = 90) -> None:
        """Shut systemd down cleanly (units' ExecStop run), then make sure nspawn is gone."""
        if self.process.poll() is not None:
            return
        # SIGTERM to nspawn makes it send the container's init its shutdown signal.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


@contextlib.contextmanager
def boot(
    name: str,
    binds: Sequence[tuple[str, str]] = (),
    docker: bool = True,
    docker_stub_unit: bool = True,
    packages: Sequence[str] = (),
    boot_timeout: float = 90,
    unmask: Sequence[str] = (),
) -> Iterator[Machine]:
    """Boot a fresh overlay on the cached rootfs (``unmask``: masked units this machine runs);
    power it off and delete the overlay afterwards. A machine's name is fixed by its test (and
    names what runs in it): a second run on this host waits for the first to power it off."""
    with machine_lock(f"machine-{name}"), _fresh_tree(name, ensure_rootfs(packages)) as workdir:
        yield from _boot(workdir, name, binds, docker, docker_stub_unit, boot_timeout, unmask)


@contextlib.contextmanager
def _fresh_tree(name: str, pristine: Path) -> Iterator[Path]:
    """A folder whose ``root`` is a writable overlay on the pristine tree, for one boot; the
    overlay is unmounted and the folder deleted afterwards, whatever happened."""
    workdir = Path(tempfile.mkdtemp(prefix=f"nspawn-{name}-", dir=CACHE))
    try:
        # An overlay, not a copy: `cp -a` of the tree's 11,000 files cost 5-11 s of the
        # kernel's CPU a boot on ext4 (no reflinks there), about as much as the boot itself.
        # Writes land in upper/ and go with the folder; the pristine tree is never written.
        for folder in ("root", "upper", "work"):
            (workdir / folder).mkdir()
        layers = f"lowerdir={pristine},upperdir={workdir / 'upper'},workdir={workdir / 'work'}"
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", layers, str(workdir / "root")], check=True
        )
        try:
            yield workdir
        finally:
            # Lazy: a host process still holding a file of the tree must not keep it mounted.
            subprocess.run(["umount", "--lazy", str(workdir / "root")], check=False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _boot(
    workdir: Path,
    name: str,
    binds: Sequence[tuple[str, str]],
    docker: bool,
    docker_stub_unit: bool,
    boot_timeout: float,
    unmask: Sequence[str],
) -> Iterator[Machine]:
    root = workdir / "root"
    (root / ".complete").unlink(missing_ok=True)
    # "/" as on a real host: the rootfs was built in a mkdtemp (0700), and a service of a
    # non-root user (DynamicUser=) could not even chdir to "/" (exit 200/CHDIR).
    root.chmod(0o755)
    for unit in unmask:
        (root / "etc/systemd/system" / unit).unlink()
    cmd = [
        "systemd-nspawn",
        "--quiet",
        "--register=no",
        "--keep-unit",
        "-b",
        "-D",
        str(root),
        "-M",
        name,
        "--console=read-only",
    ]
    if docker:
        if not DOCKER_SOCKET.exists():
            raise NspawnError("the host's Docker engine is not running (docker_engine fixture)")
        cmd += [
            f"--bind={DOCKER_SOCKET.resolve()}:/run/docker.sock",
            f"--bind-ro={_docker_client_binary()}:/usr/bin/docker",
        ]
        if docker_stub_unit:
            unit = root / "etc/systemd/system/docker.service"
            unit.write_text(DOCKER_STUB_UNIT)
            wants = root / "etc/systemd/system/multi-user.target.wants"
            wants.mkdir(parents=True, exist_ok=True)
            (wants / "docker.service").symlink_to("/etc/systemd/system/docker.service")
    for src, dst in binds:
        cmd.append(f"--bind={src}:{dst}")
    log_path = workdir / "console.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    machine = Machine(name, root, proc, log_path)
    try:
        machine.wait_booted(boot_timeout)
        yield machine
    finally:
        machine.poweroff()
