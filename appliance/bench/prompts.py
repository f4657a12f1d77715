"""Prompt sets for bench: the shipped prose / code / structured sets, or a user's JSONL file.

One JSON object per line: ``{"id": "...", "prompt": "..."}`` or ``{"id": "...", "messages":
[...]}`` (``id`` optional). Blank lines are skipped. The ``prompt`` form is also what
``vllm bench serve --dataset-name custom`` reads, so the same file feeds both tools.

Acceptance depends on the prompt's shape (free prose drafts well, code and structured output
less so), which is why the sets are separate and reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .. import jsonl
from ..errors import UsageError

SHIPPED = ("prose", "code", "structured")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its id and the chat messages sent for it."""

    id: str
    messages: tuple[dict, ...]

    @property
    def text(self) -> str:
        """The last user message's text (what ``vllm bench serve`` sends as its prompt)."""
        return str(self.messages[-1]["content"])


@dataclass(frozen=True)
class PromptSet:
    """A named, non-empty list of prompts."""

    name: str
    prompts: tuple[Prompt, ...]


def parse_jsonl(text: str, name: str) -> PromptSet:
    """Parse JSONL text into a :class:`PromptSet`; errors name the file and line number."""
    prompts: list[Prompt] = []
    for lineno, where, obj in jsonl.records(text, name):
        prompts.append(_prompt(obj, where, default_id=f"{Path(name).stem}-{lineno}"))
    if not prompts:
        raise UsageError(f"{name} has no prompts", fix="one JSON object per line with a 'prompt'")
    return PromptSet(Path(name).stem, tuple(prompts))


def _prompt(obj: object, where: str, default_id: str) -> Prompt:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    pid = obj.get("id", default_id)
    if "messages" in obj:
        msgs = obj["messages"]
        if not (isinstance(msgs, list) and msgs and all(_is_message(m) for m in msgs)):
            raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        return Prompt(str(pid), tuple(msgs))
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f"{where}: needs a non-empty string 'prompt' (or 'messages')")
    return Prompt(str(pid), ({"role": "user", "content": prompt},))


def _is_message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m


def load_file(path: Path | str) -> PromptSet:
    """Load a user's JSONL prompt file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc}") from exc
    return parse_jsonl(text, str(path))


def shipped(name: str) -> PromptSet:
    """One of the prompt sets shipped with the appliance."""
    if name not in SHIPPED:
        raise UsageError(f"unknown prompt set {name!r}", fix=f"shipped sets: {', '.join(SHIPPED)}")
    res = resources.files(__package__).joinpath("prompts", f"{name}.jsonl")
    return parse_jsonl(res.read_text(encoding="utf-8"), f"{name}.jsonl")


def resolve(
    sets: list[str] | tuple[str, ...] = SHIPPED,
    files: tuple[Path, ...] = (),
    limit: int | None = None,
) -> list[PromptSet]:
    """The prompt sets to run: user files if given, else the named shipped sets.

    ``limit`` keeps the first N prompts of each set (quick runs).
    """
    chosen = [load_file(f) for f in files] if files else [shipped(s) for s in sets]
    if limit is not None:
        if limit < 1:
            raise UsageError("--limit must be at least 1")
        chosen = [PromptSet(s.name, s.prompts[:limit]) for s in chosen]
    return chosen
