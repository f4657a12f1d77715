"""The reviewed examples committed under ``systemd/``.

:func:`example_files` renders them with :func:`render` for the hand-made profiles and the seed
hosts' generated ones (``profiles.examples``; instance named after the profile), so a reviewer
reads exactly what ``appliance instance install`` writes: the one unit
(``systemd/gemma4-vllm@.service``) and one env file, one args file and one mounts drop-in per
profile (``systemd/env/``, ``systemd/args/``, ``systemd/mounts/``); a multi-node profile's group
is :mod:`appliance.multinode.examples`.
The one serve program is not an example: it is :mod:`appliance.serve`, bundled at install.
``appliance dev generate`` (``appliance.dev.generate``) writes and checks the examples.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from ..profiles import examples
from .template import REL, Options, RenderedFile, rel, render, state_units

UNIT_DIR = "systemd"
ENV_DIR = "systemd/env"
ARGS_DIR = "systemd/args"
MOUNTS_DIR = "systemd/mounts"
# Folders whose every file `appliance dev generate` must produce (appliance.dev.generate).
FOLDERS = (UNIT_DIR, ENV_DIR, ARGS_DIR, MOUNTS_DIR)

# A MIG profile needs its slice: the examples use the first slice of GPU 0.
EXAMPLE_OPTIONS = {"mig24-e4b-mtp": Options(gpus="device=0:0")}


def example_files() -> dict[str, RenderedFile]:
    """Every single-node example and the state units, keyed by its path in the repository."""
    out: dict[str, RenderedFile] = {}
    for name, profile in sorted(examples().items()):
        if profile.multinode is not None:
            continue  # a group: appliance.multinode.examples
        files = render(profile, name, EXAMPLE_OPTIONS.get(name))
        for path in (REL.unit_template, REL.env_file(name), REL.args_file(name)):
            out[example_path(rel(path))] = files[rel(path)]
        out[f"{MOUNTS_DIR}/{name}.conf"] = files[rel(REL.mounts_dropin(name))]
    for path, file in state_units().items():
        out[example_path(path)] = file
    return dict(sorted(out.items()))


def example_path(path: str) -> str:
    """Where a rendered file's example goes: units, env files and args files each in their
    folder under ``systemd/``."""
    p = PurePosixPath(path)
    folder = {".env": ENV_DIR, ".args": ARGS_DIR}.get(p.suffix, UNIT_DIR)
    return f"{folder}/{p.name}"
