"""Instance names and what they name: the unit, the container and the host folders.

One rule for every place a name is used (unit, files, containers, cutover, fleet): letters,
digits, ``-`` and ``_``, at most 64, starting with a letter or digit, so a name is safe in a
path, a unit name, a container name and a shell word.
"""

from __future__ import annotations

import re

from ..errors import UsageError

UNIT_TEMPLATE = "gemma4-vllm@.service"
ENV_DIR = "/etc/gemma4-vllm"
DATA_DIR = "/var/lib/gemma4-vllm"

_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def check_instance(name: str) -> str:
    """``name`` if it is a valid instance name, else a UsageError."""
    if not _INSTANCE.fullmatch(name or ""):
        raise UsageError(
            f"invalid instance name {name!r}",
            fix="use letters, digits, '-' and '_' (at most 64), starting with a letter or digit",
        )
    return name


def profile_copy(instance: str) -> str:
    """Where an operator's own profile file is installed beside the instance's env file."""
    return f"{ENV_DIR}/{instance}.profile.toml"


def unit_name(instance: str) -> str:
    """The systemd unit of ``instance``."""
    return f"gemma4-vllm@{check_instance(instance)}.service"


def container_name(instance: str) -> str:
    """The Docker container of ``instance``."""
    return f"gemma4-vllm-{check_instance(instance)}"
