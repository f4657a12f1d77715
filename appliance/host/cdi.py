"""The host's CDI specs: which NVIDIA devices the NVIDIA Container Toolkit names for Docker.

An instance's devices reach its container one of two ways: as CDI devices, ``docker run
--device nvidia.com/gpu=NAME`` (one per device), where the host has a CDI spec naming each
device and Docker has CDI on; else ``--gpus device=UUID,...`` through the NVIDIA runtime or
hook. ``host check`` says which (:func:`passing`), and the serve program decides the same way
at each start.

What a host offers, as documented:

- The spec: ``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` (or
  ``/var/run/cdi/nvidia.yaml``, which the toolkit's ``nvidia-cdi-refresh`` service writes
  from v1.18.0 on, at each boot and driver change). A YAML or JSON file with ``kind:
  nvidia.com/gpu`` and ``devices:``, each with a ``name`` (NVIDIA/cloud-native-docs
  ``container-toolkit/cdi-support.md``; the layout in NVIDIA/nvidia-container-toolkit
  ``cmd/nvidia-ctk/cdi/generate/generate_test.go``). The names depend on the toolkit's
  ``--device-name-strategy`` (``cmd/nvidia-ctk/cdi/generate/namer.go``): ``index`` (``0``,
  and ``1:0`` for MIG device 0 of GPU 1), ``uuid`` (``GPU-...``, ``MIG-...``) or
  ``type-index`` (``gpu0``, ``mig1:0``), plus ``all``. Older toolkits default to ``index``
  alone, current ones to both ``index`` and ``uuid`` (``generate.go``); an env file names
  devices by UUID, so a spec of indexes alone needs ``nvidia-smi -L`` to match them, which the
  unit cannot run (``PrivateDevices=yes``): there the serve program passes ``--gpus``.
- Docker: ``--device vendor.com/class=name`` takes a CDI device once CDI is on in the daemon
  (Docker 25 to 28.2: ``"features": {"cdi": true}`` in ``/etc/docker/daemon.json``; on by
  default since Docker Engine 28.3.0, docker/cli ``docs/reference/commandline/container_run.md``
  "CDI devices"); ``docker info`` then lists the spec directories it reads (``CDISpecDirs``).
  The spec's own edits set ``NVIDIA_VISIBLE_DEVICES=void``, so a CUDA image's ``all`` does not
  bring in the other devices through the runtime's hook.

Standard library only: the serve program (appliance/serve/bundle.py) reads the specs too. The
YAML is read for the two things needed, the ``kind`` and each device's ``name``, in the block
layout ``nvidia-ctk`` writes; a spec read another way is no spec (``--gpus`` then).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

KIND = "nvidia.com/gpu"
DIRS = ("/etc/cdi", "/var/run/cdi")  # the two documented locations, Docker's default
SUFFIXES = (".yaml", ".yml", ".json")
MAX_BYTES = 8 << 20  # a spec is a few hundred KiB at most (the driver's libraries, listed)
ENABLE = (
    'Docker 25 to 28.2: "features": {"cdi": true} in /etc/docker/daemon.json, then restart '
    "docker (on by default from Docker 28.3)"
)
GENERATE = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"

_KEY = re.compile(r"^(\s*)(-\s+)?([A-Za-z_][\w.-]*):\s*(.*?)\s*$")
# `nvidia-smi -L`: a GPU line, and under a GPU in MIG mode each MIG device (the MIG user guide).
_GPU_LINE = re.compile(r"^GPU (\d+): .+? \(UUID: (\S+?)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG \S+\s+Device\s+(\d+): \(UUID: (\S+?)\)\s*$")


@dataclass(frozen=True)
class Spec:
    """One CDI spec file of kind ``nvidia.com/gpu``: where it is and the device names it has."""

    path: Path
    names: tuple[str, ...]


def _scalar(text: str) -> str:
    text = text.split(" #", 1)[0].strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def parse(text: str, *, as_json: bool = False) -> tuple[str, tuple[str, ...]]:
    """A spec's ``kind`` and its devices' names (``("", ())`` when it is not one)."""
    if as_json:
        try:
            doc = json.loads(text)
        except ValueError:
            return "", ()
        if not isinstance(doc, dict):
            return "", ()
        devices = doc.get("devices") if isinstance(doc.get("devices"), list) else []
        names = tuple(str(d["name"]) for d in devices if isinstance(d, dict) and "name" in d)
        return str(doc.get("kind") or ""), names
    kind, names = "", []
    in_devices = False
    item = None  # the indentation of the devices' "- " items
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#") or line.strip() == "---":
            continue
        m = _KEY.match(line)
        indent = len(line) - len(line.lstrip())
        if indent == 0 and not line.startswith("-"):
            in_devices = False
            if m and m.group(3) == "kind":
                kind = _scalar(m.group(4))
            elif m and m.group(3) == "devices":
                in_devices, item = True, None
            continue
        if not in_devices or m is None:
            continue
        dash = m.group(2)
        if dash and item is None:
            item = indent
        if item is None:
            continue
        # A device's own keys sit two columns in from its "- " (nvidia-ctk writes "- name: x" or
        # a "name: x" line under "- containerEdits:"); deeper keys belong to its edits.
        own = (dash and indent == item) or (not dash and indent == item + 2)
        if own and m.group(3) == "name":
            names.append(_scalar(m.group(4)))
    return kind, tuple(names)


def read(root: Path = Path("/"), dirs: Iterable[str] = DIRS) -> tuple[Spec, ...]:
    """The ``nvidia.com/gpu`` specs in ``dirs`` under ``root`` (a tree reads only its own)."""
    out = []
    for d in dict.fromkeys(dirs):
        folder = Path(root) / str(d).lstrip("/")
        try:
            files = sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file())
        except OSError:
            continue
        for path in files:
            try:
                if path.stat().st_size > MAX_BYTES:
                    continue
                text = path.read_text(errors="replace")
            except OSError:
                continue
            kind, names = parse(text, as_json=path.suffix == ".json")
            if kind == KIND and names:
                out.append(Spec(path, names))
    return tuple(out)


def aliases(listing: str) -> dict[str, set[str]]:
    """Each device of ``nvidia-smi -L`` by UUID, with what a spec may name it: the UUID and the
    index (``1``; ``1:0`` for MIG device 0 of GPU 1)."""
    out: dict[str, set[str]] = {}
    gpu = None
    for line in listing.splitlines():
        if m := _GPU_LINE.match(line):
            gpu = m.group(1)
            out[m.group(2)] = {m.group(2), gpu}
        elif (m := _MIG_LINE.match(line)) and gpu is not None:
            out[m.group(2)] = {m.group(2), f"{gpu}:{m.group(1)}"}
    return out


def _forms(alias: str) -> list[str]:
    """The names a device known as ``alias`` may have in a spec, by naming strategy."""
    if re.fullmatch(r"\d+", alias):
        return [alias, f"gpu{alias}"]
    if re.fullmatch(r"\d+:\d+", alias):
        return [alias, f"mig{alias}"]
    return [alias]


def name(device: Iterable[str], specs: Sequence[Spec]) -> str | None:
    """The fully qualified CDI name of the device known by ``device`` (its aliases: UUID,
    index, GPU:MIG), or None where no spec names it."""
    known = {n for s in specs for n in s.names}
    # The UUID first where a spec has both: it names the same device after a reboot.
    for alias in sorted(device, key=lambda a: (a[:1].isdigit(), a)):
        for form in _forms(alias):
            if form in known:
                return f"{KIND}={form}"
    return None


def names(devices: Sequence[Iterable[str]], specs: Sequence[Spec]) -> list[str] | None:
    """The CDI names of every device, in order; None when a spec names not every one."""
    out = [name(d, specs) for d in devices]
    return None if not out or None in out else [n for n in out if n is not None]


def device_args(cdi_names: Sequence[str]) -> list[str]:
    """``docker run``'s arguments for CDI devices."""
    return [a for n in cdi_names for a in ("--device", n)]


def gpus_args(gpus: str) -> list[str]:
    """``docker run --gpus``: docker reads the value as CSV, so a device list with commas is
    one quoted field."""
    return ["--gpus", f'"{gpus}"' if "," in gpus else gpus]


def refs(gpus: str) -> list[str] | None:
    """The devices ``VLLM_GPUS`` names (None: ``all`` or a count, no device list)."""
    if not gpus.startswith("device="):
        return None
    return gpus.removeprefix("device=").split(",")


@dataclass(frozen=True)
class Passing:
    """How the devices go to Docker: its arguments, and the line that says why."""

    args: list[str]
    why: str
    cdi: bool = False
    stale: bool = False  # a spec is there and names not every device (regenerate it)


def passing(
    gpus: str,
    devices: Sequence[Iterable[str]] | None,
    specs: Sequence[Spec],
    docker_cdi: bool | None,
) -> Passing:
    """CDI devices where a spec names every device of ``gpus`` (``devices``: their aliases,
    None to read them from ``gpus`` alone) and Docker has CDI on (``docker_cdi``: None when not
    asked, the spec decides); else ``--gpus``."""
    fallback = gpus_args(gpus)
    where = ", ".join(str(s.path) for s in specs)
    if not specs:
        return Passing(fallback, "no CDI spec names nvidia.com/gpu devices")
    listed = refs(gpus)
    if devices is None:
        devices = [{r} for r in listed] if listed is not None else []
    if gpus == "all":
        devices = [{"all"}]
    found = names(devices, specs) if devices else None
    if found is None:
        if not devices:  # a count: CDI names devices, not how many
            return Passing(fallback, f"VLLM_GPUS={gpus} is a count, not devices a spec names")
        missing = [max(d, key=len) for d in devices if name(d, specs) is None]
        return Passing(
            fallback,
            f"the CDI spec ({where}) does not name {', '.join(missing)} (made before these "
            "devices or MIG slices were, or by index alone?)",
            stale=True,
        )
    if docker_cdi is False:
        return Passing(
            fallback,
            f"the CDI spec ({where}) names them but Docker's CDI is off (docker info lists no "
            f"CDI spec dirs): to pass them as CDI devices, {ENABLE}",
        )
    return Passing(device_args(found), f"CDI devices named by {where}", cdi=True)
