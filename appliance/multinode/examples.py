"""The reviewed examples of a multi-node group, committed under ``systemd/`` beside the
single-node ones (:mod:`appliance.units.examples`): each multi-node profile's group (named after
it) as two hosts render it, the head's (head, probe) and a worker's (rank 1), with each node's
mounts drop-in (``systemd/mounts/<group>-<role>.conf``). The unit templates are the same for
every group."""

from __future__ import annotations

from ..profiles import examples
from ..units.examples import MOUNTS_DIR, example_path
from ..units.template import REL, RenderedFile, rel
from . import Node, render


def example_files() -> dict[str, RenderedFile]:
    """Every group example, keyed by its path in the repository."""
    out: dict[str, RenderedFile] = {}
    for name, profile in sorted(examples().items()):
        if profile.multinode is None:
            continue
        for node in (Node(roles=("head",)), Node(roles=("worker",))):
            files = render(profile, name, node)
            for path, file in files.items():
                if path.endswith((".service", ".timer", ".env", ".args")):
                    out[example_path(path)] = file
            for role in node.roles:
                out[f"{MOUNTS_DIR}/{name}-{role}.conf"] = files[rel(REL.mounts_dropin(name, role))]
    return dict(sorted(out.items()))
