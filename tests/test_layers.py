"""The layers import one way: no cycle between the appliance's packages and modules, and the
host layer (names, env files, layout, locks, systemd) below everything that uses it."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"


def _graph() -> dict[str, set[str]]:
    """First-level part of the package (``cutover``, ``units``, ``apikey``...) -> the parts it
    imports, at any depth and from any place in a file (a function's import counts too)."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        here = parts[1] if len(parts) > 1 else parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = parts if path.name == "__init__.py" else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            else:
                target = (node.module or "").split(".")
            if target[0] == "appliance" and len(target) > 1 and target[1] != here:
                edges[here].add(target[1])
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_the_packages():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_host_layer_imports_only_the_base_modules():
    assert _graph()["host"] <= {"errors", "fsutil"}


def test_a_cycle_is_found_when_there_is_one():
    assert _cycle({"units": {"cutover"}, "cutover": {"host", "units"}}) == [
        "cutover",
        "units",
        "cutover",
    ]
