"""The one way the CLI prints a table: a header row, columns as wide as their widest cell.

Numbers read best right-aligned, words left-aligned: ``align`` gives one ``<`` or ``>`` per
column. The last column is not padded (a free-text column such as a description or tags).
"""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """``headers`` and ``rows`` as aligned text lines, two spaces between columns."""
    align = align or "<" * len(headers)
    if len(align) != len(headers) or set(align) - {"<", ">"}:
        raise ValueError(f"align {align!r} does not give < or > for each of {len(headers)} columns")
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    if any(len(r) != len(headers) for r in cells):
        raise ValueError(f"every row needs {len(headers)} cells")
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    last = len(headers) - 1
    lines = []
    for r in cells:
        parts = [
            cell if i == last and a == "<" else f"{cell:{a}{w}}"
            for i, (cell, a, w) in enumerate(zip(r, align, widths))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
