"""docs/environment.md lists every environment variable the appliance reads, and only those.

The variables are found in the code, not in a list kept beside it: every place in ``appliance/``
that reads the process's environment or an env file by name (``os.environ`` and ``os.getenv``,
click's ``envvar=``, and a mapping called ``env`` or ``*.env``: the serve program's, an
instance's, a profile's, the agent's), plus the keys the env files hold (envfile's ``*_KEY``
names and every key of the committed examples under systemd/env/). A name is read from a
literal, a module constant, a loop over a tuple of them, or a parameter its callers in the module
give one of them; a read the test cannot trace to a name fails, so a new one is either written
traceably or named in :data:`BOUNDED` with the constant that bounds it. Each name the page's
tables list must appear somewhere in the appliance or its image (no variable nobody reads).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from appliance.host import envfile

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "environment.md"
CODE = REPO / "appliance"
NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
KEYED = ("get", "setdefault", "pop", "getenv")
# Reads whose name is runtime data, each bounded by a constant the code checks it against:
# (file, the iterated expression) -> the constant holding every name it can be.
BOUNDED = {
    # argsfile refuses an args file requiring a key outside REQUIRABLE_KEYS.
    ("appliance/serve/environment.py", "args.require"): "REQUIRABLE_KEYS",
}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text(), str(p)) for p in CODE.rglob("*.py")}


def _constants(modules: dict[str, ast.Module]) -> dict[str, list[ast.expr]]:
    """Every module-level ``NAME = value`` of the package, by name (a name may have several)."""
    out: dict[str, list[ast.expr]] = {}
    for tree in modules.values():
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(value)
    return out


class _Resolver:
    """The variable names an expression of one module can hold."""

    def __init__(self, tree: ast.Module, constants: dict[str, list[ast.expr]], path: str) -> None:
        self.tree, self.constants, self.path = tree, constants, path
        self.parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}

    def names(self, node: ast.expr, depth: int = 0) -> set[str] | None:
        """The names ``node`` may be; None when it cannot be traced."""
        if depth > 8:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return self._collect(node, depth)
        ref = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(node, (ast.Name, ast.Attribute)) and ref in self.constants:
            return self._collect_all(self.constants[ref], depth)
        if isinstance(node, ast.Name):
            return self._bound(node, depth)
        return None

    def _collect(self, node: ast.expr, depth: int) -> set[str]:
        """Every name-like string in a literal, through the constants it names."""
        out: set[str] = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                if NAME.fullmatch(sub.value):
                    out.add(sub.value)
            elif isinstance(sub, (ast.Name, ast.Attribute)) and sub is not node:
                ref = sub.id if isinstance(sub, ast.Name) else sub.attr
                if ref in self.constants:
                    out |= self._collect_all(self.constants[ref], depth + 1)
        return out

    def _collect_all(self, values: list[ast.expr], depth: int) -> set[str]:
        out: set[str] = set()
        for v in values:
            out |= self.names(v, depth + 1) or set()
        return out

    def _bound(self, name: ast.Name, depth: int) -> set[str] | None:
        """A loop variable (the names of what it iterates) or a parameter (what the module's
        calls of its function pass), in the innermost function around ``name`` binding it."""
        scope = self.parent.get(name)
        while scope is not None:
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                loops = [
                    n
                    for n in ast.walk(scope)
                    if isinstance(n, (ast.For, ast.comprehension))
                    and name.id in _bound_names(n.target)
                ]
                params = [] if isinstance(scope, ast.Module) else _params(scope)
                if name.id in params:
                    return self._calls(scope.name, params.index(name.id), depth)
                if loops:
                    return self._loops(loops, depth)
            scope = self.parent.get(scope)
        return None

    def _loops(self, loops: list[ast.For | ast.comprehension], depth: int) -> set[str] | None:
        out: set[str] = set()
        for loop in loops:
            what = ast.unparse(loop.iter)
            if (self.path, what) in BOUNDED:
                got = self._collect_all(self.constants[BOUNDED[self.path, what]], depth)
            else:
                got = self.names(loop.iter, depth + 1)
            if got is None:
                return None
            out |= got
        return out

    def _calls(self, function: str, index: int, depth: int) -> set[str] | None:
        calls = [
            n
            for n in ast.walk(self.tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == function
        ]
        out: set[str] = set()
        for call in calls:
            got = self.names(call.args[index], depth + 1) if len(call.args) > index else None
            if got is None:
                return None
            out |= got
        return out if calls else None


def _params(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [a.arg for a in function.args.posonlyargs + function.args.args]


def _bound_names(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _env_like(node: ast.expr) -> bool:
    """``os.environ``/``environ``, or a mapping called ``env`` or ``*.env``."""
    text = ast.unparse(node)
    return text in ("os.environ", "environ", "env") or text.endswith(".env")


def _reads(tree: ast.Module) -> Iterator[tuple[int, ast.expr]]:
    """(line, key expression) of every read of an environment by name in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in KEYED and (
                _env_like(node.func.value) or ast.unparse(node.func) == "os.getenv"
            ):
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and _env_like(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            if _env_like(node.comparators[0]):
                yield node.lineno, node.left
        elif isinstance(node, ast.keyword) and node.arg == "envvar":
            yield node.value.lineno, node.value


def read_in_code() -> tuple[dict[str, set[str]], list[str]]:
    """{variable: the places reading it}, and the reads that could not be traced to a name."""
    modules = _modules()
    constants = _constants(modules)
    found: dict[str, set[str]] = {}
    untraced = []
    for path, tree in sorted(modules.items()):
        resolver = _Resolver(tree, constants, path)
        for line, key in _reads(tree):
            names = resolver.names(key)
            if names is None:
                untraced.append(f"{path}:{line}: {ast.unparse(key)}")
                continue
            for name in names:
                found.setdefault(name, set()).add(f"{path}:{line}")
    return found, untraced


def env_file_keys() -> set[str]:
    """The keys an instance's or a group's env file holds."""
    keys = {
        value
        for name, value in vars(envfile).items()
        if name.endswith("_KEY") and isinstance(value, str)
    }
    for example in sorted((REPO / "systemd" / "env").glob("*.env")):
        keys |= set(envfile.parse(example.read_bytes(), str(example)))
    return keys


def listed() -> set[str]:
    """The names in the first column of the page's tables."""
    names = set()
    for row in re.finditer(r"^\|([^|\n]+)\|", PAGE.read_text(), re.MULTILINE):
        names |= set(re.findall(r"`([A-Z_][A-Z0-9_]*)`", row.group(1)))
    return names


def test_every_read_is_traced_to_a_name():
    _, untraced = read_in_code()
    assert untraced == [], (
        "read an environment variable by a literal or a module constant (or add the read to "
        f"BOUNDED with the constant that bounds it): {untraced}"
    )


def test_the_page_lists_every_variable_the_code_reads_and_every_env_file_key():
    found, _ = read_in_code()
    missing = {n: sorted(at) for n, at in found.items() if n not in listed()}
    missing |= {k: ["an env file"] for k in env_file_keys() - listed()}
    assert missing == {}, f"add to {PAGE.relative_to(REPO)}: {missing}"


def test_the_page_lists_nothing_the_appliance_does_not_read_or_set():
    text = "\n".join(
        p.read_text(errors="replace")
        for folder in (CODE, REPO / "docker")
        for p in folder.rglob("*")
        if p.is_file() and p.suffix in (".py", ".j2", ".sh", ".toml", "")
    )
    phantoms = sorted(n for n in listed() if n not in text)
    assert phantoms == [], f"{PAGE.relative_to(REPO)} lists what nothing reads or sets"


def test_the_scan_is_not_vacuous():
    """The shapes of read the scan must see, each found where it is."""
    found, _ = read_in_code()
    assert "appliance/cli/options.py" in str(found["APPLIANCE_ROOT"])  # envvar=
    assert "appliance/host/reach.py" in str(found["APPLIANCE_SYSTEMD_PREFIX"])  # a constant
    assert "appliance/agent/config.py" in str(found["APPLIANCE_AGENT_SERVERS"])  # a table
    assert "appliance/units/instance.py" in str(found["VLLM_PORT"])  # a parameter
    assert "appliance/serve/environment.py" in str(found["VLLM_GPUS"])  # a bounded loop
    assert "appliance/models/token.py" in str(found["HUGGING_FACE_HUB_TOKEN"])
    assert {"HF_TOKEN", "VLLM_CACHE_DIR", "OTEL_EXPORTER_OTLP_PROTOCOL"} <= set(found)
