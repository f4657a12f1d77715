"""The canary set: the shipped one (package data) and an operator's JSONL that extends or
replaces it.

One JSON object per line, blank lines skipped::

    {"id": "task-multiply", "kind": "task", "prompt": "What is 17 times 23? ...",
     "check": {"exact": "391"}}
    {"id": "ops-1", "messages": [{"role": "system", "content": "..."}, {"role": "user", ...}]}

``id`` is required and unique (the before and after records are matched by it); ``kind`` is one of
:data:`KINDS` (a label for the report; default ``custom``); ``check`` (see
:mod:`appliance.canary.checks`) makes the case count in the task pass rate. Unknown keys are
refused, so a misspelt ``check`` cannot silently drop a task. The whole set is parsed before
anything is sent: one bad line refuses the set with one line naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .. import jsonl
from ..errors import UsageError
from . import checks

KINDS = ("prose", "code", "structured", "task", "custom")
SHIPPED_FILE = "canary.jsonl"
_KEYS = {"id", "kind", "prompt", "messages", "check"}


@dataclass(frozen=True)
class Case:
    """One canary prompt: its id, label, the chat messages sent, and an optional check."""

    id: str
    kind: str
    messages: tuple[dict, ...]
    check: checks.Check | None = None

    def to_dict(self) -> dict:
        out: dict = {"id": self.id, "kind": self.kind, "messages": list(self.messages)}
        if self.check is not None:
            out["check"] = self.check.to_dict()
        return out


@dataclass(frozen=True)
class CanarySet:
    """A non-empty list of cases with unique ids, and the files it came from."""

    cases: tuple[Case, ...]
    sources: tuple[str, ...]

    @property
    def tasks(self) -> int:
        """How many cases carry a check."""
        return sum(c.check is not None for c in self.cases)

    def digest(self) -> str:
        """sha256 of the cases as sent and checked: two records of one set share it."""
        body = json.dumps([c.to_dict() for c in self.cases], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()


def parse_jsonl(text: str, name: str) -> tuple[Case, ...]:
    """Every case in ``text`` (the content of file ``name``); errors name the file and line."""
    out: list[Case] = []
    seen: dict[str, int] = {}
    for lineno, where, obj in jsonl.records(text, name):
        case = _case(obj, where)
        if case.id in seen:
            raise UsageError(f"{where}: id {case.id!r} already used on line {seen[case.id]}")
        seen[case.id] = lineno
        out.append(case)
    if not out:
        raise UsageError(f"{name} has no canary cases", fix="one JSON object per line")
    return tuple(out)


def _case(obj: object, where: str) -> Case:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}", fix=_fix())
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid.strip():
        raise UsageError(f"{where}: needs a non-empty string 'id'")
    kind = obj.get("kind", "custom")
    if kind not in KINDS:
        raise UsageError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise UsageError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    if "messages" in obj:
        msgs = obj["messages"]
        if not (isinstance(msgs, list) and msgs and all(_is_message(m) for m in msgs)):
            raise UsageError(
                f"{where}: 'messages' must be a non-empty list of {{role, content}} strings"
            )
        messages = tuple({"role": m["role"], "content": m["content"]} for m in msgs)
    else:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise UsageError(f"{where}: 'prompt' must be a non-empty string")
        messages = ({"role": "user", "content": prompt},)
    check = None
    if "check" in obj:
        try:
            check = checks.parse(obj["check"])
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{where}: {exc}") from exc
    elif kind == "task":
        raise UsageError(f"{where}: a 'task' needs a 'check'")
    return Case(cid.strip(), kind, messages, check)


def _is_message(m: object) -> bool:
    return (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        and bool(m["content"])
    )


def _fix() -> str:
    return f"keys: {', '.join(sorted(_KEYS))}"


def shipped() -> CanarySet:
    """The canary set shipped with the appliance."""
    res = resources.files(__package__).joinpath("data", SHIPPED_FILE)
    return CanarySet(parse_jsonl(res.read_text(encoding="utf-8"), SHIPPED_FILE), (SHIPPED_FILE,))


def load_file(path: Path | str) -> tuple[Case, ...]:
    """The cases of an operator's JSONL file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read canary file {path}: {exc}") from exc
    return parse_jsonl(text, str(path))


def resolve(files: tuple[Path, ...] | list[Path] = (), *, replace: bool = False) -> CanarySet:
    """The set to run: the shipped cases, extended by ``files`` (or replaced, with ``replace``).

    Every file is parsed before this returns, and ids must stay unique across all of them.
    """
    if replace and not files:
        raise UsageError("replacing the shipped canary set needs a canary file")
    base = () if replace else shipped().cases
    sources = [] if replace else [SHIPPED_FILE]
    cases = list(base)
    owner = {c.id: SHIPPED_FILE for c in base}
    for f in files:
        for c in load_file(f):
            if c.id in owner:
                raise UsageError(
                    f"{f}: id {c.id!r} is already in {owner[c.id]}",
                    fix="give it another id, or replace the shipped set",
                )
            owner[c.id] = str(f)
            cases.append(c)
        sources.append(str(f))
    return CanarySet(tuple(cases), tuple(sources))
