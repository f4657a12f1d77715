"""Reading an operator's JSONL file: one JSON value a line, every error naming file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator

from .errors import UsageError


def records(text: str, name: str) -> Iterator[tuple[int, str, object]]:
    """``(line number, "NAME line N", value)`` for each non-blank line of ``text`` (file ``name``).

    A line that is not JSON is a UsageError naming the file and the line.
    """
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: invalid JSON ({exc.msg})") from exc
        yield lineno, where, value
