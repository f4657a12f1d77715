"""One model across nodes: the head and worker units of a multi-node group, from one profile.

A profile with a ``[multinode]`` table (e.g. ``spark2-31b-nvfp4-mtp``) is served by a *group*:
vLLM's own multi-node (``--nnodes N --node-rank R --master-addr A --master-port P``), node rank 0
(the *head*) serving the API, every other node a ``--headless`` *worker*. No Ray, no
orchestrator of ours: systemd on each host runs one unit per role, and every unit runs the
appliance's one serve program (``serve <group>-head|<group>-worker ...``) unchanged.

Per host, under ``/etc/gemma4-vllm`` (``render``/``install``):

- ``<group>.env``: the group's operator file, read by both units (``EnvironmentFile=``):
  ``VLLM_IMAGE`` (the ONE image every node runs), profile, API host/port, paths, GPUs;
- ``<group>-head.args`` / ``<group>-worker.args``: the profile's engine arguments plus the
  node's ``--nnodes/--node-rank/--master-addr/--master-port`` (``--headless`` on a worker) and
  the interconnect variables (``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``) as ``docker --env``;
- the unit templates ``gemma4-vllm-head@.service``, ``gemma4-vllm-worker@.service``, the probe
  timer, and where head and worker share a host the drop-in binding the head to the worker.

Start order, health and a worker's death: see the unit templates and
``gotchas/multinode-start-order-and-worker-death.md``. Cutover: :mod:`appliance.multinode.cutover`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Literal

import jinja2

from ..errors import UsageError
from ..fsutil import write_atomic
from ..host import envfile, names
from ..profiles import Profile, get
from ..profiles import validate as pv
from ..serve.argsfile import ServeArgs
from ..serve.argsfile import read as read_args
from ..units import engine_args
from ..units import template as ut
from ..units.timing import STOP_GRACE_S, unit_timing
from ..units.writer import WriteResult, write_scrape_targets, write_tree

Role = Literal["head", "worker"]
ROLES: tuple[Role, ...] = ("head", "worker")
HEAD_TEMPLATE = "gemma4-vllm-head@.service"
WORKER_TEMPLATE = "gemma4-vllm-worker@.service"
PROBE_SERVICE = "gemma4-vllm-probe@.service"
PROBE_TIMER = "gemma4-vllm-probe@.timer"
LOCAL_WORKER_DROPIN = "50-local-worker.conf"
LOCAL_HEAD_DROPIN = "50-local-head.conf"
RENDEZVOUS_DROPIN = "40-rendezvous.conf"
PROBE_INTERVAL_S = 30
# CPU profiles (every node on one host): vLLM's zmq ipc:// sockets, shared by the containers.
RPC_DIR = "/run/gemma4-vllm-rpc"
# The group name plus "-worker" must stay a valid instance (container and args names).
_MAX_GROUP = 64 - len("-worker")
_FIXED_KEYS = ("VLLM_IMAGE", "APPLIANCE_PROFILE", "VLLM_HOST", "VLLM_PORT")


@dataclass(frozen=True)
class Node:
    """What one host of a group runs: its roles (the head's host may run a worker too, as the
    CPU test profile does) and a worker's node rank (1..nodes-1)."""

    roles: tuple[Role, ...] = ("head",)
    rank: int = 1

    @property
    def colocated(self) -> bool:
        """Head and worker on this one host: the head is bound to the worker (BindsTo=)."""
        return "head" in self.roles and "worker" in self.roles


def check_group(name: str) -> str:
    """``name`` if it is a valid group name, else a UsageError."""
    names.check_instance(name)
    if len(name) > _MAX_GROUP:
        raise UsageError(f"group name {name!r} is longer than {_MAX_GROUP} characters")
    return name


def node_instance(group: str, role: Role) -> str:
    """The serve program's instance of ``role`` in ``group`` (its args, key and container)."""
    return f"{check_group(group)}-{role}"


def unit_name(group: str, role: Role) -> str:
    return f"gemma4-vllm-{role}@{check_group(group)}.service"


def container_name(group: str, role: Role) -> str:
    return names.container_name(node_instance(group, role))


def _rel(path: str) -> str:
    return str(PurePosixPath(path).relative_to("/"))


def env_path(group: str) -> str:
    return _rel(f"{names.ENV_DIR}/{check_group(group)}.env")


def args_path(group: str, role: Role) -> str:
    return _rel(f"{names.ENV_DIR}/{node_instance(group, role)}.args")


def api_key_path(group: str, role: Role) -> str:
    return _rel(f"{names.ENV_DIR}/{node_instance(group, role)}.api-key")


def host_roles(root: Path | str, name: str) -> tuple[Role, ...]:
    """The roles this host runs for group ``name``, by the args files installed under ``root``;
    ``()`` when ``name`` is a single-host instance (or no group at all)."""
    if len(name) > _MAX_GROUP:
        return ()
    return tuple(r for r in ROLES if (Path(root) / args_path(name, r)).exists())


def host_node(root: Path | str, group: str) -> Node:
    """What this host runs of ``group``: its roles and a worker's node rank, read from the args
    files installed under ``root``; a UsageError when it runs no node of ``group``."""
    roles = host_roles(root, group)
    if not roles:
        raise UsageError(
            f"this host runs no node of group {group} (no {names.ENV_DIR}/{group}-head.args "
            "or -worker.args)",
            fix=f"`appliance multinode install --group {group} ...` first, or name the group "
            "this host runs",
        )
    rank = 1
    if "worker" in roles:
        serve = list(read_args(Path(root) / args_path(group, "worker")).serve)
        try:
            rank = int(serve[serve.index("--node-rank") + 1])
        except (ValueError, IndexError):
            raise UsageError(
                f"{names.ENV_DIR}/{group}-worker.args names no --node-rank",
                fix=f"reinstall the worker: `appliance multinode install --group {group} "
                "--role worker --rank N`",
            ) from None
    return Node(roles=roles, rank=rank)


def host_units(root: Path | str, name: str) -> list[str]:
    """The units that serve ``name`` on this host: a group's head and/or worker units, else
    the instance's ``gemma4-vllm@NAME`` (a group has no such unit)."""
    roles = host_roles(root, name)
    return [unit_name(name, r) for r in roles] if roles else [names.unit_name(name)]


def dropin_path(group: str) -> str:
    return _rel(f"{ut.UNIT_DIR}/{unit_name(group, 'head')}.d/{LOCAL_WORKER_DROPIN}")


def worker_dropin_path(group: str) -> str:
    return _rel(f"{ut.UNIT_DIR}/{unit_name(group, 'worker')}.d/{LOCAL_HEAD_DROPIN}")


def rendezvous_dropin_path(group: str) -> str:
    return _rel(f"{ut.UNIT_DIR}/{unit_name(group, 'worker')}.d/{RENDEZVOUS_DROPIN}")


def require_multinode(profile: Profile) -> Profile:
    """``profile`` if it is a valid multi-node profile, else a UsageError naming the fix."""
    if profile.multinode is None:
        raise UsageError(
            f"profile {profile.name} serves one host: it has no [multinode] table",
            fix="use a multi-node profile (e.g. spark2-31b-nvfp4-mtp), or `appliance install`",
        )
    pv.require_valid(profile)
    return profile


def node_args(profile: Profile, role: Role, rank: int, group: str) -> ServeArgs:
    """The args of one node: the single-node args with the node's multi-node flags after the
    ``serve`` arguments and the interconnect variables as ``docker --env``."""
    mn = profile.multinode
    assert mn is not None
    if role == "head":
        rank = 0
    elif not 1 <= rank < mn.nodes:
        raise UsageError(
            f"worker node rank {rank} is outside 1..{mn.nodes - 1} for {mn.nodes} nodes",
            fix="give each worker host its own rank, the head is 0",
        )
    keys = list(ut.env_values(profile, "x", ut.Options()))
    args = engine_args.serve_args(profile, keys)
    extra = [
        "--nnodes",
        str(mn.nodes),
        "--node-rank",
        str(rank),
        "--master-addr",
        mn.master_addr,
        "--master-port",
        str(mn.master_port),
    ]
    if role == "worker":
        extra.append("--headless")
    docker = list(args.docker)
    if profile.hardware.device == "cpu":
        # The CPU profiles run every node on ONE host (validated: the rendezvous on loopback):
        # the two containers must meet as two processes of one host do, through the host's IPC
        # and one /tmp. They keep the instance's hardening (--cap-drop ALL, no-new-privileges,
        # --init): the pair generates with it (gotchas/multinode-start-order-and-worker-death.md).
        docker = _host_ipc(docker, group)
    for key, value in (
        ("NCCL_SOCKET_IFNAME", mn.nccl_socket_ifname),
        ("GLOO_SOCKET_IFNAME", mn.gloo_socket_ifname),
    ):
        if value:
            docker += ["--env", f"{key}={value}"]
    args = replace(args, serve=(*args.serve, *extra), docker=tuple(docker))
    engine_args.check_arguments(args, profile)
    return args


# The single-host container option a one-host CPU pair cannot run with: the shm size of a
# private IPC namespace, which --ipc host replaces (see _host_ipc).
_ONE_HOST_DROPPED = {"--shm-size": 1}


def _host_ipc(docker: list[str], group: str) -> list[str]:
    """``docker`` options for two containers that must behave as two processes of one host:
    the host's IPC and one shared ``/tmp``, without the options in ``_ONE_HOST_DROPPED``."""
    out = []
    skip = 0
    for value in docker:
        if skip:
            skip -= 1
            continue
        if value in _ONE_HOST_DROPPED:
            skip = _ONE_HOST_DROPPED[value]
            continue
        out.append(value)
    return [*out, "--ipc", "host", "--volume", f"{RPC_DIR}/{group}:/tmp"]


def _jinja() -> jinja2.Environment:
    return ut.jinja_env("appliance.multinode")


def render(
    profile: str | Profile,
    group: str,
    node: Node | None = None,
    options: ut.Options | None = None,
) -> dict[str, ut.RenderedFile]:
    """Every file ``node`` of ``group`` needs, keyed by path relative to the root. Nothing is
    rendered (UsageError) for a profile without ``[multinode]``, with validation errors, or a
    bad name, rank, image, host or path."""
    node = node or Node()
    check_group(group)
    if not node.roles or any(r not in ROLES for r in node.roles):
        raise UsageError(f"node roles {node.roles!r}", fix="head, worker or both")
    prof = require_multinode(get(profile) if isinstance(profile, str) else profile)
    ut.check_profile(prof)  # the single-node renderer's string checks, one rule
    opts = options or ut.Options()
    values = ut.env_values(prof, group, opts)
    any_role: Role = node.roles[0]
    context = {
        "profile": prof,
        "instance": node_instance(group, any_role),
        "labels": ut.labels,
        "env_dir": names.ENV_DIR,
        "serve_script": ut.SERVE_SCRIPT,
        "values": values,
        "extra_keys": [k for k in values if k not in _FIXED_KEYS],
        # The instance unit's timings and start-limit arithmetic, one source (units.timing).
        "timing": unit_timing(),
        "stop_grace_s": STOP_GRACE_S,
        "probe_interval_s": PROBE_INTERVAL_S,
        "dropin": LOCAL_WORKER_DROPIN,
        "group": group,
        "master_addr": prof.multinode.master_addr,
        "master_port": prof.multinode.master_port,
    }
    env = _jinja()
    files: dict[str, ut.RenderedFile] = {
        _rel(ut.SERVE_SCRIPT): ut.RenderedFile(ut.serve_program(), ut.MODE_PROGRAM),
    }
    for role in node.roles:
        args = node_args(prof, role, node.rank, group)
        rank = 0 if role == "head" else node.rank
        about = (
            f"{names.ENV_DIR}/{node_instance(group, role)}.args: the engine arguments of the "
            f"{role} of group {group} (node rank {rank} of {prof.multinode.nodes}), from profile "
            f"{prof.name}. Generated by `appliance multinode install`; do not edit."
        )
        files[args_path(group, role)] = ut.RenderedFile(args.to_json(about), ut.MODE_ARGS)
    files[env_path(group)] = ut.RenderedFile(
        env.get_template("group.env.j2").render(context), ut.MODE_ENV
    )
    if "head" in node.roles:
        for name in (PROBE_SERVICE, PROBE_TIMER):
            text = env.get_template(name + ".j2").render(context)
            files[_rel(f"{ut.UNIT_DIR}/{name}")] = ut.RenderedFile(text, ut.MODE_UNIT)
        if node.colocated:
            text = env.get_template("local-worker.conf.j2").render(context)
            files[dropin_path(group)] = ut.RenderedFile(text, ut.MODE_UNIT)
            text = env.get_template("local-head.conf.j2").render(context)
            files[worker_dropin_path(group)] = ut.RenderedFile(text, ut.MODE_UNIT)
    if "worker" in node.roles:
        text = env.get_template("rendezvous.conf.j2").render(context)
        files[rendezvous_dropin_path(group)] = ut.RenderedFile(text, ut.MODE_UNIT)
    for role, name in (("worker", WORKER_TEMPLATE), ("head", HEAD_TEMPLATE)):
        if role in node.roles:
            text = env.get_template(name + ".j2").render(context)
            files[_rel(f"{ut.UNIT_DIR}/{name}")] = ut.RenderedFile(text, ut.MODE_UNIT)
    # The host's state metrics (status, cutover annotations, the failed-unit alert), as an
    # instance's install writes them: one service and timer per host, whatever it runs.
    files.update(ut.state_units())
    return files


def install(
    profile: str | Profile,
    group: str,
    node: Node | None = None,
    *,
    root: Path | str = Path("/"),
    options: ut.Options | None = None,
) -> WriteResult:
    """Install ``node`` of ``group`` under ``root``; idempotent. Values already in the group's
    env file (VLLM_IMAGE above all) are kept unless given in ``options``. Each role gets an API
    key file (0600, created once). Does not call systemctl."""
    root = Path(root)
    node = node or Node()
    existing_path = root / env_path(group)
    existing = envfile.read(existing_path).values if existing_path.exists() else {}
    opts = ut.options_from_env(existing, options or ut.Options())
    files = render(profile, group, node, opts)  # everything validated before the first write
    result = write_tree(root, files)
    for role in node.roles:
        key = root / api_key_path(group, role)
        if not key.exists():
            write_atomic(key, (secrets.token_urlsafe(32) + "\n").encode(), mode=ut.MODE_SECRET)
            result.written.append(key)
    # The head is scraped like an instance (the engines' file_sd targets of this host).
    write_scrape_targets(root, result)
    return result


def images(envs: Iterable[tuple[str, Path]]) -> dict[str, str | None]:
    """``{node: VLLM_IMAGE}`` of each node's copy of the group's env file."""
    return {name: envfile.read(path).get(envfile.IMAGE_KEY) for name, path in envs}


def require_one_image(found: dict[str, str | None]) -> str | None:
    """The group's one image; a UsageError naming each node's when the nodes disagree (vLLM's
    ranks must run the same engine: a mixed group fails at the rendezvous or, worse, later)."""
    distinct = set(found.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{n}: {img or 'unset'}" for n, img in sorted(found.items()))
        raise UsageError(
            f"the group's nodes name different images ({listing})",
            fix="every node must run the same VLLM_IMAGE: `appliance multinode cutover` moves "
            "them together",
        )
    return next(iter(distinct), None)
