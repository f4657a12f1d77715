"""Self-contained HTML reports of bench, k-sweep and demo records.

A report is rendered from the very dict the JSON artifact is written from (one source): every
number printed on the page carries the artifact path it was read from (``data-path``), and the
charts are matplotlib SVG embedded inline, so the page needs no network to be viewed.
``render_bench`` and ``render_demo`` return the HTML; ``write`` replaces a file atomically (the
CLI refuses an unwritable path before any work: :class:`appliance.cli.options.OutputPath`).
"""

from __future__ import annotations

from .bench_page import render_bench
from .demo_page import render_demo
from .html import write

__all__ = ["render_bench", "render_demo", "write"]
