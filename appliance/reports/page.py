"""The page machinery every report shares: values that name their record path, charts, templates.

A report page is built from the record its JSON artifact is written from, never the live result
objects, so the page and the artifact cannot disagree. Every value printed is an element carrying
``data-path`` (where in the record it was read) and, for numbers, ``data-fmt``/``data-scale`` (ms
from s, percent from a fraction): the tests resolve each path in the artifact and compare. The
markup and the prose are Jinja templates in ``templates/``, rendered with autoescape on, so a
name from the record (a model, a prompt set) is text on the page, never markup; the one
unescaped insert is matplotlib's own SVG (:mod:`.charts`). No script, no stylesheet or font from
elsewhere: viewable offline.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from .figures import resolve

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Value:
    """One printed value: its text and where in the record it was read.

    ``fmt`` and ``scale`` are set for numbers (the page's ``data-fmt``/``data-scale``, the text
    being ``format(value * scale, fmt)``); ``null`` when the record holds null (printed "-").
    """

    path: str
    text: str = "-"
    null: bool = False
    fmt: str | None = None
    scale: str = "1.0"
    suffix: str = ""


# A table cell: a value, plain text, or a run of both (e.g. "low - high").
Cell = Value | str | list[Value | str]


class Reader:
    """Reads one record into values that name their paths, and the charts in page order."""

    def __init__(self, record: dict) -> None:
        self.record = record
        self.chart_ids: list[str] = []

    def v(self, path: Path_, fmt: str = ".3f", scale: float = 1.0, suffix: str = "") -> Value:
        """The value at ``path``, formatted ("-" when null)."""
        value = resolve(self.record, path)
        dotted = ".".join(str(p) for p in path)
        if value is None:
            return Value(dotted, null=True)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return Value(dotted, str(value))
        text = format(value * scale if scale != 1.0 else value, fmt)
        return Value(dotted, text, fmt=fmt, scale=repr(scale), suffix=suffix)

    def chart(self, chart_id: str, svg: str) -> dict:
        """A chart (matplotlib's SVG, inserted as markup), listed on the page's ``data-charts``."""
        self.chart_ids.append(chart_id)
        return {"id": chart_id, "svg": svg}


@functools.cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("appliance.reports", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.tests["value"] = lambda x: isinstance(x, Value)
    return env


def render(template: str, r: Reader, title: str, **context: Any) -> str:
    """``template`` filled with ``context``, under ``title``, listing ``r``'s charts."""
    return _env().get_template(template).render(title=title, chart_ids=r.chart_ids, **context)


def as_json(record: dict) -> dict:
    """The record exactly as its JSON file reads back (tuples become lists, and so on)."""
    return json.loads(json.dumps(record))


def number(value: Any) -> float | None:
    """``value`` as a float for a chart; None for null, text or a boolean."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def joined(parts: Sequence[Value], sep: str) -> list[Value | str]:
    """One cell of ``parts`` with ``sep`` between them (empty when there are none)."""
    out: list[Value | str] = []
    for i, part in enumerate(parts):
        out += [sep, part] if i else [part]
    return out
