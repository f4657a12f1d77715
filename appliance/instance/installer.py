"""Install or render a NAME of either shape, and the one next step an operator types.

One pipeline for a single-node instance and a multi-node group alike:

1. plan (:func:`appliance.units.planned`): the profile (the operator's file, the copy kept
   beside NAME, or a shipped one), the values the env file keeps, a group's node(s) (the ones
   asked for, else those this host runs, else the head) and a port chosen across every NAME
   installed here, of either shape; then the image (below) and a new GPU instance's devices;
2. render: the single-node templates (:func:`appliance.units.render`), or the group's
   (:func:`appliance.multinode.render`), a profile with a ``[multinode]`` table;
3. check: ``preflight`` (the host check, the same rules and ``--force`` for both shapes);
4. write (:func:`appliance.units.writer.write`) under NAME's lock, refused while a cutover
   holds it: the files, each unit's mounts drop-in, the keys (created or tightened), the
   operator's profile copy, the host's scrape targets.

The shape is decided here and in the plan, once: by the node asked for, else the profile, else
what the host already runs under that name.

The image is decided here too, for both shapes: the one given, else the one the env file keeps,
else :func:`appliance.images.choice.default_image` (the newest version tag of the profile's build
on the host). Where the host's Docker can be asked, an image of the other build (a CPU image for
a GPU profile, or the reverse) is refused before anything is written.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .. import images, multinode, profiles, units
from ..errors import ApplianceError, UsageError
from ..host import envfile
from ..host import lock as locks
from ..host.layout import Layout, Node
from ..host.names import STATE_UNIT, probe_timer
from ..hostcheck import placement
from ..images import choice, variant
from ..models import verify, where
from ..units.writer import Planned, WriteResult, node_for, write, write_tree


@dataclass(frozen=True)
class Installed:
    """What an install wrote, and the command that starts (or restarts) what it installed."""

    result: WriteResult
    next_step: str | None
    devices: str | None = None  # which GPUs a new GPU instance was given, in one line


def install(
    profile: str | profiles.Profile | None,
    name: str,
    *,
    root: Path | str = Path("/"),
    options: units.Options | None = None,
    node: Node | None = None,
    preflight: Callable[[Planned], None] | None = None,
    share_gpus: str | None = None,
) -> Installed:
    """Install ``name`` under ``root`` (an instance, or this host's ``node`` of group ``name``:
    by default the node(s) it runs already, else the head); idempotent, values already in the
    env file kept. ``preflight`` sees the plan, of either shape, before anything is written
    (the host check). The image is judged against the host's Docker where ``root`` may reach
    one. A GPU instance gets its own device set (:mod:`appliance.hostcheck.placement`;
    ``share_gpus``: the reason an explicit --gpus may overlap another instance's). Refused
    (exit 3), before any check and writing nothing, while a cutover of ``name`` holds its
    lock."""
    root = Path(root)
    layout = Layout(root)
    locks.refuse_if_busy(layout.lock_file(name), name)
    plan = units.planned(profile, name, root=root, options=options, node=node)
    plan, notes = _image(images.reachable(root), plan)
    placed = None
    one_set = plan.node is None or len(plan.node.roles) == 1  # (a one-host pair shares one)
    if one_set and (preflight is not None or root == Path("/")):
        # This host's GPUs, as for the host check: under another root only when asked. The
        # devices asked for (not the kept ones) are judged against the other NAMEs'; a group's
        # node is placed as an instance is (its [hardware] gpus are per host).
        kept = plan.existing.get(envfile.GPUS_KEY)
        asked = replace(plan.options, gpus=(options or units.Options()).gpus)
        placed = placement.place(plan.profile, name, root, asked, kept, share=share_gpus)
        gpus = placed.options.gpus if placed.options.gpus is not None else plan.options.gpus
        plan = replace(plan, options=replace(plan.options, gpus=gpus))
    files = render(plan)  # validates everything before the first write
    if preflight is not None:
        preflight(plan)
    models_before = _models_before(plan)
    result = write(plan, files)
    result.warnings[:0] = notes
    now = _models(plan.profile)
    # The engine runs offline and its unit exits 78 without them: a re-install that changed
    # the models, or a first one whose models are not on the host yet, names the pull first.
    if plan.existing:
        pull = now is not None and now != models_before
    else:
        pull = now is not None and not _models_on_host(plan)
    step = next_step(plan, result, pull=pull)
    return Installed(result, step, placed.said if placed else None)


def render(plan: Planned) -> dict[str, units.RenderedFile]:
    """The files ``plan`` installs: the group's templates for a group's node(s), else the
    single-node instance's."""
    if plan.node is not None:
        return multinode.render(plan.profile, plan.instance, plan.node, plan.options)
    return units.render(plan.profile, plan.instance, plan.options)


def next_step(plan: Planned, result: WriteResult, *, pull: bool = False) -> str | None:
    """The command that brings what ``plan`` installed into service, decided per unit: enable
    (and start) each unit it needs that was never enabled here (the one that starts NAME, a
    head's generation probe timer, the host's state timer); restart, where it was enabled
    already and anything changed, the one that reaches every node here; and first, with
    ``pull``, ``appliance models pull NAME`` (the engine runs offline, and the unit would exit
    78 without its models). None when nothing changed."""
    if not (result.changed or result.first_install):
        return None  # as it was: the step said last time still stands
    layout = Layout(plan.root)
    # A group's head starts its local worker first (BindsTo=, After=); the worker's restart
    # reaches its local head (PartOf=). An instance has one unit.
    start, restart = plan.shape.unit, plan.shape.units[-1]
    wanted = [start]
    if "head" in plan.shape.roles:
        wanted.append(probe_timer(plan.instance))
    wanted.append(f"{STATE_UNIT}.timer")
    enable = [u for u in wanted if not _enabled(layout, u)]
    steps = []
    if pull:
        pull_argv = ["appliance", "models", "pull", plan.instance]
        if plan.root != Path("/"):
            pull_argv += ["--root", str(plan.root)]
        steps.append(shlex.join(pull_argv))
    # Until the reload, systemd runs the units as it last read them.
    steps.append("systemctl daemon-reload")
    if start in enable:
        # Never enabled: a restart would start it once and leave it off at the next boot.
        steps.append(f"systemctl enable --now {' '.join(enable)}")
    else:
        steps.append(f"systemctl restart {restart}")
        if enable:
            steps.append(f"systemctl enable --now {' '.join(enable)}")
    return " && ".join(steps)


def _enabled(layout: Layout, unit: str) -> bool:
    """Whether ``systemctl enable`` linked ``unit`` here (its ``WantedBy=`` target's folder)."""
    return os.path.lexists(layout.wants_link(unit))


def _models(prof: profiles.Profile | None) -> tuple | None:
    """The hub models ``prof`` serves (target, drafter, their revisions); None for the tiny dev
    models (MODEL_DIR: nothing to pull) or no profile."""
    if prof is None or prof.uses_devmodel:
        return None
    spec = prof.speculative
    drafter = (spec.model, spec.revision) if spec is not None and spec.model else None
    return (prof.model, prof.revision, drafter)


def _models_on_host(plan: Planned) -> bool:
    """Whether NAME's models are in the cache its env file names (present, not hashed)."""
    loc = where.locate(root=plan.root, instance=plan.instance)
    return verify.verify(loc, quick=True).ok


def _models_before(plan: Planned) -> tuple | None:
    """The hub models NAME served before this install (None: none, or not known)."""
    name = plan.existing.get(envfile.PROFILE_KEY)
    if not name:
        return None
    try:
        return _models(profiles.installed(plan.root, plan.instance, name))
    except UsageError:
        return None  # the old profile is gone: what it served is not known


def _image(client, plan: Planned) -> tuple[Planned, list[str]]:
    """``plan`` with the image install writes (the one given, the env file's, else the chosen
    default), and the warnings; refused (exit 1, as the cutover's preflight and the host
    check's blocker), before anything is written, for an image of the other build than the
    profile's: a well-formed image the profile cannot run, not bad input."""
    prof, opts = plan.profile, plan.options
    notes = []
    image = opts.image  # the one given, else the env file's (the plan's kept values)
    if image is None:
        chosen = choice.default_image(client, prof.hardware.device, prof.mtp, prof.name)
        plan = replace(plan, options=replace(opts, image=chosen.ref))
        image = chosen.ref
        if chosen.warning:
            notes.append(chosen.warning)
    if client is None:
        return plan, notes
    import docker.errors

    try:
        found = client.images.get(image).labels
    except (docker.errors.DockerException, OSError):
        return plan, notes  # not here (or not askable): nothing to judge, as before
    fit = variant.fit(image, found, prof.hardware.device, prof.name)
    if fit.refusal is not None:
        raise ApplianceError(fit.refusal, fix=fit.fix)
    if fit.warning is not None:
        notes.append(fit.warning)
    return plan, notes


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
    out = Path(out)
    prof = profiles.lookup(profile)  # a shipped name or the operator's file
    node = node_for(prof, Layout(out), name, node)
    plan = Planned(name, out, prof, options or units.Options(), {}, None, node)
    return write_tree(Path(out), render(plan))
