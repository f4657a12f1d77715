"""The rules for the values of an instance's env file: address, port, paths, GPU selection.

One rule each, used where the values are written (``appliance instance install``) and where they are
used (the serve program at every start, :mod:`appliance.serve`), so a hand edit of the env file
is refused at start with the same words ``install`` would use. Standard library only: the serve
program runs on the host's own Python.
"""

from __future__ import annotations

import ipaddress
import re

from ..errors import UsageError
from .envfile import GPUS_KEY, HF_CACHE_KEY, MODEL_DIR_KEY, VLLM_CACHE_KEY

# An IPv4/IPv6 address or a host name; never starts with "-" (it would read as a flag). A
# profile's host field has the same rule (appliance.profiles).
HOST_PATTERN = r"[A-Za-z0-9:][A-Za-z0-9.:-]{0,252}"
_HOST = re.compile(HOST_PATTERN)
_GPUS = re.compile(r"all|[0-9]+|device=[A-Za-z0-9:,/_-]+")
_PATH = re.compile(r"/[A-Za-z0-9._/@+-]*")
# The kernel's own trees: a mount of one as a model or cache folder is never meant.
KERNEL_TREES = frozenset({"/proc", "/sys", "/dev"})
ANY_ADDRESS = frozenset({"0.0.0.0", "::"})
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
# The env file's host paths: each becomes a mount of the engine's container.
PATH_KEYS = (MODEL_DIR_KEY, HF_CACHE_KEY, VLLM_CACHE_KEY)
# What an args file may require the env file to set (nothing else is looked up by name).
REQUIRABLE_KEYS = (GPUS_KEY, *PATH_KEYS)


def check_host(host: str, where: str | None = None) -> str:
    """``host`` if it is an IP address or host name vLLM can bind, else a UsageError naming
    ``where`` it came from."""
    if not _HOST.fullmatch(host or ""):
        raise UsageError(
            f"{where or f'host {host!r}'} is not an IP address or host name",
            fix="use e.g. 127.0.0.1, ::1, 0.0.0.0 or a host name (letters, digits, '.:-')",
        )
    return host


def check_port(value: object, where: str = "port") -> int:
    """``value`` as a TCP port (1-65535), else a UsageError naming ``where`` it came from."""
    try:
        port = int(str(value), 10)
    except ValueError:
        port = 0
    if not 0 < port < 65536 or str(value).strip() != str(port):
        raise UsageError(f"{where} is not a TCP port", fix="set a port number from 1 to 65535")
    return port


def check_path(key: str, value: str, where: str | None = None) -> str:
    """``value`` if it is a plain absolute path (it becomes a mount), else a UsageError naming
    ``where`` it came from."""
    if not _PATH.fullmatch(value) or "/../" in value + "/":
        raise UsageError(
            f"{where or f'{key} {value!r}'} is not a plain absolute path",
            fix="use an absolute path of letters, digits and ._/@+-",
        )
    top = "/" + value.strip("/").split("/", 1)[0]
    if top in KERNEL_TREES:
        raise UsageError(
            f"{where or f'{key} {value!r}'} is under {top}, the kernel's: not a folder for "
            "models or caches",
            fix="use a folder on a disk, e.g. under /var/lib or /srv",
        )
    return value


def check_gpus(value: str, where: str | None = None) -> str:
    """``value`` if it is a GPU selection docker's ``--gpus`` takes, else a UsageError."""
    if not _GPUS.fullmatch(value):
        raise UsageError(
            f"{where + ': ' if where else ''}invalid GPU selection {value!r}",
            fix="use all, a count, or device=... (e.g. device=0,1 or device=0:1 for a MIG slice)",
        )
    return value


def probe_host(host: str) -> str:
    """The address to ask for ``/health`` of an engine bound to ``host`` (loopback when it
    listens on every address)."""
    return "127.0.0.1" if host in ANY_ADDRESS else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to connect to) never leaves this host: 127.0.0.0/8, ::1 or
    ``localhost``."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def base_url(host: str, port: int | str) -> str:
    """Where to reach an engine bound to ``host``:``port`` from this host."""
    asked = probe_host(host)
    return f"http://[{asked}]:{port}" if ":" in asked else f"http://{asked}:{port}"
