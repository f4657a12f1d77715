"""What a command given ``--root`` may reach outside that tree.

A tree other than ``/`` (a test tree, an image being built, a machine's root seen from the host)
is the command's whole world: the host's systemd and Docker are not its own, and a cutover of a
test tree must never restart the production unit of the same name, nor an image prune judge the
host's images by the tree's references. They are reached for ``/``, or for another root only
when the operator names the tree's own: ``APPLIANCE_SYSTEMD_PREFIX`` (a command prefix entering
the tree's systemd) and ``DOCKER_HOST`` (the tree's Docker engine).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError

SYSTEMD_ENV = "APPLIANCE_SYSTEMD_PREFIX"
DOCKER_ENV = "DOCKER_HOST"


def systemd(root: Path) -> bool:
    """The tree under ``root`` has a systemd a command may ask."""
    return Path(root) == Path("/") or bool(os.environ.get(SYSTEMD_ENV, "").strip())


def docker(root: Path) -> bool:
    """The tree under ``root`` has a Docker engine a command may ask."""
    return Path(root) == Path("/") or bool(os.environ.get(DOCKER_ENV, "").strip())


def refusal(root: Path, what: str) -> UsageError:
    """The one line a command says when it would need the tree's ``what`` (systemd, Docker)."""
    env = SYSTEMD_ENV if what == "systemd" else DOCKER_ENV
    return UsageError(
        f"--root {root} is not this host's /: its {what} is not the host's, and none is named",
        fix=f"set {env} to the tree's own {what}, or run on the host itself (--root /)",
    )
