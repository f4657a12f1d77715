"""Typed PromQL builders: every query the dashboards and rules use is built here.

An :class:`Expr` carries its text and the metric names it reads, so the metric-existence check
works on what the builders produced, never on a regex over strings. Ratios are guarded: the
denominator is filtered with ``> 0`` so an idle engine yields *no* series instead of NaN/Inf.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expr:
    """A PromQL expression and the metric names (and recorded series) it reads."""

    text: str
    metrics: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return self.text

    def _join(self, op: str, other: Expr | float | str) -> Expr:
        if isinstance(other, Expr):
            return Expr(f"{self.text} {op} {other.text}", self.metrics | other.metrics)
        return Expr(f"{self.text} {op} {_num(other)}", self.metrics)

    def __gt__(self, other):  # type: ignore[override]
        return self._join(">", other)

    def __lt__(self, other):  # type: ignore[override]
        return self._join("<", other)

    def __ge__(self, other):  # type: ignore[override]
        return self._join(">=", other)

    def eq(self, other: Expr | float) -> Expr:
        return self._join("==", other)

    def __add__(self, other):
        return self._join("+", other)

    def __sub__(self, other):
        return self._join("-", other)

    def __mul__(self, other):
        return self._join("*", other)

    def __radd__(self, other):
        return Expr(f"{_num(other)} + {self.text}", self.metrics)

    def paren(self) -> Expr:
        return Expr(f"({self.text})", self.metrics)

    def and_on(self, other: Expr, on: tuple[str, ...]) -> Expr:
        """``self and on(...) other``: keep ``self`` where ``other`` has a series."""
        return Expr(
            f"{self.text} and on ({', '.join(on)}) {other.text}", self.metrics | other.metrics
        )

    def unless_on(self, other: Expr, on: tuple[str, ...]) -> Expr:
        """``self unless on(...) other``: keep ``self`` where ``other`` has no series."""
        return Expr(
            f"{self.text} unless on ({', '.join(on)}) {other.text}", self.metrics | other.metrics
        )

    def sub_on(self, other: Expr, on: tuple[str, ...]) -> Expr:
        """``self - on(...) group_right () other``: one ``self`` series per ``on`` labels, taken
        from each of ``other``'s; the result keeps ``other``'s labels."""
        return Expr(
            f"{self.text} - on ({', '.join(on)}) group_right () {other.text}",
            self.metrics | other.metrics,
        )

    def mul_on(self, other: Expr, on: tuple[str, ...], group_left: tuple[str, ...]) -> Expr:
        """``self * on(...) group_left(...) other``: copy ``other``'s labels onto ``self``."""
        return Expr(
            f"{self.text} * on ({', '.join(on)}) group_left ({', '.join(group_left)}) {other.text}",
            self.metrics | other.metrics,
        )


def _num(v: float | str) -> str:
    if isinstance(v, str):
        return v
    return repr(v) if not float(v).is_integer() else str(int(v))


@dataclass(frozen=True)
class Selector:
    """A metric with label matchers; ``$var`` values become regex matchers for Grafana's All."""

    metric: str
    matchers: tuple[tuple[str, str, str], ...] = ()

    def where(self, **labels: str) -> Selector:
        """Add matchers; a value starting with ``$`` or containing ``|`` matches as a regex."""
        extra = tuple(
            (k, "=~" if v.startswith("$") or "|" in v else "=", v)
            for k, v in sorted(labels.items())
        )
        return Selector(self.metric, self.matchers + extra)

    @property
    def expr(self) -> Expr:
        inner = ",".join(f'{k}{op}"{v}"' for k, op, v in self.matchers)
        return Expr(f"{self.metric}{{{inner}}}" if inner else self.metric, frozenset({self.metric}))

    def suffixed(self, suffix: str) -> Selector:
        """The same matchers on ``metric + suffix`` (``_bucket``, ``_count``)."""
        return Selector(self.metric + suffix, self.matchers)


def rate(sel: Selector, window: str) -> Expr:
    e = sel.expr
    return Expr(f"rate({e.text}[{window}])", e.metrics)


def increase(sel: Selector, window: str) -> Expr:
    e = sel.expr
    return Expr(f"increase({e.text}[{window}])", e.metrics)


def absent(sel: Selector) -> Expr:
    """``absent(sel)``: one series (the selector's equality labels) while nothing matches."""
    e = sel.expr
    return Expr(f"absent({e.text})", e.metrics)


def agg(op: str, by: tuple[str, ...], inner: Expr) -> Expr:
    """``op by (labels) (inner)``; ``by=()`` aggregates everything."""
    group = f" by ({', '.join(by)})" if by else ""
    return Expr(f"{op}{group} ({inner.text})", inner.metrics)


def sum_rate(sel: Selector, by: tuple[str, ...], window: str) -> Expr:
    return agg("sum", by, rate(sel, window))


def ratio(
    num: Expr, den: Expr, *, on: tuple[str, ...] | None = None, group_left: bool = False
) -> Expr:
    """``num / (den > 0)``: no series while idle, never NaN or Inf."""
    match = ""
    if on is not None:
        match = f" on ({', '.join(on)})" + (" group_left ()" if group_left else "")
    return Expr(f"{num.text} /{match} ({den.text} > 0)", num.metrics | den.metrics)


def histogram_quantile(q: float, sel: Selector, by: tuple[str, ...], window: str) -> Expr:
    """The ``q`` quantile of a histogram, only where the window saw observations.

    ``histogram_quantile`` over all-zero buckets is NaN; the ``and`` on a positive count rate
    drops those series, so idle periods show nothing rather than NaN.
    """
    buckets = sum_rate(sel.suffixed("_bucket"), (*by, "le"), window)
    count = (sum_rate(sel.suffixed("_count"), by, window) > 0).paren()
    q_expr = Expr(f"histogram_quantile({_num(q)}, {buckets.text})", buckets.metrics)
    if by:
        return q_expr.and_on(count, by)
    return Expr(f"{q_expr.text} and {count.text}", q_expr.metrics | count.metrics)


def recorded(name: str, sel_labels: dict[str, str] | None = None) -> Expr:
    """A series produced by one of our recording rules (checked against the rules, not /metrics)."""
    s = Selector(name).where(**(sel_labels or {}))
    return s.expr
