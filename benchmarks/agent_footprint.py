"""What an application installs and imports for the telemetry agent, beside the operator's install.

For each install it prints, side by side: the distributions it brings and their installed size
(the transitive closure of its requirements, read from this environment's metadata: each
distribution's RECORD, sizes of the files as installed here; no network), and the time
``import appliance.agent`` takes in a fresh Python that sees only that closure (a new venv whose
``.pth`` points at links into this environment, as tests/test_packaging.py builds its plain
install), with which of ``openai``, ``pydantic``, the OpenTelemetry SDK and matplotlib the import
loaded. The rows:

- ``agent``: ``pip install gemma4-appliance``, what an application that wants the agent installs;
- ``operator``: ``pip install 'gemma4-appliance[reports,otlp]'``, the operator's full stack
  (report charts, OTLP export);
- ``before``: the same closure (the dependencies before ADR 0020), importing what
  ``import appliance.agent`` imported then: ``openai`` and the SDK's tracer provider too;
- ``api only``: the distributions the agent's own imports need (the OpenTelemetry API and
  instrumentation, prometheus-client, httpx, wrapt), with the agent's files: the floor an own
  distribution of the agent would reach (ADR 0020).

Import times are medians of ``--runs`` fresh processes per row, the rows interleaved, with the
range. Figures, not assertions::

    .venv/bin/python benchmarks/agent_footprint.py
    .venv/bin/python benchmarks/agent_footprint.py --runs 21
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import venv
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DIST = "gemma4-appliance"
HEAVY = ("openai", "pydantic", "opentelemetry.sdk", "matplotlib")
# What the agent's modules import beyond the standard library (appliance/agent/*.py and the
# appliance modules they import: errors, engine_api: specdecode, metrics_reader, vllm_client, shed).
AGENT_OWN = (
    "opentelemetry-api",
    "opentelemetry-instrumentation",
    "prometheus-client",
    "httpx",
    "wrapt",
)
AGENT_FILES = ("__init__.py", "errors.py", "engine_api/__init__.py", "engine_api/specdecode.py")
AGENT_FILES += ("engine_api/metrics_reader.py", "engine_api/vllm_client.py", "engine_api/shed.py")
AGENT_FILES += ("agent",)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(requirements: list[str], extras_of_self: dict[str, list[str]]) -> set[str]:
    """The distributions ``requirements`` install (this project's own extras expanded from
    ``extras_of_self``, the pyproject's; every other one from the installed metadata)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name == DIST:
            for extra in req.extras:
                todo += [Requirement(r) for r in extras_of_self[extra]]
            continue
        if name in seen:
            continue
        seen.add(name)
        for text in md.requires(req.name) or []:
            dep = Requirement(text)
            wanted = {""} | set(req.extras)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in wanted):
                todo.append(dep)
    return seen


def installed_bytes(dist: str) -> int:
    """The size of ``dist``'s files as installed here (its RECORD)."""
    total = 0
    for f in md.distribution(dist).files or []:
        try:
            total += os.path.getsize(f.locate())
        except OSError:
            pass
    return total


def package_bytes(paths) -> int:
    """This project's own files among ``paths`` (under appliance/), without bytecode."""
    total = 0
    for p in paths:
        p = REPO / "appliance" / p
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        total += sum(f.stat().st_size for f in files if "__pycache__" not in f.parts)
    return total


def _top_level(dist: str) -> set[Path]:
    """The top-level modules, packages and .dist-info ``dist`` installed into site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    out = set()
    for f in md.distribution(dist).files or []:
        parts = Path(f).parts
        if not parts or parts[0].endswith(".data") or parts[0] in ("..", "__pycache__"):
            continue
        if parts[0].endswith(".pth"):
            continue
        out.add(site / parts[0])
    return out


def python_seeing(dists: set[str], root: Path) -> Path:
    """A new venv's python that sees ``dists`` (linked from here) and this repo's package."""
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    links = root / "site"
    links.mkdir()
    for dist in sorted(dists):
        for path in _top_level(dist):
            dest = links / path.name
            if path.exists() and not dest.exists():
                dest.symlink_to(path)
    (links / "appliance").symlink_to(REPO / "appliance")
    python = root / "venv/bin/python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "links.pth").write_text(f"{links}\n")
    return python


_IMPORT = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import appliance.agent
{extra}
dt, dc = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps([dt, dc, sorted(m for m in {heavy!r} if m in sys.modules)]))
"""


def import_once(python: Path, extra: str) -> tuple[float, float, list[str]]:
    """One fresh process: the import's wall and CPU seconds, and the heavy modules it loaded."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(
        [python, "-c", _IMPORT.format(extra=extra, heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tempfile.gettempdir(),  # not the repo: only the links may provide appliance
    ).stdout
    dt, dc, loaded = json.loads(out.splitlines()[-1])
    return dt, dc, loaded


def _range(values: list[float]) -> str:
    return f"({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=11, help="fresh processes per row")
    args = parser.parse_args()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base = project["dependencies"]
    operator = [*base, f"{DIST}[reports,otlp]"]
    whole = package_bytes(["."])
    rows = [
        ("agent", "pip install gemma4-appliance", closure(base, extras), whole, ""),
        ("operator", "... '[reports,otlp]'", closure(operator, extras), whole, ""),
        (
            "before",
            "operator's closure, old imports",
            closure(operator, extras),
            whole,
            "import openai, opentelemetry.sdk.trace",
        ),
        ("api only", "the agent's own imports", closure(list(AGENT_OWN), extras), 0, ""),
    ]
    own = package_bytes(AGENT_FILES)
    times: dict[str, list[float]] = {name: [] for name, *_ in rows}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in rows}
    loaded: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pythons = {}
        for name, _, dists, _, _ in rows:
            root = Path(tmp, name.replace(" ", "-"))
            root.mkdir()
            pythons[name] = python_seeing(dists, root)
        for name, *_, extra in rows:  # warm: bytecode written, files in the page cache
            import_once(pythons[name], extra)
        for i in range(args.runs):
            for j in range(len(rows)):
                name, *_, extra = rows[(i + j) % len(rows)]
                dt, dc, mods = import_once(pythons[name], extra)
                times[name].append(dt * 1000)
                cpu[name].append(dc * 1000)
                loaded[name] = mods
    print(
        f"import appliance.agent: median of {args.runs} fresh processes per row (min-max), "
        "wall and CPU"
    )
    print(
        f"{'install':<9} {'what':<33} {'dists':>5} {'MB':>7} {'wall ms':>8} {'(min-max)':>12} "
        f"{'CPU ms':>7} {'(min-max)':>11}  loaded"
    )
    for name, what, dists, pkg, _ in rows:
        size = sum(installed_bytes(d) for d in dists) + (pkg or own)
        t, c = times[name], cpu[name]
        print(
            f"{name:<9} {what:<33} {len(dists) + 1:>5} {size / 1e6:>7.1f} "
            f"{statistics.median(t):>8.0f} {_range(t):>12} {statistics.median(c):>7.0f} "
            f"{_range(c):>11}  {', '.join(loaded[name]) or '-'}"
        )
    agent, operator_row = rows[0][2], rows[1][2]
    print(f"\nthe operator's install less the agent's: {', '.join(sorted(operator_row - agent))}")
    print(f"python {sys.version.split()[0]}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
