"""The observability plane as files an operator runs: ``deploy/observability/compose.yaml`` with
the ``prometheus/`` and ``grafana/`` folders it mounts, written out of the checkout or the
installed package (:mod:`appliance.assets`) into a folder of the operator's choosing.

The layout is the repository's, so the compose file's relative mounts (``../../prometheus``)
resolve unchanged: ``docker compose -f OUT/deploy/observability/compose.yaml up -d``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .. import assets
from ..errors import UsageError

FOLDERS = ("deploy/observability", "prometheus", "grafana")
COMPOSE = "deploy/observability/compose.yaml"
# Marks a folder this wrote: only such a folder is replaced by the next write.
MARKER = ".gemma4-appliance-plane"
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "tests")


def write(out: Path) -> Path:
    """Write the plane into ``out`` and return its compose file. ``out`` must not exist, be
    empty, or hold a plane written before (then it is replaced whole). Atomic: the files go into
    a temporary folder beside ``out`` that is renamed into place; on a failure ``out`` is as it
    was."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise UsageError(
            f"{out} exists and is not a plane written by `appliance observability write`",
            fix="name a new or empty folder",
        )
    source = assets.root()
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        for folder in FOLDERS:
            shutil.copytree(source / folder, tmp / folder, ignore=_IGNORED)
        (tmp / MARKER).write_text("written by `appliance observability write`\n")
        tmp.chmod(0o755)
        if out.exists():
            old = parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / COMPOSE
