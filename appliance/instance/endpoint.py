"""Which engine a command talks to: an installed instance by name, or a URL.

Every command that talks to an engine (doctor, bench, canary record) takes the same choices:
``NAME`` (or ``--instance NAME``), ``--url``, ``--profile`` and the API key options. An instance
name supplies what its env file and key file say: the URL it serves on (``VLLM_HOST`` and
``VLLM_PORT``), its profile and its key. What the operator types on the command line wins over
the instance; the instance wins over ``APPLIANCE_URL`` in the environment (an exported URL must
not send ``doctor 31b`` to another engine); with neither, the engine is the one on
``DEFAULT_URL``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import profiles
from ..errors import ApplianceError, UsageError
from ..host import apikey, reach
from ..host.envfile import UnknownInstance, unknown_instance
from ..profiles import Profile
from ..units import instance as instances

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Endpoint:
    """An engine to talk to: ``url`` (None only when the caller passed ``default=None`` and
    nothing named one), the ``profile`` to check it against (None: neither given nor installed),
    the ``api_key`` to send, the ``instance`` it is (None: a bare URL) under ``root``."""

    url: str | None
    profile: Profile | None
    api_key: apikey.ApiKey | None
    instance: str | None
    root: Path = Path("/")
    # False: ``url`` is the port a tree's env file names, on this host, where the tree is not
    # the host (host/reach.py): whatever listens there is not the tree's instance; not asked.
    reachable: bool = True

    def require_reachable(self) -> None:
        """Refuse (one line, exit 2) a command that must talk to an engine it may not ask."""
        if not self.reachable:
            raise reach.port_refusal(self.root)

    @property
    def secret(self) -> str | None:
        """The key's value, for a client's header (never printed)."""
        return self.api_key.value if self.api_key else None


def pick_instance(positional: str | None, option: str | None) -> str | None:
    """The instance named by ``NAME`` or ``--instance`` (the same name twice is fine)."""
    if positional and option and positional != option:
        raise UsageError(f"two instances named: {positional!r} and --instance {option!r}")
    return positional or option


def resolve(
    *,
    instance: str | None = None,
    url: str | None = None,
    env_url: str | None = None,
    profile_name: str | None = None,
    api_key: str | None = None,
    api_key_file: Path | None = None,
    root: Path = Path("/"),
    default: str | None = DEFAULT_URL,
) -> Endpoint:
    """The endpoint the options name.

    ``url``: given on the command line (wins); ``env_url``: from ``APPLIANCE_URL`` (used only
    without an instance). An instance whose URL is needed but cannot be read (not installed, its
    env file refused) is a UsageError naming the file; with ``url`` given, the instance only
    lends its key (and its profile, when its env file names one).
    """
    # A shipped profile's name, or the operator's profile file (bench and tune measure a copy).
    profile = profiles.lookup(profile_name) if profile_name else None
    key = apikey.resolve(api_key, api_key_file, instance, root)
    if instance is None:
        told = bool(url or env_url) or reach.ports(root)
        return Endpoint(url or env_url or default, profile, key, None, root, told)
    try:
        inst = instances.read(root, instance)
    except ApplianceError as exc:
        if url:  # the URL was given: the instance lends its key; doctor reports its files
            return Endpoint(url, profile, key, instance, root)
        if isinstance(exc, UnknownInstance):
            raise unknown_instance(instance, exc.path, alternative="give --url") from None
        raise UsageError(
            f"cannot tell where instance {instance} serves: {exc.message}",
            fix=f"{exc.fix}, or give --url" if exc.fix else "or give --url",
        ) from None
    # The instance's own port is its own only on its host (or a machine named as the tree's).
    reachable = bool(url) or reach.ports(root)
    return Endpoint(url or inst.base_url, profile or inst.profile, key, instance, root, reachable)
