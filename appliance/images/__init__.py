"""Appliance images: the CPU and GPU Dockerfiles' build, the tag scheme, listing and pruning.

- :mod:`.build`: build a target with the Docker SDK (cached by a digest of every input);
- :mod:`.base`, :mod:`.wheelhouse`, :mod:`.lock`: the CPU images' offline inputs;
- :mod:`.scheme`: the tags (``<vllm>-mtp``, ``mtp``, ``latest``, ``pre-mtp``; ``-cpu`` for a CPU
  image);
- :mod:`.variant`: whether an image's build (CPU or CUDA) fits a profile;
- :mod:`.choice`: the image a new instance gets when none is named;
- :mod:`.inventory`: images, labels, and which instance refers to which image;
- :mod:`.prune`: removal that never touches a referenced image;
- :mod:`.archive`: `docker save` archives for hosts without a registry, the ID verified on load.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ApplianceError
from ..host import reach


class DockerUnavailable(ApplianceError):
    """The Docker engine cannot be reached."""


class EngineRefused(ApplianceError):
    """The Docker engine refused to remove or tag an image (in use, conflicting, invalid)."""


def refused(action: str, exc, fix: str | None = None) -> EngineRefused:
    """An :class:`EngineRefused` for a ``docker.errors.APIError``, as one line."""
    why = " ".join(str(exc.explanation or exc).split())
    return EngineRefused(f"cannot {action}: the Docker engine refused: {why}", fix=fix)


def client(timeout: int = 1800, root: Path = Path("/")):
    """A Docker SDK client for the local engine (``DOCKER_HOST`` or the default socket); for a
    ``root`` other than ``/``, only the tree's own, named by ``DOCKER_HOST`` (host/reach.py):
    an image prune of a test tree must not judge the host's images by the tree's references."""
    import docker.errors

    import docker

    if not reach.docker(root):
        raise reach.refusal(root, "Docker")

    try:
        c = docker.from_env(timeout=timeout)
        c.ping()
    except docker.errors.DockerException as exc:
        raise DockerUnavailable(
            f"cannot reach the Docker engine: {exc}",
            fix="start dockerd (or set DOCKER_HOST)",
        ) from exc
    return c


def reachable(root: Path = Path("/"), timeout: int = 10):
    """The Docker engine of ``root``'s host, or None when it has none a command may ask
    (host/reach.py) or it does not answer (install and the host check then go without it)."""
    if not reach.docker(root):
        return None
    try:
        return client(timeout=timeout, root=root)
    except ApplianceError:
        return None
