"""Reading figures out of artifact records: one accessor, so a key rename is a one-line change.

Records name figures in vLLM's terms (drafts, draft tokens, accepted tokens, acceptance, tokens
per step). :data:`KEYS` maps each figure the report reads to the record keys that hold it, the
current name first; an older name stays listed only while records that use it exist.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# figure -> record keys holding it, in order of preference.
KEYS: dict[str, tuple[str, ...]] = {}

Path = tuple[str | int, ...]


def key(record: Mapping, figure: str) -> str:
    """The key under which ``record`` holds ``figure`` (``figure`` itself when absent)."""
    for k in KEYS.get(figure, (figure,)):
        if k in record:
            return k
    return figure


def get(record: Mapping, figure: str, default: Any = None) -> Any:
    """``figure`` from ``record``; ``default`` when the record does not carry it."""
    return record.get(key(record, figure), default)


def resolve(root: Any, path: Sequence[str | int]) -> Any:
    """The value at ``path`` (record keys and list indices) below ``root``; raises if absent."""
    node = root
    for part in path:
        node = node[part]
    return node
