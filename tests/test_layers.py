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
        for target in _imports(ast.parse(path.read_text()), parts, path.name == "__init__.py"):
            if target[0] == "appliance" and len(target) > 1 and target[1] != here:
                edges[here].add(target[1])
    return edges


def _imports(tree: ast.AST, parts: list[str], package: bool) -> list[list[str]]:
    """Every module ``tree`` imports, as dotted parts, in every form: ``import a.b``, ``from a
    import b``, ``from . import b`` and ``from ..a import b`` (each imported name may be a
    module: ``from .. import multinode`` imports ``appliance.multinode``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts if package else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
            else:
                base = []
            module = [*base, *(node.module.split(".") if node.module else [])]
            found += [[*module, alias.name] for alias in node.names]
    return found


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


def test_every_import_form_is_seen():
    tree = ast.parse(
        "import appliance.units\nfrom .. import multinode\nfrom ..host import names\n"
        "from . import gates\n"
    )
    got = _imports(tree, ["appliance", "cutover", "flow"], package=False)
    assert got == [
        ["appliance", "units"],
        ["appliance", "multinode"],
        ["appliance", "host", "names"],
        ["appliance", "cutover", "gates"],
    ]


def test_the_cutover_and_the_units_know_nothing_of_multinode():
    """A group is an instance of another shape, decided by the host layer: the state machine
    and the instance's files import nothing of the group's rendering."""
    edges = _graph()
    assert "multinode" not in edges["cutover"] | edges["units"]


def test_a_cycle_is_found_when_there_is_one():
    assert _cycle({"units": {"cutover"}, "cutover": {"host", "units"}}) == [
        "cutover",
        "units",
        "cutover",
    ]
