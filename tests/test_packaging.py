"""The package installed without extras runs every command: each import it makes is declared.

A plain ``pip install gemma4-appliance`` on a GPU host gets the declared dependencies and nothing
else (no vLLM, no test tools). ``scripts/setup.sh`` installs the ``cpu`` and ``dev`` extras too,
which hide an undeclared import (``packaging`` was one: every command, ``rollback`` included,
died with ModuleNotFoundError). This test builds that plain install without the network: a new
venv that sees only the transitive closure of the declared requirements (extras off), linked from
this environment, then imports every module of the package and runs every command's ``--help``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DIST = "gemma4-appliance"
# Modules that exist to run inside an extra's environment (the CPU engine), never imported by a
# command of a plain install.
EXTRA_ONLY = {"appliance.engine.vllm_main"}


def _closure(dist: str) -> set[str]:
    """Names of the distributions ``dist`` needs, transitively, with no extra requested."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in md.requires(dist) or []]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in md.requires(req.name) or []]
    return seen


def _top_level_paths(dist: str) -> set[Path]:
    """The top-level modules and packages ``dist`` installed into site-packages."""
    d = md.distribution(dist)
    site = Path(sysconfig.get_paths()["purelib"])
    out: set[Path] = set()
    for f in d.files or []:
        parts = Path(f).parts
        # The .dist-info goes too: libraries read their metadata and entry points at import.
        if not parts or parts[0].endswith(".data") or parts[0] == "..":
            continue
        if parts[0] == "__pycache__" or parts[0].endswith(".pth"):
            continue
        out.add(site / parts[0])
    return out


@pytest.fixture(scope="module")
def plain_python(tmp_path_factory) -> Path:
    """A python that sees the package and its declared dependencies only."""
    root = tmp_path_factory.mktemp("plain")
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    links = link_dependencies(root / "venv/bin/python", root / "site")
    (links / "appliance").symlink_to(REPO / "appliance")
    return root / "venv/bin/python"


def dependency_links(links: Path, *, copy: bool = False) -> Path:
    """Link (or, with ``copy``, copy) the declared dependencies of the package (extras off) from
    this environment into the new folder ``links``; returns it (a path entry for a ``.pth``
    file). A copy does not depend on where this environment lies: a machine that binds it in
    sees it whole, whatever it hides (a unit's PrivateTmp= hides a venv under /tmp)."""
    links.mkdir()
    for dist in sorted(_closure(DIST) - {DIST}):
        for path in _top_level_paths(dist):
            dest = links / path.name
            if not path.exists() or dest.exists():
                continue
            if not copy:
                dest.symlink_to(path)
            elif path.is_dir():
                shutil.copytree(path, dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, dest)
    return links


def link_dependencies(python: Path, links: Path) -> Path:
    """Make the declared dependencies of the package (extras off), linked from this
    environment into ``links``, importable by the venv of ``python``; returns ``links``."""
    dependency_links(links)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "dependencies.pth").write_text(f"{links}\n")
    return links


def test_every_dependency_is_declared(plain_python: Path) -> None:
    """Import every module of the package: a missing declaration is a ModuleNotFoundError."""
    code = (
        "import importlib, pkgutil, appliance\n"
        f"skip = {sorted(EXTRA_ONLY)!r}\n"
        "for m in pkgutil.walk_packages(appliance.__path__, 'appliance.'):\n"
        "    if m.name not in skip:\n"
        "        importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(
        [plain_python, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok"


def test_the_environment_has_no_test_or_engine_packages(plain_python: Path) -> None:
    """The check above can fail: vLLM and pytest are not importable in the plain install."""
    for module in ("vllm", "pytest", "hypothesis"):
        res = subprocess.run(
            [plain_python, "-c", f"import {module}"], capture_output=True, check=False
        )
        assert res.returncode != 0, f"{module} leaked into the plain install"


def _commands() -> list[list[str]]:
    """Every command path of the CLI, groups included."""
    import click

    from appliance.cli import cli

    out: list[list[str]] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        out.append(path)
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name])

    walk(cli, [])
    return out


def test_every_command_help_runs_on_a_plain_install(plain_python: Path) -> None:
    """``--help`` of every command and group, in one process of the plain install."""
    commands = _commands()
    code = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from appliance.cli import cli\n"
        "bad = {}\n"
        f"for cmd in {commands!r}:\n"
        "    r = CliRunner().invoke(cli, [*cmd, '--help'])\n"
        "    if r.exit_code != 0 or 'Usage:' not in r.output:\n"
        "        bad[' '.join(cmd)] = (r.output + repr(r.exception))[-500:]\n"
        "print(json.dumps(bad))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(
        [plain_python, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout) == {}
    assert len(commands) > 20  # every command was walked, groups and their commands


def test_declared_dependencies_resolve_here() -> None:
    """Each declared requirement is installed in the suite's environment (setup.sh's job)."""
    missing = [
        r
        for r in md.requires(DIST) or []
        if "extra ==" not in r and not _installed(Requirement(r).name)
    ]
    assert missing == [], missing
    assert sys.prefix != sys.base_prefix  # the suite runs in its venv


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def test_every_data_file_of_the_package_ships_in_the_wheel() -> None:
    """Templates, profiles and prompt sets are read at run time from the installed package: a
    file no ``package-data`` glob matches is missing from the wheel (the multinode unit templates
    were) and only a source checkout works."""
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["appliance"]
    package = REPO / "appliance"
    shipped = {p for g in globs for p in package.glob(g) if p.is_file()}
    data = {
        p
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert sorted(str(p.relative_to(package)) for p in data - shipped) == []
    assert {p for p in shipped if p.match("reports/templates/*.html.j2")}  # the report pages


# Imported only by code that runs with the `cpu` extra: the tiny dev models and the CPU engine.
# uvicorn: vLLM's own dependency, imported by the image's entry point (engine/vllm_main.py).
CPU_EXTRA_IMPORTS = {"torch", "transformers", "safetensors", "tokenizers", "vllm", "uvicorn"}
# SDKs an instrumentor patches only where the application has them: OpenTelemetry's loader checks
# the instrumentor's instrumentation_dependencies() first, so they are not the appliance's to
# install (the test below checks they are declared there instead).
INSTRUMENTED_SDKS = {"anthropic"}
# Imported lazily by one feature each and installed by its extra (ADR 0020): the report charts'
# matplotlib (the reports extra; charts.py says one line naming it where it is missing).
OPTIONAL_EXTRA_IMPORTS = {"matplotlib"}
# The image's entry point (engine/vllm_main.py) runs as a script beside copies of its siblings,
# and imports them by their top-level names there (appliance/images/build.py copies them).
IMAGE_SIBLINGS = {"model_info_cache"}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules the package imports anywhere (function bodies too) -> the files."""
    import ast

    out: dict[str, set[str]] = {}
    for path in sorted((REPO / "appliance").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top != "appliance":
                    out.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return out


def test_lazy_imports_are_declared_too(plain_python: Path) -> None:
    """An import inside a function (``models pull``'s huggingface_hub) must be declared as well:
    importing the modules above does not reach it."""
    assert all((REPO / "appliance" / "engine" / f"{m}.py").is_file() for m in IMAGE_SIBLINGS)
    wanted = sorted(
        set(_third_party_imports())
        - CPU_EXTRA_IMPORTS
        - INSTRUMENTED_SDKS
        - OPTIONAL_EXTRA_IMPORTS
        - IMAGE_SIBLINGS
    )
    from appliance.agent.instrumentor import AnthropicInstrumentor

    declared = AnthropicInstrumentor().instrumentation_dependencies()
    assert {d.split()[0] for d in declared} == INSTRUMENTED_SDKS
    code = (
        "import importlib.util, sys\n"
        f"missing = [m for m in {wanted!r} if importlib.util.find_spec(m) is None]\n"
        "print(' '.join(missing))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(
        [plain_python, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    missing = res.stdout.split()
    assert missing == [], {m: sorted(_third_party_imports()[m]) for m in missing}
    assert "click" in wanted  # the scan sees imports at all


def test_a_command_loads_only_its_own_module() -> None:
    """`appliance status` starts without the OpenAI SDK, pandas or the other commands' modules
    (appliance.cli.COMMANDS): each of those costs an operator's every command start."""
    heavy = ("openai", "pandas", "matplotlib", "appliance.cli.bench", "appliance.cli.demo")
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from appliance.cli import cli\n"
        "r = CliRunner().invoke(cli, ['status', '--help'])\n"
        "assert r.exit_code == 0 and 'Usage:' in r.output, r.output\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"
