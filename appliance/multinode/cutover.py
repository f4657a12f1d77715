"""Cutover and rollback of a multi-node group: every node moves to the same image or none does.

Built from the single-host cutover's public pieces (``appliance.cutover``: image inspection and
compatibility, the lock, the history, the rollback slot's format, the gates), not from
``flow.cutover`` itself: that one is bound to ONE env file and the unit
``gemma4-vllm@<instance>``, while a group has one env file per host and a head and worker units.

    preflight (nothing touched): every host's env file names the same image (a split group is
    refused), the new image is on every host with the SAME image ID, its labels fit the profile,
    the current image is present too (the way back)
    -> lock the group (on the head's host), every env file read again under it
    -> history "started" -> rollback slot
    -> VLLM_IMAGE written on every host (a failed write puts back the ones written)
    -> restart: worker hosts first, then the head's host (where the worker shares the head's host
       its restart takes the head with it: BindsTo=/PartOf=)
    -> gates ON THE HEAD (unit active on a new start, its container on the new image, /health,
       model and version, one generation, MTP counters moving), then every worker unit active on
       a new start with its container on the new image
    -> ok, or: the saved env files written back on every host, the same restart and gates for
       the old image -> "rolled_back" (or "failed" when the way back fails too).

Each host is a :class:`Host`: its root (``/`` on a real host), the systemd it runs (a prefix
such as ``ssh HOST`` reaches another host's systemctl, see ``appliance.host.systemd``) and
its Docker client. The history, lock and rollback slot live on the head's host.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import apikey, imageref, profiles
from ..cutover import gates, history
from ..cutover.context import Context, PreflightError
from ..cutover.flow import CutoverFailed, CutoverInterrupted, RollbackFailed, interrupted_gates
from ..cutover.history import Entry, Gate
from ..cutover.preflight import ImageInfo, check_compatible, inspect_image
from ..cutover.signals import Interrupted, guard
from ..cutover.slot import rollback_image
from ..errors import UsageError
from ..fsutil import write_atomic
from ..host import envfile
from ..host import lock as locks
from ..host.layout import Layout
from ..host.systemd import Systemd, SystemdError
from ..host.values import base_url
from . import (
    Node,
    api_key_path,
    check_group,
    container_name,
    env_path,
    require_multinode,
    require_one_image,
    unit_name,
)

DEFAULT_TIMEOUT = 900.0
JOURNAL_LINES = 20


@dataclass
class Host:
    """One host of the group, as the cutover reaches it."""

    name: str
    node: Node
    root: Path = Path("/")
    systemd: Systemd = field(default_factory=Systemd.from_env)
    docker_client: object | None = None  # None: the head context's client

    def env_file(self, group: str) -> Path:
        return Path(self.root) / env_path(group)


@dataclass
class _Plan:
    group: str
    head: Host
    workers: list[Host]  # hosts running a worker and no head
    hosts: list[Host]
    profile: profiles.Profile
    base_url: str
    api_key: str | None


def _plan(group: str, hosts: Sequence[Host]) -> _Plan:
    check_group(group)
    heads = [h for h in hosts if "head" in h.node.roles]
    if len(heads) != 1:
        raise UsageError(f"group {group}: {len(heads)} hosts run the head", fix="exactly one")
    head = heads[0]
    env = envfile.read(head.env_file(group))
    prof = require_multinode(profiles.get(env.get("APPLIANCE_PROFILE") or ""))
    ranks = sorted(h.node.rank for h in hosts if "worker" in h.node.roles)
    assert prof.multinode is not None
    if ranks != list(range(1, prof.multinode.nodes)):
        raise UsageError(
            f"group {group}: worker ranks {ranks}, profile {prof.name} has "
            f"{prof.multinode.nodes} nodes",
            fix=f"name every worker host once, ranks 1..{prof.multinode.nodes - 1}",
        )
    url = base_url(env.get("VLLM_HOST") or "127.0.0.1", env.get("VLLM_PORT"))
    key = apikey.read(Path(head.root) / api_key_path(group, "head"))
    workers = [h for h in hosts if "head" not in h.node.roles]
    return _Plan(group, head, workers, list(hosts), prof, url, key)


def _inspect_everywhere(ctx: Context, plan: _Plan, ref: str) -> ImageInfo:
    """The image on the head's Docker; every other host must hold the same image ID."""
    info = inspect_image(ctx, ref)
    for h in plan.hosts:
        if h.docker_client is None or h.docker_client is ctx.docker_client:
            continue
        other = inspect_image(Context(docker_client=h.docker_client), ref)
        if other.id != info.id:
            raise PreflightError(
                f"image {ref} is {other.id[:19]} on {h.name} but {info.id[:19]} on "
                f"{plan.head.name}: the nodes would run different engines",
                fix="load the same image on every host (docker save | docker load)",
            )
    return info


def _running_image(client) -> Callable[[str], str | None]:
    import docker

    def image_of(container: str) -> str | None:
        try:
            return client.containers.get(container).attrs.get("Image")
        except docker.errors.NotFound:
            return None

    return image_of


def _write_all(plan: _Plan, content: dict[str, bytes]) -> None:
    """Write each host's env file (workers first); on a failure put back those written."""
    done: list[tuple[Host, bytes]] = []
    try:
        for h in [*plan.workers, plan.head]:
            path = h.env_file(plan.group)
            before = path.read_bytes()
            write_atomic(path, content[h.name])
            done.append((h, before))
    except OSError:
        for h, before in reversed(done):
            with contextlib.suppress(OSError):
                write_atomic(h.env_file(plan.group), before)
        raise


def _restart(ctx: Context, plan: _Plan) -> dict[str, str]:
    """Restart the group in order; returns the InvocationID of every unit before it."""
    g = plan.group
    before = {}
    for h in plan.hosts:
        for role in h.node.roles:
            before[f"{h.name}/{role}"] = h.systemd.invocation_id(unit_name(g, role))
            # Every unit the restart reaches, not only the one restarted: a head restarted
            # through its worker (PartOf=) would count this start against its start limit, and
            # a cutover and its rollback would leave it one worker death from `failed`.
            h.systemd.reset_failed(unit_name(g, role))
    try:
        for h in plan.workers:
            ctx.progress(f"restarting {unit_name(g, 'worker')} on {h.name}")
            h.systemd.restart(unit_name(g, "worker"))
        head = plan.head
        # Where the worker shares the head's host, its restart reaches the head (PartOf=).
        role = "worker" if head.node.colocated else "head"
        ctx.progress(f"restarting {unit_name(g, role)} on {head.name}")
        head.systemd.restart(unit_name(g, role))
    except SystemdError as exc:
        gate = Gate("restart", False, 0.0, str(exc))
        raise gates.GateFailed("restart", str(exc), [gate]) from exc
    return before


def _gates(ctx: Context, plan: _Plan, image: ImageInfo, timeout: float) -> list[Gate]:
    """Restart the group and run the gates on the head, then check every worker."""
    t0 = time.monotonic()
    before = _restart(ctx, plan)
    head = plan.head
    client = head.docker_client or ctx.docker()
    expect = gates.Expect(
        unit=unit_name(plan.group, "head"),
        base_url=plan.base_url,
        served_model=plan.profile.served_model_name,
        vllm_version=image.vllm_version,
        mtp=plan.profile.mtp and image.mtp,
        api_key=plan.api_key,
        previous_invocation=before[f"{head.name}/head"],
        container=container_name(plan.group, "head"),
        image=image.ref,
        image_id=image.id,
    )
    passed = gates.wait(
        head.systemd,
        expect,
        timeout=timeout,
        progress=ctx.progress,
        running_image=_running_image(client),
    )
    for h in plan.hosts:
        if "worker" not in h.node.roles:
            continue
        passed.append(_worker_gate(ctx, plan, h, image, before[f"{h.name}/worker"], t0))
        if not passed[-1].ok:
            raise gates.GateFailed(passed[-1].name, passed[-1].detail, passed)
    return passed


def _worker_gate(
    ctx: Context, plan: _Plan, h: Host, image: ImageInfo, previous: str, t0: float
) -> Gate:
    unit = unit_name(plan.group, "worker")
    st = h.systemd.state(unit)
    got = _running_image(h.docker_client or ctx.docker())(container_name(plan.group, "worker"))
    name = f"worker {h.name}"
    secs = round(time.monotonic() - t0, 2)
    if st.active != "active" or not st.invocation or st.invocation == previous:
        return Gate(name, False, secs, f"{unit} is {st.active} ({st.sub}), not a new start")
    if got != image.id:
        return Gate(name, False, secs, f"its container runs {got or 'nothing'}, not {image.ref}")
    detail = f"{unit} active on a new start, container on {image.ref}"
    ctx.progress(f"{name}: ok ({detail})")
    return Gate(name, True, secs, detail)


def _finish(layout: Layout, entry: Entry, outcome: history.Outcome, error: str | None) -> Entry:
    entry.outcome = outcome
    entry.error = error
    entry.finished = time.time()
    history.append(layout.history_file(entry.instance), entry)
    return entry


def cutover(
    ctx: Context,
    group: str,
    image: str,
    hosts: Sequence[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    allow_no_mtp: bool = False,
    kind: history.Kind = "cutover",
) -> Entry:
    """Move every node of ``group`` to ``image`` through the gates on the head; on failure,
    every node back to the image they ran. ``ctx.layout`` is the head's root (history, lock,
    rollback slot). Raises PreflightError (nothing touched), CutoverFailed (rolled back) or
    RollbackFailed (the way back failed too)."""
    imageref.validate(image)
    plan = _plan(group, hosts)
    layout = ctx.layout
    envs = {h.name: envfile.read(h.env_file(group)) for h in plan.hosts}
    current = require_one_image({n: e.get(envfile.IMAGE_KEY) for n, e in envs.items()})
    new = _inspect_everywhere(ctx, plan, image)
    check_compatible(new, plan.profile, allow_no_mtp=allow_no_mtp)
    old = _inspect_everywhere(ctx, plan, current) if current else None

    lock = locks.hold(layout.lock_file(group), group, f"{kind} to {image}")
    with lock as held, guard(ctx.progress) as sig:
        # Read again under the lock: the files a concurrent cutover or install left are the
        # ones replaced, and written back on the way back; the image they name is the way back.
        plan = _plan(group, hosts)
        envs = {h.name: envfile.read(h.env_file(group)) for h in plan.hosts}
        was = current
        current = require_one_image({n: e.get(envfile.IMAGE_KEY) for n, e in envs.items()})
        if current != was:
            old = _inspect_everywhere(ctx, plan, current) if current else None
        # The history line and the slot go together: a signal waits for them.
        sig.defer()
        entry = Entry.begin(group, kind, current, image)
        held.note(entry.id)
        history.append(layout.history_file(group), entry)
        slot = layout.rollback_slot(group)
        slot_before = slot.read_bytes() if slot.exists() else None
        if current and current != image:
            body = {"image": current, "recorded": time.time(), "entry": entry.id}
            write_atomic(slot, json.dumps(body) + "\n", mode=0o644)
        ctx.progress(f"{kind} {group}: {current} -> {image} on {len(plan.hosts)} host(s)")
        touched = False
        try:
            sig.arm()  # a signal that came meanwhile interrupts here, before any env write
            touched = True
            _write_all(plan, {n: e.with_value(envfile.IMAGE_KEY, image) for n, e in envs.items()})
            entry.gates = _gates(ctx, plan, new, timeout)
            sig.hold()  # every gate passed: a signal from here on is too late to matter
        except gates.GateFailed as failed:
            entry.gates = failed.gates
            failure = f"{image} failed gate {failed.gate!r}: {failed.detail}"
        except Interrupted as stop:
            # Ctrl-C, SIGTERM or a hang-up during the restart or the gates: every node back.
            entry.gates = interrupted_gates(stop, entry.gates)
            entry.interrupted = stop.name
            failure = f"interrupted by {stop.name} during the gates of {image}"
            ctx.progress(f"{failure}: returning every node to {current}")
        else:
            return _finish(layout, entry, "ok", None)
        # The way back is not interrupted by the next signal; it is bounded by --timeout.
        sig.hold(within=timeout)
        if not touched:
            if slot_before is None:
                slot.unlink(missing_ok=True)
            else:
                write_atomic(slot, slot_before)
            error = f"{failure}; stopped before any env file was written, nothing changed"
            _finish(layout, entry, "rolled_back", error)
            raise CutoverInterrupted(f"{kind} of {group} {error}")

        if old is None:
            _finish(layout, entry, "failed", failure)
            raise RollbackFailed(
                f"{kind} of {group} failed: {failure}; NOT rolled back: no previous image",
                fix=f"`appliance multinode cutover {group} IMAGE` to a working one",
            )
        ctx.progress(f"rolling back every node of {group} to {current}")
        _write_all(plan, {n: e.raw for n, e in envs.items()})
        if slot_before is None:
            slot.unlink(missing_ok=True)
        else:
            write_atomic(slot, slot_before)
        try:
            entry.rollback_gates = _gates(ctx, plan, old, timeout)
        except gates.GateFailed as back:
            entry.rollback_gates = back.gates
            journal = plan.head.systemd.journal(unit_name(group, "head"), JOURNAL_LINES)
            error = f"{failure}; rollback to {current} failed gate {back.gate!r}: {back.detail}"
            _finish(layout, entry, "failed", error)
            raise RollbackFailed(
                f"{kind} of {group} failed: {error}\nlast journal lines of the head:\n{journal}"
            ) from None
        _finish(layout, entry, "rolled_back", failure)
        raise CutoverFailed(
            f"{kind} of {group} failed: {failure}; every node rolled back to {current}, "
            "which passed the gates"
        )


def rollback(
    ctx: Context, group: str, hosts: Sequence[Host], *, timeout: float = DEFAULT_TIMEOUT
) -> Entry:
    """Every node of ``group`` back to the image in the group's rollback slot, same gates."""
    image = rollback_image(ctx.layout, check_group(group))
    if not image:
        raise UsageError(
            f"group {group} has no rollback target",
            fix="a rollback target is recorded by the first successful multinode cutover",
        )
    return cutover(ctx, group, image, hosts, timeout=timeout, allow_no_mtp=True, kind="rollback")
