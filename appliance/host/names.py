"""Instance names and what they name: the units, the containers and the host folders.

One rule for every place a name is used (unit, files, containers, cutover, fleet): letters,
digits, ``-`` and ``_``, at most 64, starting with a letter or digit, so a name is safe in a
path, a unit name, a container name and a shell word.

An instance has one of two shapes. A single-node instance NAME runs ``gemma4-vllm@NAME`` (its
container ``gemma4-vllm-NAME``). A multi-node group NAME (vLLM's own multi-node) runs, on each
host, the units of the roles that host holds: ``gemma4-vllm-head@NAME`` (node rank 0, the API)
and ``gemma4-vllm-worker@NAME`` (a headless rank); each node is served as the instance
``NAME-head`` or ``NAME-worker`` of the one serve program (its args, key and container).
"""

from __future__ import annotations

import re
from typing import Literal

from ..errors import UsageError

UNIT_TEMPLATE = "gemma4-vllm@.service"
HEAD_TEMPLATE = "gemma4-vllm-head@.service"
WORKER_TEMPLATE = "gemma4-vllm-worker@.service"
PROBE_SERVICE = "gemma4-vllm-probe@.service"
PROBE_TIMER = "gemma4-vllm-probe@.timer"
# The state metrics' timer and its service: one pair per host, whatever the instances (ADR 0016).
STATE_UNIT = "gemma4-appliance-state"
ENV_DIR = "/etc/gemma4-vllm"
DATA_DIR = "/var/lib/gemma4-vllm"
# Rebuildable data (FHS /var/cache: deleting it loses time, never data): the image build's
# rootfs tarballs and wheelhouses, and each instance's vLLM compile cache under vllm/NAME.
CACHE_DIR = "/var/cache/gemma4-appliance"
COMPILE_CACHE_DIR = f"{CACHE_DIR}/vllm"

Role = Literal["head", "worker"]
ROLES: tuple[Role, ...] = ("head", "worker")
# The group name plus "-worker" must stay a valid instance (container and args names).
MAX_GROUP = 64 - len("-worker")

_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def check_instance(name: str) -> str:
    """``name`` if it is a valid instance name, else a UsageError."""
    if not _INSTANCE.fullmatch(name or ""):
        raise UsageError(
            f"invalid instance name {name!r}",
            fix="use letters, digits, '-' and '_' (at most 64), starting with a letter or digit",
        )
    return name


def probe_timer(group: str) -> str:
    """The head's generation probe timer of ``group``."""
    return PROBE_TIMER.replace("@.", f"@{check_instance(group)}.")


def unit_name(instance: str) -> str:
    """The systemd unit of ``instance``."""
    return f"gemma4-vllm@{check_instance(instance)}.service"


def container_name(instance: str) -> str:
    """The Docker container of ``instance``."""
    return f"gemma4-vllm-{check_instance(instance)}"


def check_group(name: str) -> str:
    """``name`` if it is a valid group name (an instance name short enough for its nodes'),
    else a UsageError."""
    check_instance(name)
    if len(name) > MAX_GROUP:
        raise UsageError(f"group name {name!r} is longer than {MAX_GROUP} characters")
    return name


def node_instance(group: str, role: Role) -> str:
    """The serve program's instance of ``role`` in ``group`` (its args, key and container)."""
    return f"{check_group(group)}-{role}"


def node_unit(group: str, role: Role) -> str:
    """The systemd unit of ``role`` in ``group``."""
    return f"gemma4-vllm-{role}@{check_group(group)}.service"


def node_container(group: str, role: Role) -> str:
    """The Docker container of ``role`` in ``group``."""
    return container_name(node_instance(group, role))
