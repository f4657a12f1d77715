"""The observability plane as files an operator runs: ``deploy/observability/compose.yaml`` with
the ``prometheus/`` and ``grafana/`` folders it mounts, written out of the checkout or the
installed package (:mod:`appliance.assets`) into a folder of the operator's choosing.

The layout is the repository's, so the compose file's relative mounts (``../../prometheus``)
resolve unchanged: ``docker compose -f OUT/deploy/observability/compose.yaml up -d``.

A plane is the operator's once written: ``prometheus/alertmanager.yml`` says to edit its receiver
in place, and secrets go beside it. A later write (a new appliance release) therefore updates it
the way dpkg updates a conffile: the marker file records the hash of every file as written, so a
file still as written is replaced, a file the operator changed is kept (the new one goes beside
it as ``NAME.new``, with the diff shown; ``force`` replaces it and keeps theirs as ``NAME.old``),
and a file the operator added is never touched.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from .. import assets
from ..errors import UsageError
from ..fsutil import check_target, write_atomic

FOLDERS = ("deploy/observability", "prometheus", "grafana")
COMPOSE = "deploy/observability/compose.yaml"
# Marks a folder this wrote, with the hash of each file as written (JSON): only such a folder
# is written again, and only the files in it that are still as written are replaced.
MARKER = ".gemma4-appliance-plane"
_IGNORED = ("__pycache__", "tests")
NEW, OLD = ".new", ".old"


@dataclasses.dataclass(frozen=True)
class Kept:
    """A file the operator changed, left as they made it; the shipped one is ``new`` beside."""

    path: Path
    new: Path
    diff: str


@dataclasses.dataclass(frozen=True)
class Written:
    """What a write did: the compose file to run, files kept as the operator changed them, and
    (with ``force``) the operator's copies of the files replaced."""

    compose: Path
    kept: tuple[Kept, ...] = ()
    saved: tuple[Path, ...] = ()


def shipped(source: Path | None = None) -> dict[str, bytes]:
    """The plane's files, relative path -> content, from ``source`` (default: the appliance's
    own files, :func:`appliance.assets.root`)."""
    source = Path(source) if source is not None else assets.root()
    files = {}
    for folder in FOLDERS:
        for path in sorted((source / folder).rglob("*")):
            rel = path.relative_to(source)
            if path.is_file() and not (set(rel.parts) & set(_IGNORED)) and path.suffix != ".pyc":
                files[rel.as_posix()] = path.read_bytes()
    return files


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _marker(files: dict[str, bytes]) -> str:
    record = {
        "written_by": "appliance observability write",
        "files": {rel: _digest(data) for rel, data in sorted(files.items())},
    }
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def _as_written(out: Path) -> dict[str, str] | None:
    """The hashes the last write recorded; {} for a plane written before they were (every file
    that differs then counts as the operator's); None when ``out`` holds no plane."""
    try:
        text = (out / MARKER).read_text()
    except FileNotFoundError:
        return None
    try:
        files = json.loads(text).get("files", {})
    except (ValueError, AttributeError):
        return {}
    return files if isinstance(files, dict) else {}


def write(out: Path, *, force: bool = False, source: Path | None = None) -> Written:
    """Write the plane into ``out``: a new or empty folder, or one holding a plane written before.

    A new plane is atomic (a temporary folder beside ``out`` renamed into place). Over a plane,
    each file is replaced atomically when it is still as the last write left it; one the
    operator changed is kept and the shipped one written beside it (``NAME.new``) when it
    changed since; ``force`` replaces every changed file, keeping theirs as ``NAME.old``. Files
    the operator added stay.
    """
    out = Path(out)
    check_target(out, "--out", directory=True)
    files = shipped(source)
    if out.is_dir() and any(out.iterdir()):
        recorded = _as_written(out)
        if recorded is None:
            raise UsageError(
                f"{out} exists and is not a plane written by `appliance observability write`",
                fix="name a new or empty folder",
            )
        return _update(out, files, recorded, force)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        (tmp / MARKER).write_text(_marker(files))
        _modes(tmp)
        tmp.rename(out)  # onto a missing or empty folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Written(out / COMPOSE)


def _modes(tree: Path) -> None:
    """0755 folders and 0644 files whatever the umask: the plane's containers run as their
    images' own users and read the mounts."""
    tree.chmod(0o755)
    for path in tree.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _update(out: Path, files: dict[str, bytes], recorded: dict[str, str], force: bool) -> Written:
    for rel in files:
        if (out / rel).is_dir() and not (out / rel).is_symlink():
            raise UsageError(
                f"{out / rel} is a folder where the plane has a file",
                fix="move it away, then write again",
            )
    kept, saved = [], []
    for rel, new in files.items():
        path = out / rel
        try:
            current = path.read_bytes()
        except FileNotFoundError:
            current = None
        if current == new:
            continue
        as_written = current is not None and recorded.get(rel) == _digest(current)
        unchanged_upstream = recorded.get(rel) == _digest(new)
        if current is None or as_written:
            _lay(path, new)
        elif force:
            old = path.with_name(path.name + OLD)
            write_atomic(old, current, mode=path.stat().st_mode & 0o7777)
            _lay(path, new)
            saved.append(old)
        elif unchanged_upstream:
            continue  # the operator's change stands: nothing new to offer
        else:
            beside = path.with_name(path.name + NEW)
            _lay(beside, new)
            kept.append(Kept(path, beside, _diff(rel, current, new)))
    write_atomic(out / MARKER, _marker(files), mode=0o644)
    return Written(out / COMPOSE, tuple(kept), tuple(saved))


def _lay(path: Path, data: bytes) -> None:
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir()
        folder.chmod(0o755)
    write_atomic(path, data, mode=0o644)


def _diff(rel: str, yours: bytes, new: bytes) -> str:
    lines = difflib.unified_diff(
        yours.decode(errors="replace").splitlines(keepends=True),
        new.decode(errors="replace").splitlines(keepends=True),
        fromfile=f"{rel} (yours)",
        tofile=f"{rel}{NEW} (shipped)",
    )
    return "".join(lines)
