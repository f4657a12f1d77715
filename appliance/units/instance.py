"""An installed instance's facts, read once: :func:`read` ``(root, name) -> Instance``.

The facts come from the operator's env file (``/etc/gemma4-vllm/<name>.env``, through the one
env-file parser) and the profile it names; never from generated shell. Cutover, status and
re-install use this record. :mod:`appliance.instance_facts` (doctor, bench) is built on it: it
reads the env file with the same parser and builds this record with :func:`from_env`, adding
what the host says (unit, container), and reports an env file this refuses as a check.

    inst = instance.read(Path("/"), "31b")
    inst.profile.name, inst.image, inst.base_url, inst.api_key()
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import profiles
from ..errors import UsageError
from ..host import envfile, values
from ..host.envfile import HOST_KEY, PORT_KEY, PROFILE_KEY
from ..host.layout import Layout
from ..host.names import container_name, unit_name
from ..host.values import check_host, check_port
from ..profiles import Profile


@dataclass(frozen=True)
class Instance:
    """One installed instance of ``gemma4-vllm@.service``.

    ``name``: the unit's instance (``%i``); ``unit``, ``container``: its systemd unit and Docker
    container. ``profile``: the shipped profile ``APPLIANCE_PROFILE`` names. ``image``:
    ``VLLM_IMAGE`` (None when unset). ``host``, ``port``: where vLLM binds (``VLLM_HOST``,
    ``VLLM_PORT``). ``env``: the env file as read (its bytes, for a byte-preserving rewrite).
    ``env_path``, ``args_path``, ``api_key_path``: the instance's files under the root.
    """

    name: str
    profile: Profile
    image: str | None
    host: str
    port: int
    env: envfile.EnvFile
    args_path: Path
    api_key_path: Path

    @property
    def unit(self) -> str:
        return unit_name(self.name)

    @property
    def container(self) -> str:
        return container_name(self.name)

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
        rule of :mod:`appliance.apikey`, so an unreadable, empty or unsafe file is an error."""
        from .. import apikey  # here: apikey imports host.layout

        return apikey.read(self.api_key_path)


def read(root: Path | str, name: str) -> Instance:
    """The facts of instance ``name`` installed under ``root`` (``/`` on a host).

    Errors, each naming the file: no env file (install first); a line systemd could read
    differently; no ``APPLIANCE_PROFILE``, ``VLLM_HOST`` or ``VLLM_PORT`` (re-run install,
    which writes them); an unknown profile; a host or
    port that is not one.
    """
    return from_env(root, name, envfile.read(Layout(Path(root)).env_file(name)))


def from_env(root: Path | str, name: str, env: envfile.EnvFile) -> Instance:
    """The record of instance ``name`` from its env file ``env``, already read (errors as
    :func:`read`)."""
    root = Path(root)
    layout = Layout(root)
    upgrade = f"re-run `appliance install {name} --profile PROFILE` (it upgrades in place)"

    def required(key: str) -> str:
        value = env.get(key)
        if not value:
            raise UsageError(f"{key} is not set in {env.path}", fix=upgrade)
        return value

    profile = profiles.installed(root, name, required(PROFILE_KEY))
    host = check_host(host_text := required(HOST_KEY), f"{HOST_KEY}={host_text!r} in {env.path}")
    port_text = required(PORT_KEY)
    port = check_port(port_text, f"{PORT_KEY}={port_text!r} in {env.path}")
    return Instance(
        name=name,
        profile=profile,
        image=env.get(envfile.IMAGE_KEY) or None,
        host=host,
        port=port,
        env=env,
        args_path=layout.args_file(name),
        api_key_path=layout.served_key_file(name),
    )
