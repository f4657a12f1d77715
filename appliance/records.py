"""Typed records: pydantic's strict type check of the appliance's records, every wrong value one
:class:`UsageError` line naming where it came from and the field (ADR 0013).

Two ways in, one set of rules and one message. :func:`build` checks a table an operator wrote
(a profile's TOML, already parsed) field by field; :func:`from_json` checks a whole record the
appliance wrote (a history line, a canary record, a soak reading, a model manifest, a bench
artifact), nested records included. No coercion either way: ``"4"`` is no int, ``1`` no bool.
"""

from __future__ import annotations

import functools
import json
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Annotated, Literal

import pydantic

from .errors import UsageError

_SHOWN = 60  # characters of a wrong value kept in the message: one line, even for a big one
# pydantic's errors for a value of the right type that breaks the field's constraint: the
# message is then the field's own rule (:class:`Rule`), whole, not the one bound it crossed.
_CONSTRAINT_ERRORS = frozenset(
    {
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "string_pattern_mismatch",
        "string_too_short",
        "string_too_long",
        "literal_error",
    }
)


@dataclass(frozen=True)
class Rule:
    """What a constrained field's value must be, in words (``"within 1..65535"``): a value
    outside is ``FIELD = VALUE: must be RULE``."""

    text: str


def ranged(kind, rule: str, **constraints):
    """``kind`` with pydantic's ``constraints`` (``ge``, ``le``, ``pattern``...) and the one line
    that says them: ``ranged(int, "within 1..65535", ge=1, le=65535)``."""
    return Annotated[kind, pydantic.Field(**constraints), Rule(rule)]


def one_of(*values: str):
    """A string that is one of ``values``, said as such when it is not."""
    return Annotated[Literal[values], Rule(f"one of {', '.join(values)}")]


def build(cls, data: dict, where: str):
    """``cls(**data)`` once every key is a field of the dataclass ``cls`` and every value has the
    field's type (pydantic's strict check of that one type: ``"four"`` is no int, ``1`` no
    bool); an unknown or missing field, or a wrong value, is one UsageError."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a table, got {data!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {', '.join(unknown)}")
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise UsageError(f"{where}: missing field(s) {', '.join(missing)}")
    hints = typing.get_type_hints(cls, include_extras=True)  # keep Annotated constraints
    for name, value in data.items():
        try:
            _adapter(hints[name]).validate_python(value, strict=True)
        except pydantic.ValidationError as exc:
            raise problem(where, exc, (name,), _rule(hints[name])) from None
    return cls(**data)


def from_json(cls, text: str | bytes, where: str):
    """A ``cls`` (a dataclass, nested ones included, or a pydantic model) from its JSON text,
    by JSON's strict rules: an array for a tuple, an object for a nested record, no coercion.
    Keys that are no field are ignored (a newer appliance's file stays readable); anything
    else wrong is one UsageError naming ``where`` and the field."""
    try:
        return _adapter(cls).validate_json(text, strict=True)
    except pydantic.ValidationError as exc:
        raise problem(where, exc) from None
    except UsageError as exc:  # a record's own check (``__post_init__``), given the place
        raise UsageError(f"{where}: {exc.message}", fix=exc.fix) from None


def from_dict(cls, data, where: str):
    """:func:`from_json` for data already parsed from JSON."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{where}: not JSON data: {exc}") from None
    return from_json(cls, text, where)


def require(data, key: str, want, where: str, fix: str | None = None) -> dict:
    """``data`` when it is a JSON object whose ``key`` (a format or schema marker) is exactly
    ``want``, of its type too (``true`` is no schema 1); else one UsageError."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(data).__name__}", fix=fix)
    got = data.get(key)
    if type(got) is not type(want) or got != want:
        raise UsageError(f"{where}: {key} = {_shown(got)}, not {want!r}", fix=fix)
    return data


def problem(
    where: str, exc: pydantic.ValidationError, prefix: tuple = (), rule: Rule | None = None
) -> UsageError:
    """The first error of ``exc`` as one line: ``WHERE: FIELD = VALUE: REASON`` (the field's
    ``rule`` as the reason when the value is of its type but outside it)."""
    err = exc.errors()[0]
    at = ".".join(map(str, (*prefix, *err["loc"])))
    if err["type"] == "missing":
        return UsageError(f"{where}: missing field {at}")
    if not at:  # the record as a whole (not JSON, not an object, its own check): no value
        return UsageError(f"{where}: {err['msg']}")
    reason = err["msg"]
    if rule is not None and err["type"] in _CONSTRAINT_ERRORS:
        reason = f"must be {rule.text}"
    return UsageError(f"{where}: {at} = {_shown(err['input'])}: {reason}")


def _rule(kind) -> Rule | None:
    """The :class:`Rule` of a field's type, also inside ``X | None``."""
    for meta in getattr(kind, "__metadata__", ()):
        if isinstance(meta, Rule):
            return meta
    for arg in typing.get_args(kind):
        if (found := _rule(arg)) is not None:
            return found
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


@functools.cache
def _adapter(kind) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(kind)
