"""The NVIDIA driver and GPUs, from ``nvidia-smi --query-gpu=... --format=csv``.

The CSV is read by its header, so any column set parses (an older driver without
``compute_cap`` too); a value nvidia-smi cannot give (``[N/A]``: the GB10's unified memory) is
None, never a guess. Doctor's GPU check is :func:`gpu_findings` too.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from ..profiles import Profile
from .findings import Finding

FIELDS = ("index", "name", "driver_version", "memory.total", "compute_cap")
# compute_cap is unknown to drivers before about R510: asked again without it.
FALLBACK = ("index", "name", "driver_version", "memory.total")
# Drivers reserve part of the memory: an L4 (24 GB) reports 23034 MiB, an H100 80GB 81559 MiB.
# A GPU reporting at least this share of the profile's nominal size is the size it names.
MEMORY_SHARE = 0.9

Runner = Callable[[list[str]], str]


@dataclass(frozen=True)
class Gpu:
    """One row of nvidia-smi's CSV; None where the column is absent or ``[N/A]``."""

    name: str
    driver: str | None = None
    memory_mib: int | None = None
    compute_cap: str | None = None
    index: int | None = None


@dataclass(frozen=True)
class Query:
    """What nvidia-smi said: the GPUs, or why there are none (``error``: one line)."""

    gpus: tuple[Gpu, ...] = ()
    error: str | None = None
    missing: bool = False  # no nvidia-smi at all: no NVIDIA driver installed


def command(fields: tuple[str, ...] = FIELDS) -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv"]


def parse_csv(text: str) -> list[Gpu]:
    """The GPUs of ``nvidia-smi --query-gpu=... --format=csv`` output (header first; units
    such as ``[MiB]`` in the header and ``MiB`` in the values). ValueError when it is not."""
    rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if r]
    if not rows or "name" not in [h.split(" [")[0].strip() for h in rows[0]]:
        raise ValueError(f"not nvidia-smi CSV with a header: {text.strip()[:80]!r}")
    header = [h.split(" [")[0].strip() for h in rows[0]]
    gpus = []
    for row in rows[1:]:
        cell = dict(zip(header, (v.strip() for v in row), strict=False))

        mem = _value(cell, "memory.total")
        idx = _value(cell, "index")
        gpus.append(
            Gpu(
                name=cell.get("name", ""),
                driver=_value(cell, "driver_version"),
                memory_mib=int(mem.split()[0]) if mem else None,
                compute_cap=_value(cell, "compute_cap"),
                index=int(idx) if idx is not None else None,
            )
        )
    return gpus


def _value(cell: dict[str, str], key: str) -> str | None:
    v = cell.get(key)
    return None if v is None or v.strip("[]") in ("N/A", "Not Supported", "") else v


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        # nvidia-smi says why on stdout ("NVIDIA-SMI has failed because it couldn't
        # communicate with the NVIDIA driver...") or stderr.
        why = done.stdout.strip() or done.stderr.strip() or f"exit {done.returncode}"
        raise subprocess.CalledProcessError(done.returncode, cmd, output=why.splitlines()[0])
    return done.stdout


def query(runner: Runner | None = None) -> Query:
    """Ask nvidia-smi (on PATH) for the GPUs."""
    if runner is None:
        if shutil.which("nvidia-smi") is None:
            return Query(missing=True, error="nvidia-smi not found")
        runner = _run
    for fields in (FIELDS, FALLBACK):
        try:
            return Query(gpus=tuple(parse_csv(runner(command(fields)))))
        except subprocess.CalledProcessError as exc:
            error = str(exc.output or exc)
            if "compute_cap" not in error:
                break
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            error = str(exc)
            break
    return Query(error=error)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def gpu_findings(profile: Profile, q: Query | None = None) -> list[Finding]:
    """The driver and its version against ``[hardware] min_driver``; the GPUs' count, model,
    memory and compute capability against the profile. A CPU profile needs none of it."""
    hw = profile.hardware
    if hw.device != "cuda":
        return [Finding("gpu", "ok", f"profile {profile.name} runs on {hw.device}: no GPU needed")]
    q = q if q is not None else query()
    install = f"install the NVIDIA driver{f' >= {hw.min_driver}' if hw.min_driver else ''}"
    if q.missing:
        return [
            Finding(
                "nvidia.driver",
                "blocker",
                f"nvidia-smi not found: no NVIDIA driver (profile {profile.name} needs "
                f"{hw.gpus} GPU(s))",
                f"{install} and reboot",
            )
        ]
    if q.error is not None or not q.gpus:
        return [
            Finding(
                "nvidia.driver",
                "blocker",
                f"nvidia-smi failed: {q.error or 'no GPU listed'}",
                f"{install}; check `nvidia-smi` answers",
            )
        ]
    out = [_driver(q.gpus[0].driver, hw.min_driver)]
    used = q.gpus[: max(hw.gpus, 1)]
    names = ", ".join(sorted({g.name for g in q.gpus}))
    if len(q.gpus) < hw.gpus:
        out.append(
            Finding(
                "gpu.count",
                "blocker",
                f"{len(q.gpus)} GPU(s) visible ({names}), profile {profile.name} needs {hw.gpus}",
                "use a host with enough GPUs, or a profile for this one (appliance profiles list)",
            )
        )
    else:
        out.append(Finding("gpu.count", "ok", f"{len(q.gpus)} GPU(s) visible ({names})"))
    if hw.gpu_name and not all(hw.gpu_name in g.name for g in used):
        out.append(
            Finding(
                "gpu.model",
                "warn",
                f"GPUs are {names}, profile {profile.name} was made for {hw.gpu_name}",
                "check the profile's memory and parallelism fit these GPUs",
            )
        )
    out.append(_memory(used, hw.gpu_memory_gib, profile.name, hw.mig))
    if hw.compute_capability:
        out.append(_capability(used, hw.compute_capability, profile.name))
    return out


def host_findings(q: Query | None = None, min_driver: str = "") -> list[Finding]:
    """The driver and the GPUs without a profile (``host check`` with none to judge): a
    blocker where nvidia-smi is missing, fails or lists no GPU; the driver against
    ``min_driver`` (the images' floor) and one line listing the GPUs otherwise."""
    q = q if q is not None else query()
    install = f"install the NVIDIA driver{f' >= {min_driver}' if min_driver else ''}"
    if q.missing:
        return [
            Finding(
                "nvidia.driver",
                "blocker",
                "nvidia-smi not found: no NVIDIA driver",
                f"{install} and reboot",
            )
        ]
    if q.error is not None or not q.gpus:
        why = q.error or "no GPU listed"
        return [
            Finding(
                "nvidia.driver",
                "blocker",
                f"nvidia-smi failed: {why}",
                f"{install}; check `nvidia-smi` answers",
            )
        ]
    listed = "; ".join(_gpu_line(g) for g in q.gpus)
    return [
        _driver(q.gpus[0].driver, min_driver),
        Finding("gpu.count", "ok", f"{len(q.gpus)} GPU(s): {listed}"),
    ]


def _gpu_line(g: Gpu) -> str:
    memory = f"{g.memory_mib} MiB" if g.memory_mib is not None else "unified memory"
    cap = f", compute capability {g.compute_cap}" if g.compute_cap else ""
    where = f"{g.index} " if g.index is not None else ""
    return f"{where}{g.name} ({memory}{cap})"


def _driver(found: str | None, wanted: str) -> Finding:
    if found is None:
        return Finding("nvidia.driver", "warn", "nvidia-smi reports no driver version")
    if wanted and _version(found) < _version(wanted):
        return Finding(
            "nvidia.driver",
            "blocker",
            f"driver {found} is older than {wanted}, the oldest the profile's image runs on",
            f"upgrade the NVIDIA driver to >= {wanted} and reboot",
        )
    floor = f" (>= {wanted})" if wanted else " (the profile states no minimum)"
    return Finding("nvidia.driver", "ok", f"driver {found}{floor}")


def _memory(gpus: tuple[Gpu, ...], gib: float, profile: str, mig: bool) -> Finding:
    if not gib:
        return Finding("gpu.memory", "ok", f"profile {profile} states no GPU memory")
    sizes = [g.memory_mib for g in gpus]
    if any(s is None for s in sizes):
        # The GB10's memory is the host's, shared: nvidia-smi reports [N/A] for it.
        return Finding(
            "gpu.memory",
            "ok",
            "nvidia-smi reports no dedicated memory (unified memory): not checked",
        )
    small = min(sizes)
    what = f"{gib:g} GB {'slice' if mig else 'per GPU'}"
    if small < gib * 1024 * MEMORY_SHARE:
        return Finding(
            "gpu.memory",
            "blocker",
            f"smallest GPU has {small} MiB, profile {profile} needs {what}",
            "use GPUs with more memory, or a profile made for these",
        )
    return Finding("gpu.memory", "ok", f"{small} MiB per GPU (profile: {what})")


def _capability(gpus: tuple[Gpu, ...], wanted: str, profile: str) -> Finding:
    caps = [g.compute_cap for g in gpus]
    if any(c is None for c in caps):
        return Finding("gpu.compute_capability", "warn", "nvidia-smi reports no compute capability")
    low = min(caps, key=_version)
    if _version(low) < _version(wanted):
        # Kernels the profile relies on (FP8 from 8.9, NVFP4 on Blackwell) are missing below.
        return Finding(
            "gpu.compute_capability",
            "blocker",
            f"compute capability {low} is below {wanted}, what profile {profile} needs",
            "use GPUs of the profile's generation, or a profile made for these",
        )
    return Finding("gpu.compute_capability", "ok", f"compute capability {low} (>= {wanted})")
