"""Which GPUs (or MIG slices) an instance gets: its own device set, recorded by UUID in its env
file (``VLLM_GPUS=device=GPU-...,GPU-...``), which the serve program passes to Docker as they
are: as CDI devices where the host's CDI spec names them, else ``--gpus`` (appliance/host/cdi.py).

A new instance of a GPU profile takes the next free device set of the profile's kind
(:func:`.nvidia.choose`: what ``host check --profile`` and ``profiles suggest`` judge), past the
sets the other installed instances hold; ``--gpus`` names one itself and is refused where it
overlaps another instance's unless ``--share-gpus REASON``. An instance given ``all`` (or a
count) holds every device. Without nvidia-smi (a tree built on a machine without GPUs) nothing
is chosen: the env file keeps ``all``, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UsageError
from ..host import envfile
from ..host.layout import Layout
from ..profiles import Profile
from ..units import Options
from .nvidia import Query, choose, given, query

EVERY = "*"  # an instance given all GPUs (or a count): it holds each


@dataclass(frozen=True)
class Placed:
    """The options install writes (``gpus`` chosen where it was not given) and the line that
    says which devices were taken (None: nothing to say)."""

    options: Options
    said: str | None = None


def claimed(root: Path, instance: str | None, q: Query | None = None) -> dict[str, str]:
    """The device aliases the other installed instances hold, each to its instance (``EVERY``
    for one given ``all`` or a count); a device named by index and by UUID is held under both."""
    out: dict[str, str] = {}
    for name in Layout(root).installed():
        if name == instance:
            continue
        try:
            gpus = envfile.read(Layout(root).env_file(name)).get(envfile.GPUS_KEY)
        except UsageError:
            continue  # unreadable: the serve program refuses it with its own words
        if not gpus:
            continue  # a CPU instance
        for alias in _aliases(gpus, q):
            out.setdefault(alias, name)
    return out


def _aliases(gpus: str, q: Query | None) -> set[str]:
    if not gpus.startswith("device="):
        return {EVERY}
    refs = set(gpus.removeprefix("device=").split(","))
    devices = given(q, gpus) if q is not None else ()
    return refs.union(*(d.aliases for d in devices or ()))


def place(
    prof: Profile,
    instance: str,
    root: Path,
    options: Options,
    kept: str | None,
    *,
    share: str | None = None,
    q: Query | None = None,
) -> Placed:
    """The device set instance ``instance`` of ``prof`` gets under ``root``: ``options.gpus``
    when given (a UsageError where it overlaps another instance's and ``share`` gives no
    reason), else the env file's ``kept`` value, else the next free set of its kind."""
    if prof.hardware.device != "cuda":
        return Placed(options)
    if share is not None and not share.strip():
        raise UsageError("--share-gpus needs a reason", fix='--share-gpus "why they may share"')
    asked = options.gpus
    if asked is None and kept is not None and kept.startswith("device="):
        return Placed(options)
    q = q if q is not None else query()
    known = q.devices if q.error is None else ()
    need = max(prof.hardware.gpus, 1)
    if asked is None and kept is not None:
        # Installed before instances had their own (all, or a count): kept, and said where the
        # host has more than the profile needs; the operator moves it, not a re-install.
        if len(known) > need:
            return Placed(
                options,
                f"VLLM_GPUS={kept} kept: the profile needs {need} of the {len(known)} devices "
                "here; give the instance its own with --gpus device=... "
                f"(appliance host check {instance} names them)",
            )
        return Placed(options)
    others = claimed(root, instance, q if known else None)
    if asked is not None:
        overlap = _overlap(_aliases(asked, q if known else None), others)
        if overlap and share is None:
            name = overlap[0]
            raise UsageError(
                f"--gpus {asked} overlaps instance {name}'s GPUs ({_held(root, name)})",
                fix="give free ones (appliance host check --profile P names them), or "
                "--share-gpus REASON",
            )
        said = f"GPUs shared with {', '.join(overlap)} (--share-gpus: {share})" if overlap else None
        return Placed(options, said)
    if not known:
        return Placed(options)  # no nvidia-smi here: nothing to choose from (env keeps all)
    taken = (
        frozenset(others) if EVERY not in others else frozenset(a for d in known for a in d.aliases)
    )
    kind, free = choose(prof, q, taken)
    if len(kind) < need:
        return Placed(options)  # too few of its kind at all: the host check says so
    if len(free) < need:
        holders = sorted(set(others.values()))
        raise UsageError(
            f"no free {need} of {kind[0].kind} for profile {prof.name}: "
            f"{len(kind) - len(free)} of {len(kind)} held by {', '.join(holders)}",
            fix="uninstall one, give --gpus device=... with --share-gpus REASON, or a profile "
            "for fewer GPUs",
        )
    refs = ",".join(d.ref for d in free)
    where = ", ".join(d.label() for d in free)
    return Placed(
        replace(options, gpus=f"device={refs}"),
        f"GPUs: {where} of {len(kind)} {kind[0].kind}, the next free (VLLM_GPUS=device={refs})",
    )


def _overlap(aliases: set[str], others: dict[str, str]) -> list[str]:
    if EVERY in aliases:
        return sorted(set(others.values()))
    hit = {others[a] for a in aliases if a in others}
    if EVERY in others:
        hit.add(others[EVERY])
    return sorted(hit)


def _held(root: Path, name: str) -> str:
    gpus = envfile.read(Layout(root).env_file(name)).get(envfile.GPUS_KEY)
    return f"VLLM_GPUS={gpus}"
