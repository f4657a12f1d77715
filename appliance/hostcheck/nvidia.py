"""The NVIDIA driver and GPUs, from ``nvidia-smi --query-gpu=... --format=csv``.

The CSV is read by its header, so any column set parses (an older driver without
``compute_cap`` too); a value nvidia-smi cannot give (``[N/A]``: the GB10's unified memory) is
None, never a guess. Doctor's GPU check is :func:`gpu_findings` too.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..host import cdi
from ..profiles import Profile
from .findings import Finding

# nvidia-smi's documented --query-gpu fields (`nvidia-smi --help-query-gpu`): the GPU's index,
# UUID (what docker's --gpus device= takes), name, driver, memory, compute capability (asked of
# drivers since about R510) and MIG mode ("Enabled", "Disabled", [N/A] where a GPU has none).
FIELDS = (
    "index",
    "uuid",
    "name",
    "driver_version",
    "memory.total",
    "compute_cap",
    "mig.mode.current",
)
# `nvidia-smi -L` (--list-gpus) lists each GPU and, under a GPU in MIG mode, each MIG device
# with its profile and UUID, as the MIG user guide shows it
# (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/, "CUDA Device Enumeration"):
#   GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5d3f...)
#     MIG 1g.10gb     Device  0: (UUID: MIG-c738...)
LIST = ["nvidia-smi", "-L"]
OPTIONAL = ("uuid", "compute_cap", "mig.mode.current")  # dropped for a driver that refuses one
# `nvidia-smi topo -m`: the GPUs' matrix, one tab-separated row a GPU, with its "NUMA Affinity"
# column (`nvidia-smi topo -h`); a tensor-parallel set is taken from one NUMA node where it says.
TOPO = ["nvidia-smi", "topo", "-m"]
_GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (\S+?)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (\S+?)\)\s*$")
# A MIG profile names its memory in GB ("1g.24gb": the MIG user guide's device names).
_MIG_MEMORY = re.compile(r"\.(\d+)gb$")
# Drivers reserve part of the memory: an L4 (24 GB) reports 23034 MiB, an H100 80GB 81559 MiB.
# A GPU reporting at least this share of the profile's nominal size is the size it names.
MEMORY_SHARE = 0.9
MAX_MIB = 1 << 24  # 16 TiB: more than any GPU has; a larger memory.total is not believed

Runner = Callable[[list[str]], str]


@dataclass(frozen=True)
class Gpu:
    """One row of nvidia-smi's CSV; None where the column is absent or ``[N/A]``."""

    name: str
    driver: str | None = None
    memory_mib: int | None = None
    compute_cap: str | None = None
    index: int | None = None
    uuid: str | None = None
    mig: bool | None = None  # MIG mode on (None: the GPU has none, or the driver did not say)


@dataclass(frozen=True)
class Slice:
    """One MIG device of `nvidia-smi -L`: its GPU's index, its own index there, profile, UUID."""

    gpu: int
    index: int
    profile: str
    uuid: str


@dataclass(frozen=True)
class Device:
    """What an instance is given: a whole GPU, or one MIG slice of a GPU in MIG mode."""

    gpu: Gpu
    slice: Slice | None = None

    @property
    def ref(self) -> str:
        """What docker's ``--gpus device=`` takes: the UUID, else the index (``0``, ``0:1``)."""
        if self.slice is not None:
            return self.slice.uuid
        return self.gpu.uuid or str(self.gpu.index if self.gpu.index is not None else 0)

    @property
    def aliases(self) -> set[str]:
        """Every way an env file may name it (UUID, index, GPU:MIG index)."""
        if self.slice is not None:
            return {self.slice.uuid, f"{self.slice.gpu}:{self.slice.index}"}
        return {a for a in (self.gpu.uuid, str(self.gpu.index)) if a and a != "None"}

    @property
    def kind(self) -> str:
        """Devices of one kind are alike: the GPU's name, and the MIG profile of a slice."""
        return self.gpu.name + (f" MIG {self.slice.profile}" if self.slice else "")

    @property
    def name(self) -> str:
        return self.gpu.name

    @property
    def memory_mib(self) -> int | None:
        if self.slice is None:
            return self.gpu.memory_mib
        found = _MIG_MEMORY.search(self.slice.profile)
        # The profile's GB, as decimal: the lesser reading.
        return int(found.group(1)) * 10**9 // 2**20 if found else None

    @property
    def compute_cap(self) -> str | None:
        return self.gpu.compute_cap

    def label(self) -> str:
        if self.slice is not None:
            return f"{self.slice.gpu}:{self.slice.index} ({self.slice.profile} of {self.name})"
        return f"{self.gpu.index} ({self.name})"


@dataclass(frozen=True)
class Query:
    """What nvidia-smi said: the GPUs and MIG slices, or why there are none (``error``)."""

    gpus: tuple[Gpu, ...] = ()
    error: str | None = None
    missing: bool = False  # no nvidia-smi at all: no NVIDIA driver installed
    slices: tuple[Slice, ...] = ()
    numa: tuple[tuple[int, str], ...] = ()  # (GPU index, its NUMA node) where topo says

    def node(self, d: Device) -> str | None:
        """The NUMA node of ``d``'s GPU, where ``nvidia-smi topo -m`` said it."""
        return dict(self.numa).get(d.slice.gpu if d.slice else d.gpu.index)

    @property
    def devices(self) -> tuple[Device, ...]:
        """Every device an instance may be given: each GPU not in MIG mode, and each MIG
        slice of one that is (a GPU in MIG mode is not usable whole)."""
        out: list[Device] = []
        for g in self.gpus:
            if g.mig:
                out += [Device(g, s) for s in self.slices if s.gpu == g.index]
            else:
                out.append(Device(g))
        return tuple(out)

    def kinds(self) -> dict[str, tuple[Device, ...]]:
        """The devices by kind, in nvidia-smi's order."""
        out: dict[str, list[Device]] = {}
        for d in self.devices:
            out.setdefault(d.kind, []).append(d)
        return {k: tuple(v) for k, v in out.items()}

    def host(self) -> str:
        """``8x NVIDIA H100 80GB HBM3``, ``1x NVIDIA H100 ..., 1x NVIDIA L4``."""
        counts: dict[str, int] = {}
        for d in self.devices or tuple(Device(g) for g in self.gpus):
            counts[d.kind] = counts.get(d.kind, 0) + 1
        return ", ".join(f"{n}x {kind}" for kind, n in counts.items())


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
    for position, row in enumerate(rows[1:]):
        cell = dict(zip(header, (v.strip() for v in row), strict=False))

        mem = _value(cell, "memory.total")
        if mem is not None and not 0 < int(mem.split()[0]) <= MAX_MIB:
            raise ValueError(f"not a GPU's memory.total: {mem!r}")
        idx = _value(cell, "index")
        mig = _value(cell, "mig.mode.current")
        gpus.append(
            Gpu(
                name=cell.get("name", ""),
                driver=_value(cell, "driver_version"),
                memory_mib=int(mem.split()[0]) if mem else None,
                compute_cap=_value(cell, "compute_cap"),
                # nvidia-smi lists the GPUs in index order: a query without the column
                # (an older capture) still numbers them.
                index=int(idx) if idx is not None else position,
                uuid=_value(cell, "uuid"),
                mig=None if mig is None else mig == "Enabled",
            )
        )
    return gpus


def parse_list(text: str) -> tuple[dict[int, str], list[Slice]]:
    """`nvidia-smi -L`: each GPU's UUID by index, and the MIG slices."""
    uuids: dict[int, str] = {}
    slices: list[Slice] = []
    gpu = None
    for line in text.splitlines():
        if m := _GPU_LINE.match(line):
            gpu = int(m.group(1))
            uuids[gpu] = m.group(3)
        elif (m := _MIG_LINE.match(line)) and gpu is not None:
            slices.append(Slice(gpu, int(m.group(2)), m.group(1), m.group(3)))
    return uuids, slices


def parse_topo(text: str) -> dict[int, str]:
    """`nvidia-smi topo -m`: each GPU's NUMA node, by its index (none where not said)."""
    rows = [line.split("\t") for line in text.splitlines() if "\t" in line]
    if not rows:
        return {}
    header = [h.strip() for h in rows[0]]
    if "NUMA Affinity" not in header:
        return {}
    at = header.index("NUMA Affinity")
    out = {}
    for row in rows[1:]:
        name = row[0].strip()
        if name.startswith("GPU") and name[3:].isdigit() and len(row) > at:
            node = row[at].strip()
            if node and node != "N/A":
                out[int(name[3:])] = node
    return out


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
    """Ask nvidia-smi (on PATH) once for the GPUs (``--query-gpu``) and the MIG slices
    (``-L``): every reader of the host's devices (host check, suggest, install) asks here."""
    if runner is None:
        if shutil.which("nvidia-smi") is None:
            return Query(missing=True, error="nvidia-smi not found")
        runner = _run
    fields = list(FIELDS)
    while True:
        try:
            gpus = parse_csv(runner(command(tuple(fields))))
            break
        except subprocess.CalledProcessError as exc:
            error = str(exc.output or exc)
            # An older driver refuses a field it does not know ('Field "compute_cap" is not a
            # valid field to query.'): asked again without it.
            unknown = [f for f in OPTIONAL if f in fields and f in error]
            if not unknown:
                return Query(error=error)
            fields = [f for f in fields if f not in unknown]
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            return Query(error=str(exc))
    try:
        uuids, slices = parse_list(runner(LIST))
    except (OSError, subprocess.SubprocessError):
        uuids, slices = {}, []  # no listing: whole GPUs by index, no MIG slices known
    try:
        numa = parse_topo(runner(TOPO))
    except (OSError, subprocess.SubprocessError):
        numa = {}  # no topology: sets by index order
    gpus = [
        dataclasses.replace(g, uuid=g.uuid or uuids.get(g.index)) if g.index is not None else g
        for g in gpus
    ]
    return Query(gpus=tuple(gpus), slices=tuple(slices), numa=tuple(sorted(numa.items())))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def choose(
    profile: Profile, q: Query, taken: frozenset[str] = frozenset()
) -> tuple[tuple[Device, ...], tuple[Device, ...]]:
    """The devices of the kind ``profile`` runs on here, and of those the ones it would get:
    the first ``[hardware] gpus`` not ``taken`` (by another instance, any alias). Whole GPUs
    for a profile of whole GPUs, slices of its MIG profile for a MIG one; of several kinds (a
    mixed host) the one it passes on (count, memory, compute capability), then the one it was
    made for, then the largest; a tensor-parallel set from one NUMA node where `nvidia-smi
    topo -m` says and one has enough. `host check --profile`, `profiles suggest` and `install`
    all choose here, so they judge the same devices."""
    hw = profile.hardware
    need = max(hw.gpus, 1)

    def suits(kind: tuple[Device, ...]) -> bool:
        d = kind[0]
        if hw.mig:
            return d.slice is not None and (not hw.mig_profile or d.slice.profile == hw.mig_profile)
        return d.slice is None

    def order(kind: tuple[Device, ...]):
        free = tuple(d for d in kind if not (d.aliases & taken))[:need]
        ok = len(free) == need and not any(f.status == "blocker" for f in _judged(profile, free))
        return (ok, bool(hw.gpu_name) and hw.gpu_name in kind[0].name, kind[0].memory_mib or 0)

    kinds = sorted((k for k in q.kinds().values() if suits(k)), key=order, reverse=True)
    if not kinds:
        return (), ()
    kind = kinds[0]
    free = [d for d in kind if not (d.aliases & taken)]
    if need > 1:
        # Tensor parallel: a set within one NUMA node where one has enough free.
        for node in dict.fromkeys(q.node(d) for d in free):
            same = [d for d in free if q.node(d) == node]
            if node is not None and len(same) >= need:
                return kind, tuple(same[:need])
    return kind, tuple(free[:need])


def given(q: Query, gpus: str) -> tuple[Device, ...] | None:
    """The devices an env file's ``VLLM_GPUS=device=...`` names (None: ``all`` or a count)."""
    if not gpus.startswith("device="):
        return None
    refs = gpus.removeprefix("device=").split(",")
    return tuple(d for r in refs for d in q.devices if r in d.aliases)


def _judged(profile: Profile, devices: tuple[Device, ...]) -> list[Finding]:
    hw = profile.hardware
    out = [_memory(devices, hw.gpu_memory_gib, profile.name, hw.mig)]
    if hw.compute_capability:
        out.append(_capability(devices, hw.compute_capability, profile.name))
    return out


def gpu_findings(
    profile: Profile,
    q: Query | None = None,
    *,
    devices: tuple[Device, ...] | None = None,
    taken: frozenset[str] = frozenset(),
    specs: Sequence[cdi.Spec] = (),
    docker_cdi: bool | None = None,
) -> list[Finding]:
    """The driver and its version against ``[hardware] min_driver``; the devices the profile
    gets (``devices``: an installed instance's; else :func:`choose`, past ``taken``) against
    its count, model, memory and compute capability, and how they go to Docker: CDI devices
    where ``specs`` (the host's CDI specs) name each and Docker's CDI is not off
    (``docker_cdi``), else ``--gpus`` (:func:`appliance.host.cdi.passing`, as the serve program
    decides). A CPU profile needs none of it."""
    hw = profile.hardware
    if hw.device != "cuda":
        return [Finding("gpu", "ok", f"profile {profile.name} runs on {hw.device}: no GPU needed")]
    q = q if q is not None else query()
    if none := _no_driver(q, hw.min_driver, f" (profile {profile.name} needs {hw.gpus} GPU(s))"):
        return none
    out = [_driver(q.gpus[0].driver, hw.min_driver)]
    if devices is not None:
        kind, used = devices, devices
    else:
        kind, used = choose(profile, q, taken)
    unit = f"MIG {hw.mig_profile or ''} slice(s)".replace("  ", " ") if hw.mig else "GPU(s)"
    need = max(hw.gpus, 1)
    if not kind:
        fix = (
            "enable MIG mode and make the slices (nvidia-smi mig -cgi ... -C), or a profile "
            "for whole GPUs"
            if hw.mig
            else "a GPU in MIG mode is not given whole: disable MIG mode, or a MIG profile"
        )
        out.append(
            Finding(
                "gpu.count",
                "blocker",
                f"no {unit} here ({q.host()}), profile {profile.name} needs {need}",
                fix,
            )
        )
        return out
    seen = f"{len(kind)} {unit} visible ({kind[0].kind.split(' MIG ')[0]})"
    busy = len(kind) - len([d for d in kind if not (d.aliases & taken)])
    if len(used) < need:
        out.append(
            Finding(
                "gpu.count",
                "blocker",
                f"{seen}{f', {busy} taken by other instances' if busy else ''}, profile "
                f"{profile.name} needs {need}",
                "use a host with enough GPUs, or a profile for this one (appliance profiles list)",
            )
        )
    else:
        out.append(Finding("gpu.count", "ok", seen))
        refs = ",".join(d.ref for d in used)
        where = ", ".join(d.label() for d in used)
        # By what the env file records (the UUID), as the serve program matches them.
        way = cdi.passing(f"device={refs}", None, specs, docker_cdi)
        out.append(
            Finding(
                "gpu.devices",
                "warn" if way.stale else "ok",
                f"{where}: docker {' '.join(way.args)} ({way.why})",
                cdi.GENERATE if way.stale else "",
            )
        )
    if hw.gpu_name and not all(hw.gpu_name in d.name for d in used or kind):
        names = ", ".join(sorted({d.name for d in used or kind}))
        out.append(
            Finding(
                "gpu.model",
                "warn",
                f"GPUs are {names}, profile {profile.name} was made for {hw.gpu_name}",
                "check the profile's memory and parallelism fit these GPUs",
            )
        )
    out += _judged(profile, used or kind[:need])
    return out


def host_findings(q: Query | None = None, min_driver: str = "") -> list[Finding]:
    """The driver and the GPUs without a profile (``host check`` with none to judge): a
    blocker where nvidia-smi is missing, fails or lists no GPU; the driver against
    ``min_driver`` (the images' floor) and one line listing the GPUs otherwise."""
    q = q if q is not None else query()
    if none := _no_driver(q, min_driver):
        return none
    listed = "; ".join(_gpu_line(g, q) for g in q.gpus)
    return [
        _driver(q.gpus[0].driver, min_driver),
        Finding("gpu.count", "ok", f"{len(q.gpus)} GPU(s): {listed}"),
    ]


def _no_driver(q: Query, min_driver: str, needs: str = "") -> list[Finding]:
    """The driver's blocker where nvidia-smi is missing, fails or lists no GPU; else none."""
    install = f"install the NVIDIA driver{f' >= {min_driver}' if min_driver else ''}"
    if q.missing:
        why, fix = f"nvidia-smi not found: no NVIDIA driver{needs}", f"{install} and reboot"
    elif q.error is not None or not q.gpus:
        why = f"nvidia-smi failed: {q.error or 'no GPU listed'}"
        fix = f"{install}; check `nvidia-smi` answers"
    else:
        return []
    return [Finding("nvidia.driver", "blocker", why, fix)]


def _gpu_line(g: Gpu, q: Query) -> str:
    memory = f"{g.memory_mib} MiB" if g.memory_mib is not None else "unified memory"
    cap = f", compute capability {g.compute_cap}" if g.compute_cap else ""
    mig = ""
    if g.mig:
        mine = [s.profile for s in q.slices if s.gpu == g.index]
        mig = f", MIG mode: {len(mine)} slice(s) {' '.join(sorted(set(mine)))}".rstrip()
    return f"{g.index} {g.name} ({memory}{cap}{mig})"


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


def _memory(gpus: tuple[Device, ...], gib: float, profile: str, mig: bool) -> Finding:
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


def _capability(gpus: tuple[Device, ...], wanted: str, profile: str) -> Finding:
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
