"""Install or render an instance of either shape, and the one next step an operator types.

A profile with a ``[multinode]`` table is served by a group: this host's node(s) of it are
installed by :mod:`appliance.multinode` (``node``: head, worker or both, and a worker's rank);
any other profile by :mod:`appliance.units`. Which one is decided here, once: by the node
asked for, else the profile given, else what the host already runs under that name.

The image is decided here too, for both shapes: the one given, else the one the env file keeps,
else :func:`appliance.images.choice.default_image` (the newest version tag of the profile's build
on the host). Where the host's Docker can be asked, an image of the other build (a CPU image for
a GPU profile, or the reverse) is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from . import images, multinode, profiles, units
from .errors import UsageError
from .host import envfile
from .host.layout import Layout, Node
from .host.names import STATE_UNIT, node_unit, unit_name
from .hostcheck import placement
from .images import choice, variant
from .units.writer import WriteResult, write_tree


@dataclass(frozen=True)
class Installed:
    """What an install wrote, and the command that starts (or restarts) what it installed."""

    result: WriteResult
    next_step: str | None
    devices: str | None = None  # which GPUs a new GPU instance was given, in one line


def group_profile(
    profile: str | profiles.Profile | None, name: str, root: Path, node: Node | None
) -> profiles.Profile | None:
    """The multi-node profile ``name`` is installed with, None for a single-node instance; a
    UsageError when ``node`` is asked for a profile that serves one host."""
    if profile is None:
        path = Layout(root).env_file(name)
        if not Layout(root).shape(name).group or not path.exists():
            if node is not None:
                raise UsageError("--role needs the group's --profile on its first install")
            return None
        profile = envfile.read(path).get(envfile.PROFILE_KEY) or ""
    if isinstance(profile, str) and profiles.is_file_ref(profile):
        prof, _ = profiles.operators_file(profile)  # its errors name the file as given
    else:
        prof = profiles.get(profile) if isinstance(profile, str) else profile
    if prof.multinode is None:
        if node is not None:
            raise UsageError(
                f"profile {prof.name} serves one host: --role and --rank apply to a profile "
                "with a [multinode] table"
            )
        return None
    return prof


def install(
    profile: str | profiles.Profile | None,
    name: str,
    *,
    root: Path | str = Path("/"),
    options: units.Options | None = None,
    node: Node | None = None,
    preflight: Callable[[units.Planned], None] | None = None,
    share_gpus: str | None = None,
) -> Installed:
    """Install ``name`` under ``root`` (an instance, or this host's ``node`` of group ``name``:
    the head by default); idempotent, values already in the env file kept. ``preflight`` sees
    a single-node install before anything is written (``appliance install``'s host check).
    The image is judged against the host's Docker where ``root`` may reach one. A GPU
    instance gets its own device set (:mod:`appliance.hostcheck.placement`; ``share_gpus``:
    the reason an explicit --gpus may overlap another instance's)."""
    root = Path(root)
    first = not Layout(root).env_file(name).exists()
    group = group_profile(profile, name, root, node)
    options, notes = _image(
        images.reachable(root), group or profile, name, root, options or units.Options()
    )
    placed = None
    if group is not None:
        node = node or Node()
        result = multinode.install(group, name, node, root=root, options=options)
        # The worker's host starts its worker; the head's starts the head (and, where both run
        # here, the worker with it: BindsTo=).
        unit = node_unit(name, "head" if "head" in node.roles else "worker")
    else:
        if preflight is not None or root == Path("/"):
            # This host's GPUs, as for the host check: under another root only when asked.
            plan = units.planned(profile, name, root=root, options=options)
            kept = plan.existing.get(envfile.GPUS_KEY)
            placed = placement.place(plan.profile, name, root, options, kept, share=share_gpus)
            options = placed.options
        result = units.install(profile, name, root=root, options=options, preflight=preflight)
        unit = unit_name(name)
    result.warnings[:0] = notes
    if first:
        # Never enabled yet: restart would start it once and leave it off at the next boot.
        step = f"systemctl daemon-reload && systemctl enable --now {unit} {STATE_UNIT}.timer"
    elif result.changed:
        # Until the reload, systemd runs the unit as it last read it.
        step = f"systemctl daemon-reload && systemctl restart {unit}"
    else:
        step = None
    return Installed(result, step, placed.said if placed else None)


def _image(
    client, profile: str | profiles.Profile | None, name: str, root: Path, opts: units.Options
) -> tuple[units.Options, list[str]]:
    """``opts`` with the image install writes (the one given, the env file's, else the chosen
    default), and the warnings; a UsageError, before anything is written, for an image of the
    other build than the profile's."""
    existing = Layout(root).env_file(name)
    kept = envfile.read(existing).get(envfile.IMAGE_KEY) if existing.exists() else None
    if isinstance(profile, profiles.Profile):
        prof = profile
    else:
        prof = units.planned(profile, name, root=root, options=opts).profile
    notes = []
    image = opts.image or kept
    if image is None:
        chosen = choice.default_image(client, prof.hardware.device, prof.mtp, prof.name)
        opts = replace(opts, image=chosen.ref)
        image = chosen.ref
        if chosen.warning:
            notes.append(chosen.warning)
    if client is None:
        return opts, notes
    import docker.errors

    try:
        found = client.images.get(image).labels
    except (docker.errors.DockerException, OSError):
        return opts, notes  # not here (or not askable): nothing to judge, as before
    fit = variant.fit(image, found, prof.hardware.device, prof.name)
    if fit.refusal is not None:
        raise UsageError(fit.refusal, fix=fit.fix)
    if fit.warning is not None:
        notes.append(fit.warning)
    return opts, notes


def render_to(
    profile: str,
    name: str,
    out: Path,
    options: units.Options | None = None,
    *,
    node: Node | None = None,
) -> WriteResult:
    """Render ``name``'s files into ``out`` as install lays them out under a root (no API
    key): an instance's, or the group node's ``node`` (the head by default)."""
    group = group_profile(profile, name, out, node)
    if group is None:
        return units.render_to(profile, name, out, options)
    return write_tree(out, multinode.render(group, name, node or Node(), options))
