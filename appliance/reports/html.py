"""The report file: refuse an unwritable path before any work, write the page atomically, and
load a bench artifact back to render it again (the pages: :mod:`.bench_page`, :mod:`.demo_page`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..bench import report as bench_report
from ..errors import UsageError
from ..fsutil import write_atomic


def check_target(path: Path | str, option: str = "--report") -> Path:
    """Refuse, before any work, a report path that cannot be written (a file in the way)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(
            f"{option} {path} is a directory", fix="give a file name, e.g. report.html"
        )
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(
            f"{option} {path}: {parent} is not a writable directory",
            fix="choose a path in a writable directory",
        )
    return path


def write(path: Path | str, page: str) -> Path:
    """Replace ``path`` with the rendered page atomically (never a half-written file)."""
    return write_atomic(path, page, mode=0o644)


def load_artifact(path: Path | str) -> dict:
    """A bench artifact from its JSON file, to render it again later (checked: a wrong type is
    one UsageError naming the file and the field)."""
    return bench_report.load(path).to_dict()
