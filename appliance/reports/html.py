"""The report file: write the page atomically, and load a bench artifact back to render it again
(the pages: :mod:`.bench_page`, :mod:`.demo_page`)."""

from __future__ import annotations

from pathlib import Path

from ..bench import report as bench_report
from ..fsutil import write_atomic


def write(path: Path | str, page: str) -> Path:
    """Replace ``path`` with the rendered page atomically (never a half-written file)."""
    return write_atomic(path, page, mode=0o644)


def load_artifact(path: Path | str) -> dict:
    """A bench artifact from its JSON file, to render it again later (checked: a wrong type is
    one UsageError naming the file and the field)."""
    return bench_report.load(path).to_dict()
