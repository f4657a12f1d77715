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


NOT_ASKED = "not asked"


def ports(root: Path) -> bool:
    """The ports the tree's env files name are the tree's own on this host's network: ``/``,
    or a machine whose systemd the operator named (it runs the tree's units)."""
    return systemd(root)


def gpus(root: Path) -> bool:
    """This host's GPUs (``nvidia-smi``) are the tree's: ``/``, or a machine whose systemd the
    operator named."""
    return systemd(root)


def unasked(said: str) -> bool:
    """Whether ``said`` (a finding, an error's text) is a "not asked" of :func:`why_not`."""
    return said.startswith(NOT_ASKED)


def why_not(root: Path, clause: str) -> str:
    """Why something was not asked: :data:`NOT_ASKED`, the tree, and ``clause`` (e.g. "this
    host's Docker is not the tree's")."""
    return f"{NOT_ASKED}: --root {root} is not this host's /: {clause}"


DOCKER_NOT = "this host's Docker is not the tree's"
GPUS_NOT = "this host's GPUs are not the tree's"
PORT_NOT = "what listens on the tree's port on this host is not its instance"


def port_refusal(root: Path, *, url: bool = True) -> UsageError:
    """The one line a command says when it would have to talk to the tree's instance on this
    host's port and has no answer to give without it (``url``: it takes ``--url``)."""
    given = "give --url the engine's address, or " if url else ""
    return UsageError(
        f"--root {root} is not this host's /: the port its env file names is not the tree's "
        "on this host",
        fix=f"{given}name the tree's systemd in {SYSTEMD_ENV}, or run on the host itself "
        "(--root /)",
    )


def refusal(root: Path, what: str) -> UsageError:
    """The one line a command says when it would need the tree's ``what`` (systemd, Docker)."""
    env = SYSTEMD_ENV if what == "systemd" else DOCKER_ENV
    return UsageError(
        f"--root {root} is not this host's /: its {what} is not the host's, and none is named",
        fix=f"set {env} to the tree's own {what}, or run on the host itself (--root /)",
    )
