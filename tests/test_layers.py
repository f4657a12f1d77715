"""The layers import one way: no cycle between the appliance's packages and modules, none
between the files of one package, nothing imports the command line, and the host layer (names,
env files, layout, locks, systemd) below everything that uses it. The package root holds only
the shared kernels; what serves one thing lives in its folder (docs/architecture.md), and the
low folders (the image contract, what reads the engine, the acceptance judgements) import only
what is below them."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"


def _graph() -> dict[str, set[str]]:
    """First-level part of the package (``cutover``, ``units``, ``errors``...) -> the parts it
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


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:`` (imports for annotations
    only, never run: no cycle at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, parts: list[str], package: bool, runtime: bool = False
) -> list[list[str]]:
    """Every module ``tree`` imports, as dotted parts, in every form: ``import a.b``, ``from a
    import b``, ``from . import b`` and ``from ..a import b`` (each imported name may be a
    module: ``from .. import multinode`` imports ``appliance.multinode``). ``runtime``: not
    those under ``if TYPE_CHECKING:``."""
    found = []
    for node in _runtime_nodes(tree) if runtime else ast.walk(tree):
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


def _modules() -> dict[tuple[str, ...], Path]:
    """Every module of the appliance by its dotted parts (a package by its own, for its
    ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[tuple(parts)] = path
    return out


def _file_graphs() -> dict[tuple[str, ...], dict[str, set[str]]]:
    """Per package, its files (by module name) -> the files of the same package they import
    at run time (``if TYPE_CHECKING:`` bodies skipped). An import of a name that is no module
    (``from . import ModelSpec``) is an import of the package's ``__init__``."""
    modules = _modules()
    graphs: dict[tuple[str, ...], dict[str, set[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(set)
    )
    for parts, path in modules.items():
        is_init = path.name == "__init__.py"
        package = parts if is_init else parts[:-1]
        here = "__init__" if is_init else parts[-1]
        tree = ast.parse(path.read_text())
        for target in _imports(tree, list(parts), is_init, runtime=True):
            while target and tuple(target) not in modules:
                target = target[:-1]  # a name inside a module: the module
            if tuple(target[:-1]) == package:
                graphs[package][here].add(target[-1])
            elif tuple(target) == package and not is_init:
                graphs[package][here].add("__init__")
    for graph in graphs.values():
        for node, targets in graph.items():
            targets.discard(node)
    return graphs


def test_no_import_cycle_between_the_files_of_one_package():
    for package, graph in sorted(_file_graphs().items()):
        # A package's __init__ importing its own files is how a package presents them; the
        # cycle that matters is two files (or more) needing each other.
        files = {
            n: {t for t in ts if t != "__init__"} for n, ts in graph.items() if n != "__init__"
        }
        cycle = _cycle(files)
        assert cycle is None, f"{'.'.join(package)}: " + " -> ".join(cycle)


def test_nothing_imports_the_command_line():
    """``appliance.cli`` parses options and calls the library (docs/architecture.md); no
    library module reaches back into it."""
    importers = sorted(
        ".".join(parts)
        for parts, path in _modules().items()
        if parts[:2] != ("appliance", "cli")
        and any(
            t[:2] == ["appliance", "cli"]
            for t in _imports(ast.parse(path.read_text()), list(parts), path.name == "__init__.py")
        )
    )
    assert importers == []


def test_type_checking_imports_are_no_run_time_edge():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .where import Location\n"
        "else:\n    from . import cache\nimport typing\nif typing.TYPE_CHECKING:\n"
        "    from . import verify\n"
    )
    got = _imports(tree, ["appliance", "models", "verify"], package=False, runtime=True)
    assert sorted(got) == [
        ["appliance", "models", "cache"],
        ["typing"],
        ["typing", "TYPE_CHECKING"],
    ]
    assert ["appliance", "models", "where", "Location"] in _imports(
        tree, ["appliance", "models", "verify"], package=False
    )


def test_no_import_cycle_between_the_packages():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_host_layer_imports_only_the_base_modules():
    assert _graph()["host"] <= {"errors", "fsutil"}


# The modules that stay at the package root: no domain of their own, used across the folders.
KERNELS = {"errors", "fsutil", "records", "progress", "tables", "jsonl", "assets"}


def test_the_package_root_holds_only_the_shared_kernels():
    """A module that serves one thing goes into that thing's folder (issue 55): a new loose
    module at the root is a decision, made here."""
    loose = {
        parts[1]
        for parts, path in _modules().items()
        if len(parts) == 2 and path.parent == PACKAGE and path.name != "__init__.py"
    }
    assert loose == KERNELS


def test_the_kernels_import_only_the_errors():
    edges = _graph()
    for kernel in sorted(KERNELS):
        assert edges[kernel] <= {"errors"}, kernel


def test_the_low_folders_import_only_what_is_below_them():
    """The image contract (``oci``) and what reads the engine (``engine_api``) import no folder
    above them: the serve program carries parts of both, and the agent imports the engine's
    readers and installs light (ADR 0020); the acceptance judgements (``judge``) build on the
    engine's counters only, nothing of the gates that use them."""
    edges = _graph()
    assert edges["oci"] <= {"errors"}
    assert edges["engine_api"] <= {"errors", "oci"}
    assert edges["judge"] <= {"errors", "engine_api"}


def test_the_grouping_folders_init_is_a_docstring_only():
    """``engine_api``, ``oci``, ``judge``, ``instance`` and ``dev`` only group their files: their
    ``__init__`` imports nothing (the serve program carries two of them)."""
    for name in ("engine_api", "oci", "judge", "instance", "dev"):
        body = ast.parse((PACKAGE / name / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), name
        assert isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)


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


def test_the_models_files_need_each_other_in_one_direction():
    """S8's cycle: ``where`` took ``hub_fix`` from ``verify``, which types its argument with
    ``where.Location``; the fix now lives in the package's ``__init__``."""
    graph = _file_graphs()[("appliance", "models")]
    assert "verify" not in graph["where"]


def test_a_cycle_is_found_when_there_is_one():
    assert _cycle({"units": {"cutover"}, "cutover": {"host", "units"}}) == [
        "cutover",
        "units",
        "cutover",
    ]
