"""An installed instance's facts, read once, whatever its shape: :func:`read` ``(root, name) ->
Instance``.

One record for a single-node instance and for a multi-node group alike: the shape and this
host's node(s), the profile (the operator's kept copy or the shipped one, through
:func:`appliance.profiles.installed`), the env file, the serving unit(s) and container(s) (from
:class:`~appliance.host.layout.Shape`, the one place those names are decided), the key and the
base URL. The facts come from the operator's env file (``/etc/gemma4-vllm/<name>.env``, through
the one env-file parser), the args files installed and the profile the env file names; never
from generated shell. ``status``, ``history``, the cutover targets, ``instance doctor``, the
fleet's status, ``canary record``, ``bench`` and the scrape targets read it.
:mod:`appliance.instance.instance_facts` (doctor, bench) is built on it: it reads the env file with
the same parser and builds this record with :func:`from_env`, adding what the host says.

    inst = instance.read(Path("/"), "31b")
    inst.profile.name, inst.image, inst.base_url, inst.api_key(), inst.shape.container
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import profiles
from ..errors import UsageError
from ..host import apikey, envfile, values
from ..host.envfile import HOST_KEY, PORT_KEY, PROFILE_KEY
from ..host.layout import Layout, Node, Shape
from ..host.values import check_host, check_port
from ..profiles import Profile
from ..serve.argsfile import read as read_args


@dataclass(frozen=True)
class Instance:
    """One installed NAME on this host: a single-node instance or the nodes of a group.

    ``name``: the instance or group; ``shape``: its shape here (:class:`Shape`: the units and
    containers that serve it); ``node``: a group's node(s) on this host (None for a single-node
    instance). ``profile``: the profile ``APPLIANCE_PROFILE`` names (the kept copy first).
    ``image``: ``VLLM_IMAGE`` (None when unset). ``host``, ``port``: where vLLM binds (a group's
    head). ``env``: the env file as read (its bytes, for a byte-preserving rewrite).
    ``args_path``: the args file of the first node here; ``api_key_path``: the key guarding the
    API on this host (None on a host that runs only a group's worker: it serves no API).
    """

    name: str
    profile: Profile
    image: str | None
    host: str
    port: int
    env: envfile.EnvFile
    args_path: Path
    api_key_path: Path | None
    shape: Shape
    node: Node | None = None

    @property
    def group(self) -> bool:
        return self.shape.group

    @property
    def noun(self) -> str:
        return self.shape.noun

    @property
    def unit(self) -> str:
        """The unit that serves it here (a group's head where this host runs it)."""
        return self.shape.unit

    @property
    def container(self) -> str:
        """The container of :attr:`unit`."""
        return self.shape.container

    @property
    def units(self) -> tuple[str, ...]:
        return self.shape.units

    @property
    def containers(self) -> tuple[str, ...]:
        return self.shape.containers

    @property
    def answers(self) -> bool:
        """It serves the API on this host (not a host running only a group's worker)."""
        return self.shape.answers

    @property
    def env_path(self) -> Path:
        return self.env.path

    @property
    def served_model(self) -> str:
        """The model name vLLM serves (``--served-model-name``)."""
        return self.profile.served_model_name

    @property
    def base_url(self) -> str:
        """Where to reach vLLM from this host (an any-address bind is asked on loopback)."""
        return values.base_url(self.host, self.port)

    def api_key(self) -> str | None:
        """The key vLLM requires on ``/v1`` (None when the instance has no key file); the one
        rule of :mod:`appliance.host.apikey`, so an unreadable, empty or unsafe file is an error."""
        return apikey.read(self.api_key_path) if self.api_key_path else None


def host_node(layout: Layout, shape: Shape) -> Node:
    """What this host runs of group ``shape``: its roles, and a worker's node rank read from
    its args file."""
    rank = 1
    if "worker" in shape.roles:
        path = layout.node_args_file(shape.name, "worker")
        serve = list(read_args(path).serve)
        try:
            rank = int(serve[serve.index("--node-rank") + 1])
        except (ValueError, IndexError):
            raise UsageError(
                f"{path} names no --node-rank",
                fix=f"reinstall the worker: `appliance instance install {shape.name} "
                "--role worker --rank N`",
            ) from None
    return Node(roles=shape.roles, rank=rank)


def read(root: Path | str, name: str) -> Instance:
    """The facts of instance ``name`` installed under ``root`` (``/`` on a host).

    Errors, each naming the file: no env file (install first); a line systemd could read
    differently; no ``APPLIANCE_PROFILE``, ``VLLM_HOST`` or ``VLLM_PORT`` (re-run install,
    which writes them); an unknown profile; a host or
    port that is not one.
    """
    return from_env(root, name, envfile.read(Layout(Path(root)).env_file(name)))


def from_env(root: Path | str, name: str, env: envfile.EnvFile) -> Instance:
    """The record of ``name`` from its env file ``env``, already read (errors as :func:`read`);
    its shape from the args files installed under ``root``."""
    root = Path(root)
    layout = Layout(root)
    upgrade = f"re-run `appliance instance install {name} --profile PROFILE` (it upgrades in place)"

    def required(key: str) -> str:
        value = env.get(key)
        if not value:
            raise UsageError(f"{key} is not set in {env.path}", fix=upgrade)
        return value

    shape = layout.shape(name)
    profile = profiles.installed(root, name, required(PROFILE_KEY))
    node = None
    if shape.group:
        node = host_node(layout, shape)
        if profile.multinode is None:
            raise UsageError(
                f"{env.path} names profile {profile.name}, which serves one host, but this host "
                f"runs node(s) {', '.join(node.roles)} of group {name}",
                fix=f"reinstall the group with its multi-node profile: `appliance instance "
                f"install {name} --profile PROFILE --role ...`",
            )
    host = check_host(host_text := required(HOST_KEY), f"{HOST_KEY}={host_text!r} in {env.path}")
    port_text = required(PORT_KEY)
    port = check_port(port_text, f"{PORT_KEY}={port_text!r} in {env.path}")
    args = layout.node_args_file(name, shape.roles[0]) if shape.group else layout.args_file(name)
    key = layout.served_key_file(name, shape)
    return Instance(
        name=name,
        profile=profile,
        image=env.get(envfile.IMAGE_KEY) or None,
        host=host,
        port=port,
        env=env,
        args_path=args,
        api_key_path=key,
        shape=shape,
        node=node,
    )
