"""One model across nodes: the head and worker units of a multi-node group, from one profile.

A profile with a ``[multinode]`` table (e.g. ``spark2-31b-nvfp4-mtp``) is served by a *group*:
vLLM's own multi-node (``--nnodes N --node-rank R --master-addr A --master-port P``), node rank 0
(the *head*) serving the API, every other node a ``--headless`` *worker*. No Ray, no
orchestrator of ours: systemd on each host runs one unit per role, and every unit runs the
appliance's one serve program (``serve <group>-head|<group>-worker ...``) unchanged.

What is particular to a group lives here: each node's arguments (:func:`node_args`) and the
group's templates, rendered by :func:`render`. Installing them is the one install pipeline of
either shape (:func:`appliance.instance.installer.install`: plan, render, host check, write under
the group's lock, keys, the operator's profile copy, the scrape targets).

Per host, under ``/etc/gemma4-vllm``:

- ``<group>.env``: the group's operator file, read by both units (``EnvironmentFile=``):
  ``VLLM_IMAGE`` (the ONE image every node runs), profile, API host/port, paths, GPUs;
- ``<group>-head.args`` / ``<group>-worker.args``: the profile's engine arguments plus the
  node's ``--nnodes/--node-rank/--master-addr/--master-port`` (``--headless`` on a worker) and
  the interconnect variables (``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``) as ``docker --env``;
- the unit templates ``gemma4-vllm-head@.service``, ``gemma4-vllm-worker@.service``, the probe
  timer, where head and worker share a host the drop-in binding the head to the worker, and
  each node's mounts drop-in (``RequiresMountsFor=`` the group's model and cache folders).

Start order, health and a worker's death: see the unit templates and
``gotchas/multinode-start-order-and-worker-death.md``. Cutover: :mod:`appliance.cutover.group`.
"""

from __future__ import annotations

from dataclasses import replace

import jinja2

from ..errors import UsageError
from ..host import names
from ..host.envfile import HOST_KEY, IMAGE_KEY, PORT_KEY, PROFILE_KEY
from ..host.layout import LOCAL_WORKER_DROPIN, Node
from ..host.names import HEAD_TEMPLATE, PROBE_SERVICE, PROBE_TIMER, WORKER_TEMPLATE, Role
from ..profiles import Profile, get
from ..profiles import validate as pv
from ..serve.argsfile import ServeArgs
from ..units import engine_args
from ..units import template as ut
from ..units.template import REL, rel

__all__ = ["Node", "node_args", "render", "require_multinode"]

PROBE_INTERVAL_S = 30
# CPU profiles (every node on one host): vLLM's zmq ipc:// sockets, shared by the containers.
RPC_DIR = "/run/gemma4-vllm-rpc"
_FIXED_KEYS = (IMAGE_KEY, PROFILE_KEY, HOST_KEY, PORT_KEY)


def require_multinode(profile: Profile) -> Profile:
    """``profile`` if it is a valid multi-node profile, else a UsageError naming the fix."""
    if profile.multinode is None:
        raise UsageError(
            f"profile {profile.name} serves one host: it has no [multinode] table",
            fix="use a multi-node profile (e.g. spark2-31b-nvfp4-mtp), or install it as an "
            "instance: `appliance instance install NAME --profile PROFILE` without --role",
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
    names.check_group(group)
    if not node.roles or any(r not in names.ROLES for r in node.roles):
        raise UsageError(f"node roles {node.roles!r}", fix="head, worker or both")
    prof = require_multinode(get(profile) if isinstance(profile, str) else profile)
    ut.check_profile(prof)  # the single-node renderer's string checks, one rule
    opts = options or ut.Options()
    values = ut.env_values(prof, group, opts)
    context = {
        **ut.base_context(prof, names.node_instance(group, node.roles[0]), values),
        "extra_keys": [k for k in values if k not in _FIXED_KEYS],
        "probe_interval_s": PROBE_INTERVAL_S,
        "dropin": LOCAL_WORKER_DROPIN,
        "group": group,
        "master_addr": prof.multinode.master_addr,
        "master_port": prof.multinode.master_port,
    }
    env = _jinja()
    files = ut.program()
    for role in node.roles:
        args = node_args(prof, role, node.rank, group)
        rank = 0 if role == "head" else node.rank
        about = (
            f"{names.ENV_DIR}/{names.node_instance(group, role)}.args: the engine arguments of "
            f"the {role} of group {group} (node rank {rank} of {prof.multinode.nodes}), from "
            f"profile {prof.name}. Generated by `appliance instance install`; do not edit."
        )
        path = rel(REL.node_args_file(group, role))
        files[path] = ut.RenderedFile(args.to_json(about), ut.MODE_ARGS)
    files[rel(REL.env_file(group))] = ut.RenderedFile(
        env.get_template("group.env.j2").render(context), ut.MODE_ENV
    )
    if "head" in node.roles:
        for path, name in zip(REL.probe_units, (PROBE_SERVICE, PROBE_TIMER), strict=True):
            text = env.get_template(name + ".j2").render(context)
            files[rel(path)] = ut.RenderedFile(text, ut.MODE_UNIT)
        if node.colocated:
            for role, template in (("head", "local-worker"), ("worker", "local-head")):
                text = env.get_template(f"{template}.conf.j2").render(context)
                files[rel(REL.node_dropin(group, role))] = ut.RenderedFile(text, ut.MODE_UNIT)
    if "worker" in node.roles:
        text = env.get_template("rendezvous.conf.j2").render(context)
        files[rel(REL.rendezvous_dropin(group))] = ut.RenderedFile(text, ut.MODE_UNIT)
    for role, name in (("worker", WORKER_TEMPLATE), ("head", HEAD_TEMPLATE)):
        if role in node.roles:
            text = env.get_template(name + ".j2").render(context)
            files[rel(REL.node_template(role))] = ut.RenderedFile(text, ut.MODE_UNIT)
    # Each node waits for the mounts of the group's model and cache folders, as an instance does.
    for role in node.roles:
        files.update(ut.mounts_dropin(group, values, role))
    # The host's state metrics (status, cutover annotations, the failed-unit alert), as an
    # instance's install writes them: one service and timer per host, whatever it runs.
    files.update(ut.state_units())
    return files
