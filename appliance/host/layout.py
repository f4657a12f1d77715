"""Where the appliance's files live on a host, under an optional root prefix (tests, image
builds), and what shape each installed instance has: the one path record.

The operator's files (env file, and what ``install`` writes beside it: engine arguments, the
API key) live in ``/etc/gemma4-vllm``; the units in ``/etc/systemd/system``; the one serve
program in ``/usr/local/libexec/gemma4-vllm``. Everything a cutover adds (the history, the
rollback slot, the lock, the saved previous env file, the canary's records) lives in the
appliance's state directory, so that a cutover never writes next to the operator's
configuration.

An instance is known by its env file, ``<name>.env``, whatever its shape (:class:`Shape`): a
single-node instance has ``<name>.args``; a multi-node group has, on each host, the args file of
each node that host runs (``<name>-head.args``, ``<name>-worker.args``). ``Layout(Path())``
gives the same paths relative to the root (the keys of a rendered tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import names
from .envfile import unknown_instance
from .names import ROLES, Role, check_instance, node_instance

ENV_DIR = Path(names.ENV_DIR).relative_to("/")
STATE_DIR = Path("var/lib/gemma4-appliance")
UNIT_DIR = Path("etc/systemd/system")
LIBEXEC_DIR = Path("usr/local/libexec/gemma4-vllm")
# Where `systemctl enable` links an instance (the unit's WantedBy=) and a timer.
WANTS_DIR = UNIT_DIR / "multi-user.target.wants"
TIMERS_WANTS_DIR = UNIT_DIR / "timers.target.wants"
# Drop-ins binding a group's head and worker where both run on one host.
LOCAL_WORKER_DROPIN = "50-local-worker.conf"
LOCAL_HEAD_DROPIN = "50-local-head.conf"
# The worker's wait for its head's rendezvous (the head's address let through the hardening).
RENDEZVOUS_DROPIN = "40-rendezvous.conf"
# An instance's own drop-in: RequiresMountsFor= the folders its env file names.
MOUNTS_DROPIN = "mounts.conf"


@dataclass(frozen=True)
class Shape:
    """What ``name`` is on this host: a single-node instance (no ``roles``), or a multi-node
    group of which this host runs the nodes ``roles``."""

    name: str
    roles: tuple[Role, ...] = ()

    @property
    def group(self) -> bool:
        return bool(self.roles)

    @property
    def noun(self) -> str:
        """How messages name it."""
        return "group" if self.group else "instance"

    @property
    def answers(self) -> bool:
        """It serves the API on this host: an instance, or a group whose head runs here (not a
        host that runs only a group's worker)."""
        return not self.group or "head" in self.roles

    @property
    def units(self) -> tuple[str, ...]:
        """The units that serve it on this host."""
        if self.group:
            return tuple(names.node_unit(self.name, r) for r in self.roles)
        return (names.unit_name(self.name),)

    @property
    def containers(self) -> tuple[str, ...]:
        """The Docker containers of :attr:`units`, in the same order."""
        if self.group:
            return tuple(names.node_container(self.name, r) for r in self.roles)
        return (names.container_name(self.name),)

    @property
    def unit(self) -> str:
        """The unit that serves it here: a group's head where this host runs it, else its
        worker; the instance's own."""
        return self.units[0]

    @property
    def container(self) -> str:
        """The container of :attr:`unit` (the one that answers the API where this host does)."""
        return self.containers[0]

    @property
    def templates(self) -> tuple[str, ...]:
        """The templated unit files of :attr:`units` (``gemma4-vllm@.service``, or a group
        node's ``gemma4-vllm-head@.service`` / ``-worker@``)."""
        if self.group:
            return tuple(
                names.HEAD_TEMPLATE if r == "head" else names.WORKER_TEMPLATE for r in self.roles
            )
        return (names.UNIT_TEMPLATE,)

    def role_unit(self, role: Role) -> str:
        """The unit of a group's node ``role`` (one this host runs)."""
        return self.units[self.roles.index(role)]

    def role_container(self, role: Role) -> str:
        """The container of a group's node ``role`` (one this host runs)."""
        return self.containers[self.roles.index(role)]


@dataclass(frozen=True)
class Node:
    """What one host runs of a group: its roles (the head's host may run a worker too, as the
    CPU test profile does) and a worker's node rank (1..nodes-1)."""

    roles: tuple[Role, ...] = ("head",)
    rank: int = 1

    @property
    def colocated(self) -> bool:
        """Head and worker on this one host: the head is bound to the worker (BindsTo=)."""
        return "head" in self.roles and "worker" in self.roles


@dataclass(frozen=True)
class Layout:
    """The appliance's paths below ``root`` (``/`` on a real host)."""

    root: Path = Path("/")

    # ---- the operator's files, per instance ---------------------------------------------------

    @property
    def env_dir(self) -> Path:
        return self.root / ENV_DIR

    def env_file(self, name: str) -> Path:
        """The env file the unit(s) read (``EnvironmentFile=``): the operator's."""
        return self.env_dir / f"{check_instance(name)}.env"

    def args_file(self, instance: str) -> Path:
        """The engine's arguments, from the profile (JSON, written by ``appliance instance
        install``)."""
        return self.env_dir / f"{check_instance(instance)}.args"

    def api_key_file(self, instance: str) -> Path:
        """The API key vLLM requires on ``/v1`` (mode 0600, written by ``appliance instance
        install``)."""
        return self.env_dir / f"{check_instance(instance)}.api-key"

    def profile_copy(self, name: str) -> Path:
        """Where an operator's own profile file is installed beside the instance's env file."""
        return self.env_dir / f"{check_instance(name)}.profile.toml"

    def served_key_file(self, name: str, shape: Shape | None = None) -> Path | None:
        """The API key guarding ``name``'s API on this host: a group's head's, else the
        instance's own; None where this host serves no API (a group's worker only).
        ``shape``: ``name``'s, when the caller has it already."""
        shape = self.shape(name) if shape is None else shape
        if not shape.answers:
            return None
        return self.node_api_key_file(name, "head") if shape.group else self.api_key_file(name)

    def node_args_file(self, group: str, role: Role) -> Path:
        return self.args_file(node_instance(group, role))

    def node_api_key_file(self, group: str, role: Role) -> Path:
        return self.api_key_file(node_instance(group, role))

    # ---- units and programs, shared by every instance ------------------------------------------

    @property
    def unit_dir(self) -> Path:
        return self.root / UNIT_DIR

    @property
    def unit_template(self) -> Path:
        """The single-node instances' templated unit, ``gemma4-vllm@.service``."""
        return self.unit_dir / names.UNIT_TEMPLATE

    def node_template(self, role: Role) -> Path:
        """A group node's templated unit (``gemma4-vllm-head@.service``, ``-worker@``)."""
        return self.unit_dir / (names.HEAD_TEMPLATE if role == "head" else names.WORKER_TEMPLATE)

    @property
    def probe_units(self) -> tuple[Path, Path]:
        """The head's generation probe: its service and timer templates."""
        return (self.unit_dir / names.PROBE_SERVICE, self.unit_dir / names.PROBE_TIMER)

    def node_dropin(self, group: str, role: Role) -> Path:
        """The drop-in binding ``role`` to the other node where both run on this host."""
        dropin = LOCAL_WORKER_DROPIN if role == "head" else LOCAL_HEAD_DROPIN
        return self.unit_dir / f"{names.node_unit(group, role)}.d" / dropin

    def mounts_dropin(self, name: str, role: Role | None = None) -> Path:
        """The drop-in of instance ``name``'s unit (of group ``name``'s node ``role``) waiting
        for the mounts of its model and cache folders."""
        unit = names.node_unit(name, role) if role else names.unit_name(name)
        return self.unit_dir / f"{unit}.d" / MOUNTS_DROPIN

    def rendezvous_dropin(self, group: str) -> Path:
        """The drop-in letting a group's worker reach its head's rendezvous."""
        return self.unit_dir / f"{names.node_unit(group, 'worker')}.d" / RENDEZVOUS_DROPIN

    @property
    def serve_program(self) -> Path:
        """The one serve program every unit runs."""
        return self.root / LIBEXEC_DIR / "serve"

    @property
    def state_units(self) -> tuple[Path, Path]:
        """The host's state-metrics service and timer."""
        base = self.unit_dir / names.STATE_UNIT
        return (base.with_name(base.name + ".service"), base.with_name(base.name + ".timer"))

    def wants_link(self, unit: str) -> Path:
        """Where ``systemctl enable`` links ``unit`` (its ``WantedBy=``)."""
        wants = TIMERS_WANTS_DIR if unit.endswith(".timer") else WANTS_DIR
        return self.root / wants / unit

    # ---- the installed instances ----------------------------------------------------------------

    def installed(self) -> list[str]:
        """Every instance installed here, of every shape (an env file each), sorted."""
        return sorted(p.stem for p in self.env_dir.glob("*.env"))

    def shape(self, name: str) -> Shape:
        """What ``name`` is on this host, by the args files installed: a group when it runs a
        node of one (whatever else is there), else a single-node instance."""
        check_instance(name)
        if len(name) > names.MAX_GROUP:
            return Shape(name)
        return Shape(name, tuple(r for r in ROLES if self.node_args_file(name, r).exists()))

    def require_known(self, name: str) -> None:
        """Refuse a name this host has never seen: no env file and no history (an uninstalled
        instance's history is kept, and stays readable)."""
        if not (self.env_file(name).exists() or self.history_file(name).exists()):
            raise unknown_instance(name, self.env_file(name))

    # ---- the appliance's state, per instance ----------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    def history_file(self, name: str) -> Path:
        return self.state_dir / "history" / f"{check_instance(name)}.jsonl"

    def lock_file(self, name: str) -> Path:
        return self.state_dir / "locks" / f"{check_instance(name)}.lock"

    def rollback_slot(self, name: str) -> Path:
        """JSON naming the image ``appliance rollback`` returns to (kept by image pruning)."""
        return self.state_dir / "rollback" / f"{check_instance(name)}.json"

    def saved_env(self, name: str) -> Path:
        """The env file as it was before the cutover in progress (byte-identical copy)."""
        return self.state_dir / "cutover" / f"{check_instance(name)}.env.prev"

    def saved_slot(self, name: str) -> Path:
        """The rollback slot as it was before the cutover in progress (its bytes; empty when
        there was none), so that recovering a killed cutover puts it back too."""
        return self.state_dir / "cutover" / f"{check_instance(name)}.slot.prev"

    def canary_record(self, name: str, side: str) -> Path:
        """The output canary's record of the cutover in progress (``side``: before, after)."""
        return self.state_dir / "canary" / f"{check_instance(name)}.{side}.json"

    def canary_baseline(self, name: str) -> Path:
        """The instance's acceptance baseline: its last passing canary record that drafted
        (kept across cutovers, for the one whose old image has no MTP)."""
        return self.state_dir / "canary" / f"{check_instance(name)}.baseline.json"

    def state_files(self, name: str) -> tuple[Path, ...]:
        """Every file the cutover keeps for ``name`` (``uninstall --purge`` removes them)."""
        return (
            self.history_file(name),
            self.rollback_slot(name),
            self.saved_env(name),
            self.saved_slot(name),
            self.lock_file(name),
            self.canary_record(name, "before"),
            self.canary_record(name, "after"),
            self.canary_baseline(name),
        )

    def private_dirs(self, name: str) -> tuple[Path, ...]:
        """The state directories holding ``name``'s lock, history, rollback slot, saved env
        file and canary records (model output): root's alone (0700). The metrics folder is not
        one: the node exporter reads it."""
        return tuple(
            p.parent
            for p in (
                self.lock_file(name),
                self.history_file(name),
                self.rollback_slot(name),
                self.saved_env(name),
                self.canary_record(name, "before"),
            )
        )

    def metrics_textfile(self) -> Path:
        return self.state_dir / "metrics" / "gemma4_appliance.prom"
