"""The reviewed examples committed under ``systemd/``.

:func:`example_files` renders them with :func:`render` for every shipped profile (instance named
after it), so a reviewer reads exactly what ``appliance install`` writes: the one unit
(``systemd/gemma4-vllm@.service``) and one env file, one args file and one mounts drop-in per
profile (``systemd/env/``, ``systemd/args/``, ``systemd/mounts/``); for a multi-node profile,
what ``appliance multinode install`` writes (the head, worker and probe units, the group's env
file, each role's args).
The one serve program is not an example: it is :mod:`appliance.serve`, bundled at install.
``appliance generate`` (``appliance.generate``) writes and checks the examples.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from ..profiles import all_profiles
from .template import Options, RenderedFile, paths, render, state_units

UNIT_DIR = "systemd"
ENV_DIR = "systemd/env"
ARGS_DIR = "systemd/args"
MOUNTS_DIR = "systemd/mounts"
# Folders whose every file `appliance generate` must produce (appliance.generate).
FOLDERS = (UNIT_DIR, ENV_DIR, ARGS_DIR, MOUNTS_DIR)

# A MIG profile needs its slice: the examples use the first slice of GPU 0.
EXAMPLE_OPTIONS = {"mig24-e4b-mtp": Options(gpus="device=0:0")}


def example_files() -> dict[str, RenderedFile]:
    """Every example, keyed by its path in the repository."""
    out: dict[str, RenderedFile] = {}
    for name, profile in sorted(all_profiles().items()):
        if profile.multinode is not None:
            continue  # rendered by appliance.multinode (a head and a worker unit), not here
        p = paths(name)
        files = render(profile, name, EXAMPLE_OPTIONS.get(name))
        out[f"{UNIT_DIR}/{PurePosixPath(p.unit).name}"] = files[p.unit]
        out[f"{ENV_DIR}/{PurePosixPath(p.env).name}"] = files[p.env]
        out[f"{ARGS_DIR}/{PurePosixPath(p.args).name}"] = files[p.args]
        out[f"{MOUNTS_DIR}/{name}.conf"] = files[p.mounts]
    for path, file in state_units().items():
        out[f"{UNIT_DIR}/{PurePosixPath(path).name}"] = file
    out.update(_multinode_files())
    return dict(sorted(out.items()))


def _multinode_files() -> dict[str, RenderedFile]:
    """Each multi-node profile's group (named after it) as two hosts render it: the head's
    (head, probe) and a worker's (rank 1); the unit templates are the same for every group."""
    from .. import multinode  # it builds on this package

    out: dict[str, RenderedFile] = {}
    for name, profile in sorted(all_profiles().items()):
        if profile.multinode is None:
            continue
        for node in (multinode.Node(roles=("head",)), multinode.Node(roles=("worker",))):
            for path, file in multinode.render(profile, name, node).items():
                p = PurePosixPath(path)
                if p.parent == PurePosixPath("etc/systemd/system"):
                    out[f"{UNIT_DIR}/{p.name}"] = file
                elif p.suffix == ".env":
                    out[f"{ENV_DIR}/{p.name}"] = file
                elif p.suffix == ".args":
                    out[f"{ARGS_DIR}/{p.name}"] = file
    return out
