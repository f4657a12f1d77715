"""Charts as inline SVG text, drawn with matplotlib (Agg backend, no pyplot state).

Text stays text (``svg.fonttype = none``: the viewer's sans-serif font, nothing fetched) and the
output is byte-stable for the same input (fixed hash salt, no date). ADR 0010 says why
matplotlib.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = ("#1f6feb", "#d4a72c", "#2da44e", "#cf222e", "#8250df", "#57606a", "#bf3989", "#0a7f8c")
RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "gemma4-appliance",
    "font.size": 9,
    "font.family": "sans-serif",
    "axes.spines.top": False,
    "axes.spines.right": False,
}

Num = float | None


@functools.cache
def _mpl():
    """matplotlib on the Agg backend, imported on first use (keeps the CLI's start fast); one
    line naming the extra where it is not installed (the ``reports`` extra, ADR 0020)."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"HTML reports draw their charts with matplotlib, which is not installed: no module "
            f"named {exc.name!r}",
            fix="pip install 'gemma4-appliance[reports]'",
        ) from None

    matplotlib.use("Agg")
    return matplotlib


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    with _mpl().rc_context(RC):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    # Inline in HTML: drop the XML prolog and the DOCTYPE (it names an external DTD).
    return text[text.index("<svg") :].strip()


def _figure(width: float = 6.4, height: float = 3.2) -> Figure:
    mpl = _mpl()  # first: the one line above where matplotlib is missing
    from matplotlib.figure import Figure

    with mpl.rc_context(RC):
        return Figure(figsize=(width, height), layout="constrained")


def intervals(
    title: str,
    names: Sequence[str],
    points: Sequence[Num],
    lows: Sequence[Num],
    highs: Sequence[Num],
    xlabel: str,
    reference: float | None = 1.0,
) -> str:
    """One point per name with its interval as a horizontal error bar; a line at ``reference``."""
    with _mpl().rc_context(RC):
        fig = _figure(6.4, 0.6 + 0.55 * len(names))
        ax = fig.add_subplot()
        for i, (p, lo, hi) in enumerate(zip(points, lows, highs, strict=True)):
            if p is None:
                continue
            err = None if lo is None or hi is None else [[p - lo], [hi - p]]
            ax.errorbar([p], [i], xerr=err, fmt="o", color=COLORS[i % len(COLORS)], capsize=5)
        if reference is not None:
            ax.axvline(reference, color="#57606a", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(names)), list(names))
        ax.set_ylim(-0.6, len(names) - 0.4)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title, loc="left")
        return _svg(fig)


def bars(
    title: str,
    categories: Sequence[str],
    series: dict[str, Sequence[Num]],
    ylabel: str,
    *,
    ylim: tuple[float, float] | None = None,
    xlabel: str = "",
) -> str:
    """Grouped bars: one group per category, one bar per series (None draws no bar)."""
    with _mpl().rc_context(RC):
        fig = _figure(6.4, 3.0)
        ax = fig.add_subplot()
        n = max(len(series), 1)
        width = 0.8 / n
        for j, (label, values) in enumerate(series.items()):
            xs = [i + (j - (n - 1) / 2) * width for i, v in enumerate(values) if v is not None]
            ys = [v for v in values if v is not None]
            ax.bar(xs, ys, width=width * 0.95, label=label, color=COLORS[j % len(COLORS)])
        ax.set_xticks(
            range(len(categories)),
            list(categories),
            rotation=30 if len(categories) > 6 else 0,
            ha="right" if len(categories) > 6 else "center",
        )
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_ylabel(ylabel)
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_title(title, loc="left")
        if len(series) > 1:
            ax.legend(frameon=False, fontsize=8, ncols=min(len(series), 4))
        return _svg(fig)


def against_k(
    title: str,
    ks: Sequence[int],
    means: Sequence[Num],
    lows: Sequence[Num],
    highs: Sequence[Num],
    medians: Sequence[Num],
    ylabel: str,
    recommended: int | None,
) -> str:
    """A figure against k: the mean with its 95% interval, the median, the recommended k marked."""
    with _mpl().rc_context(RC):
        fig = _figure(6.4, 3.0)
        ax = fig.add_subplot()
        pts = [
            (k, m, lo, hi)
            for k, m, lo, hi in zip(ks, means, lows, highs, strict=True)
            if m is not None
        ]
        if pts:
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[
                    [p[1] - (p[2] if p[2] is not None else p[1]) for p in pts],
                    [(p[3] if p[3] is not None else p[1]) - p[1] for p in pts],
                ],
                fmt="o-",
                color=COLORS[0],
                capsize=5,
                label="mean, 95% CI",
            )
        med = [(k, m) for k, m in zip(ks, medians, strict=True) if m is not None]
        if med:
            ax.plot(
                [p[0] for p in med], [p[1] for p in med], "s--", color=COLORS[1], label="median"
            )
        if recommended is not None:
            ax.axvline(recommended, color=COLORS[2], linewidth=2, alpha=0.6, label="recommended k")
        ax.set_xticks(list(ks))
        ax.set_xlabel("num_speculative_tokens (k)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, loc="left")
        ax.legend(frameon=False, fontsize=8)
        return _svg(fig)
