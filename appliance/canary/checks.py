"""Checks a program can run on an answer: an exact value, a regex, JSON of an expected shape.

A check is written in the canary set as ``"check": {"exact": "391"}``, ``{"regex": "..."}`` or
``{"json": SHAPE}``. A SHAPE is a type name (``string``, ``integer``, ``number``, ``boolean``,
``null``, ``any``), an object ``{"key": SHAPE, ...}`` (those keys required, others allowed) or a
one-item array ``[SHAPE]`` (a non-empty array whose every item has that shape). Checks are
validated when the set is loaded, so a typo is refused before any request is sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("exact", "regex", "json")
TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "any": lambda v: True,
}
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)


@dataclass(frozen=True)
class Check:
    """One programmatic check: ``kind`` in :data:`KINDS` and its expected value or pattern."""

    kind: str
    expected: object

    def passes(self, text: str) -> bool:
        """True when ``text`` (a model's answer) satisfies the check."""
        if self.kind == "exact":
            # Surrounding whitespace and one closing full stop are not part of a value.
            return text.strip().removesuffix(".").strip() == self.expected
        if self.kind == "regex":
            return re.search(str(self.expected), text, re.MULTILINE) is not None
        try:
            value = json.loads(_unfence(text))
        except ValueError:
            return False
        return matches(value, self.expected)

    def to_dict(self) -> dict:
        return {self.kind: self.expected}


def parse(spec: object) -> Check:
    """A :class:`Check` from its JSONL form; a ValueError or TypeError says what is wrong."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"'check' must be one of {{{', '.join(KINDS)}: ...}}")
    ((kind, expected),) = spec.items()
    if kind == "exact":
        if not isinstance(expected, str) or not expected.strip():
            raise ValueError("'check.exact' must be a non-empty string")
        return Check(kind, expected.strip())
    if kind == "regex":
        if not isinstance(expected, str) or not expected:
            raise ValueError("'check.regex' must be a non-empty string")
        try:
            re.compile(expected)
        except re.error as exc:
            raise ValueError(f"'check.regex' does not compile: {exc}") from exc
        return Check(kind, expected)
    if kind == "json":
        _validate_shape(expected, "check.json")
        return Check(kind, expected)
    raise ValueError(f"unknown check {kind!r} (known: {', '.join(KINDS)})")


def matches(value: object, shape: object) -> bool:
    """True when the parsed JSON ``value`` has ``shape``."""
    if isinstance(shape, str):
        return TYPES[shape](value)
    if isinstance(shape, dict):
        return isinstance(value, dict) and all(
            k in value and matches(value[k], s) for k, s in shape.items()
        )
    return isinstance(value, list) and bool(value) and all(matches(v, shape[0]) for v in value)


def _validate_shape(shape: object, where: str) -> None:
    if isinstance(shape, str):
        if shape not in TYPES:
            raise ValueError(f"'{where}': unknown type {shape!r} (known: {', '.join(TYPES)})")
    elif isinstance(shape, dict):
        if not shape:
            raise ValueError(f"'{where}': an object shape needs at least one key")
        for k, s in shape.items():
            _validate_shape(s, f"{where}.{k}")
    elif isinstance(shape, list):
        if len(shape) != 1:
            raise ValueError(f"'{where}': an array shape has exactly one item shape")
        _validate_shape(shape[0], f"{where}[]")
    else:
        raise TypeError(f"'{where}': a shape is a type name, an object or a one-item array")


def _unfence(text: str) -> str:
    """The answer without a Markdown code fence around it (models add one unasked)."""
    text = text.strip()
    m = _FENCE.match(text)
    return m.group(1) if m else text
