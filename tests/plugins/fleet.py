"""A fleet of two real hosts for the ``fleet`` tier: systemd machines reached by Ansible over SSH.

Each host is a systemd-nspawn machine (tests/plugins/nspawn.py: real systemd 252, the host's
Docker engine bound in) of the suite's one rootfs, with its ``openssh-server`` unmasked. The
machines share the host's network namespace, so each sshd listens on its own 127.0.0.1 port
(``Port``/``ListenAddress`` in ``/etc/ssh/sshd_config.d/fleet.conf``), with a host key of its
own and key-only root login. All of that is one directory per host bound at
``/etc/ssh/sshd_config.d`` at boot: sshd never listens on port 22 of the host, and two machines
copied from one rootfs do not share a host key. Both machines boot in parallel.

The appliance reaches the hosts by a bind, not by the role's wheelhouse install: the repository
(with its ``.venv``) and the venv's base Python are bound in at the same paths, and the inventory
says ``appliance_install_from: present``. A wheelhouse of the appliance's dependencies would need
the internet at test time (or ~200 MB more built at setup), and the bind runs the exact code
under test. The role still links ``/usr/local/bin/appliance`` and checks the version.

Each host serves its own instance of ``cpu-tiny-mtp`` (``fleet-a``, ``fleet-b``: the hosts share
one dockerd, so container names must differ), on the images the docker tier builds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance import __version__, units
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.host import envfile
from appliance.host.layout import Layout

from . import nspawn
from .docker_engine import CANARY_TEST_REPO, NO_MTP_TAG, inspect_container, machine_lock
from .systemd_instance import MTP_IMAGE, PROFILE

VLLM_CACHE = nspawn.vllm_cache_dir("fleet")

# The hosts start with MTP off and roll out to MTP on: the MTP image with its MTP label off (the
# same engine, started in about half the time of the real vLLM 0.19 image). The rollout from
# 0.19 itself is the seed's replay under systemd (tests/test_cutover_systemd.py).
OFF_IMAGE = f"{CANARY_TEST_REPO}:{NO_MTP_TAG}"

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "deploy" / "ansible"
VENV_BIN = Path(sys.executable).parent
SSHD = ("ssh.service",)  # masked in the suite's rootfs; these hosts run it
HOSTS = (("fleet-a", "gemma4-fleet-a"), ("fleet-b", "gemma4-fleet-b"))  # (instance, machine)
RECAP = re.compile(r"^(\S+)\s+:\s+(ok=\d+\s.*)$")  # host : ok=N changed=N ... ignored=N


@dataclass
class FleetHost:
    """One host: its inventory name, instance, machine and ports."""

    name: str
    instance: str
    machine: nspawn.Machine
    ssh_port: int
    vllm_port: int

    @property
    def root(self) -> Path:
        return self.machine.root

    def env_image(self) -> str | None:
        return envfile.read(Layout(self.root).env_file(self.instance)).get(envfile.IMAGE_KEY)

    def container(self, fmt: str = "{{.Config.Image}}") -> str:
        """``docker inspect`` of the instance's container; raises when it cannot be read (no
        such container included), so two failed reads never compare equal."""
        return inspect_container(units.container_name(self.instance), fmt)

    def history(self) -> list[dict]:
        """The instance's cutover history as stored (oldest first); raises when it cannot be read
        (an instance with no history reads as ``[]``: `appliance history` exits 0 then), so two
        failed reads never compare equal."""
        proc = self.machine.run("appliance", "history", self.instance, "--json", check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{self.name}: `appliance history {self.instance} --json` exited "
                f"{proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        return json.loads(proc.stdout)["entries"]

    def ssh_off(self) -> None:
        """Make the host unreachable for real: its sshd stops listening, and every session it
        serves (a client's ControlMaster among them) ends. The machine, its engine and its
        Docker container stay up, as on a host whose network went away."""
        self.machine.systemctl("stop", *SSHD)
        # Stopping the unit leaves the sessions' own sshd processes (KillMode=process).
        self.machine.run("pkill", "-x", "sshd", check=False)

    def ssh_on(self) -> None:
        self.machine.systemctl("start", *SSHD)


@dataclass
class Run:
    """One ansible-playbook run: exit code, output, the recap per host, its wall time."""

    playbook: str
    returncode: int
    output: str
    recap: dict[str, dict[str, int]]
    seconds: float

    def changed(self, host: str) -> int:
        return self.recap[host]["changed"]


@dataclass
class Fleet:
    """The booted hosts, their inventory and a way to run the shipped playbooks on them."""

    hosts: list[FleetHost]
    workdir: Path
    inventory: Path
    runs: list[Run] = field(default_factory=list)
    last_ping: str = ""

    def host(self, name: str) -> FleetHost:
        return next(h for h in self.hosts if h.name == name)

    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
            ANSIBLE_HOME=str(self.workdir / "ansible-home"),
            ANSIBLE_LOCAL_TEMP=str(self.workdir / "ansible-tmp"),
            ANSIBLE_NOCOLOR="1",
            # ansible-core 2.19 keeps its SSH ControlMaster sockets in ~/.ansible/cp whatever
            # ANSIBLE_HOME says: a master left from another run would keep a host whose sshd
            # is gone reachable, and the test's runs would share masters with the user's.
            ANSIBLE_SSH_CONTROL_PATH_DIR=str(self.workdir / "cp"),
            ANSIBLE_STDOUT_CALLBACK="default",
            PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        )

    def ping(self, pattern: str = "gemma4") -> bool:
        """Whether Ansible reaches every host of ``pattern`` (a host name or the group)."""
        proc = subprocess.run(
            [str(VENV_BIN / "ansible"), "-i", str(self.inventory), pattern, "-m", "ping"],
            capture_output=True,
            text=True,
            env=self.env(),
            cwd=ANSIBLE_DIR,
            timeout=120,
            check=False,
        )
        self.last_ping = proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.returncode == 0

    def wait_reachable(self, pattern: str = "gemma4", timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.ping(pattern):
            if time.monotonic() > deadline:
                raise nspawn.NspawnError(f"ansible ping {pattern} failed:\n{self.last_ping}")
            time.sleep(1)

    def playbook(self, name: str, timeout: float = 1800, **extra: object) -> Run:
        """Run ``deploy/ansible/playbooks/NAME.yml`` on the inventory; never raises on failure."""
        argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(self.inventory)]
        if extra:
            argv += ["-e", json.dumps(extra)]
        argv.append(str(ANSIBLE_DIR / "playbooks" / f"{name}.yml"))
        start = time.monotonic()
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
            cwd=ANSIBLE_DIR,
            check=False,
        )
        output = proc.stdout + proc.stderr
        log = self.workdir / f"{len(self.runs):02d}-{name}.log"
        log.write_text(output)
        recap = {
            m.group(1): {k: int(v) for k, v in (kv.split("=") for kv in m.group(2).split())}
            for m in (RECAP.match(line) for line in output.splitlines())
            if m
        }
        run = Run(name, proc.returncode, output, recap, time.monotonic() - start)
        self.runs.append(run)
        return run


def _ssh_dir(workdir: Path, name: str, port: int, public_key: str) -> Path:
    """The host's /etc/ssh/sshd_config.d: its port, its own host key, the test's key for root."""
    d = workdir / name / "sshd_config.d"
    d.mkdir(parents=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519_key")],
        check=True,
    )
    (d / "authorized_keys").write_text(public_key)
    (d / "fleet.conf").write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        "HostKey /etc/ssh/sshd_config.d/host_ed25519_key\n"
        "AuthorizedKeysFile /etc/ssh/sshd_config.d/authorized_keys\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
    )
    d.chmod(0o755)
    return d


def _python_binds() -> list[tuple[str, str]]:
    """The venv's base Python, at its own path: the venv's ``python`` links to it. A Debian
    system Python (/usr) is already the machine's own (same release, same 3.11)."""
    base = Path(sys.base_prefix).resolve()
    if str(base).startswith(("/usr/", "/bin")) or str(base) == "/usr":
        return []
    return [(str(base), str(base))]


def _inventory(workdir: Path, key: Path, hosts: list[tuple[str, str, int, int]]) -> Path:
    """The test inventory (YAML is JSON): group ``gemma4``, one host per machine. The machines
    share one network namespace, so each host's Prometheus agent has its own port."""
    model_dir = devmodel.cached("copy").root
    inv = {
        "all": {
            "children": {
                "gemma4": {
                    "hosts": {
                        name: {
                            "ansible_port": ssh_port,
                            "appliance_instance": instance,
                            "appliance_port": vllm_port,
                            "monitoring_agent_port": free_port(),
                        }
                        for name, instance, ssh_port, vllm_port in hosts
                    },
                    "vars": {
                        "ansible_host": "127.0.0.1",
                        "ansible_user": "root",
                        "ansible_ssh_private_key_file": str(key),
                        "ansible_ssh_common_args": (
                            f"-o UserKnownHostsFile={workdir / 'known_hosts'} "
                            "-o StrictHostKeyChecking=accept-new -o IdentitiesOnly=yes"
                        ),
                        "ansible_python_interpreter": "/usr/bin/python3",
                        "appliance_install_from": "present",
                        "appliance_present_bin": str(VENV_BIN / "appliance"),
                        "appliance_version": __version__,
                        "appliance_profile": PROFILE,
                        "appliance_image": OFF_IMAGE,
                        "appliance_host": "127.0.0.1",
                        "appliance_model_dir": str(model_dir),
                        "appliance_vllm_cache_dir": str(VLLM_CACHE),
                        "rollout_timeout": 600,
                        # The soak judges its probes' traffic, not the window's length: 2 s
                        # of 6 probes is the same evidence as 15 s, 13 s sooner per soak.
                        "rollout_soak_seconds": 2,
                        "rollout_soak_probe_requests": 6,
                        # Half-second windows: the tiny engine's traffic settles each side
                        # of the live rule in ~5 s, not 20 (tests/plugins/traffic.py).
                        "rollout_live_acceptance_window": 0.5,
                    },
                }
            }
        }
    }
    path = workdir / "inventory.yml"
    path.write_text(json.dumps(inv, indent=2) + "\n")
    return path


def _remove_containers() -> None:
    for instance, _ in HOSTS:
        subprocess.run(
            ["docker", "rm", "--force", units.container_name(instance)],
            capture_output=True,
            check=False,
        )


@pytest.fixture(scope="module")
def fleet(fleet_hosts: Fleet) -> Iterator[Fleet]:
    """The hosts for tests/test_fleet.py, nothing installed yet (the tests install); their
    instances go down after it (~6 GB) for the group's tests (tests/plugins/fleet_group.py)."""
    try:
        yield fleet_hosts
    finally:
        for h in fleet_hosts.hosts:
            h.machine.systemctl("stop", units.unit_name(h.instance), check=False, timeout=180)
        _remove_containers()


# Session scope: the fleet's tier and the cross-host group's share the two hosts.
@pytest.fixture(scope="session")
def fleet_hosts(appliance_images, canary_images, tmp_path_factory) -> Iterator[Fleet]:
    """Two booted hosts reachable by Ansible. Their key, inventory and playbook logs live in
    pytest's temporary directory, which keeps the last few runs' and no more."""
    assert canary_images["label-off"] == OFF_IMAGE
    assert MTP_IMAGE in appliance_images["cpu-mtp"].tags
    nspawn.ensure_rootfs()  # once, before the parallel boots
    model_dir = devmodel.cached("copy").root
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    workdir = tmp_path_factory.mktemp("fleet")
    key = workdir / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    specs = []
    for instance, machine in HOSTS:
        ssh_port, vllm_port = free_port(), free_port()
        ssh_dir = _ssh_dir(workdir, machine, ssh_port, (workdir / "id_ed25519.pub").read_text())
        binds = [
            (str(model_dir), str(model_dir)),
            (str(REPO), str(REPO)),
            *_python_binds(),
            (str(ssh_dir), "/etc/ssh/sshd_config.d"),
        ]
        specs.append((instance, machine, ssh_port, vllm_port, binds))

    def boot(spec):
        cm = nspawn.boot(spec[1], binds=spec[4], unmask=SSHD)
        return cm, cm.__enter__()

    with contextlib.ExitStack() as stack:
        # The names (instances, containers) are fixed: a second run on this host waits for them.
        stack.enter_context(machine_lock("fleet"))
        _remove_containers()  # a previous run killed half-way
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(boot, s) for s in specs]
            errors = []
            machines = []
            for fut in futures:
                try:
                    cm, m = fut.result()
                except Exception as exc:  # noqa: BLE001 - the other machine must still go down
                    errors.append(exc)
                    continue
                stack.push(cm.__exit__)
                machines.append(m)
        if errors:
            raise errors[0]
        booted = time.monotonic() - start
        by_name = {m.name: m for m in machines}
        hosts = [FleetHost(s[0], s[0], by_name[s[1]], s[2], s[3]) for s in specs]
        inventory = _inventory(
            workdir, key, [(h.name, h.instance, h.ssh_port, h.vllm_port) for h in hosts]
        )
        fl = Fleet(hosts, workdir, inventory)
        fl.wait_reachable()

        def stop_units() -> None:
            for h in hosts:
                h.machine.systemctl("stop", units.unit_name(h.instance), check=False, timeout=180)
            _remove_containers()

        stack.callback(stop_units)
        try:
            yield fl
        finally:
            # Printed at the end of the run (pytest_terminal_summary below): a fixture's own
            # output during teardown is captured.
            TIMINGS.append(f"2 hosts booted in parallel in {booted:.1f} s")
            TIMINGS.extend(
                f"{r.playbook:<20} rc={r.returncode:<3} {r.seconds:6.1f} s" for r in fl.runs
            )
            TIMINGS.append(f"playbook logs: {workdir}")


TIMINGS: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    if TIMINGS:
        terminalreporter.section("fleet: wall time per playbook")
        for line in TIMINGS:
            terminalreporter.write_line(line)
