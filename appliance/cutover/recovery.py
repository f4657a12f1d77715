"""The way back on demand: ``appliance rollback``, and the recovery of a cutover whose process
was killed (SIGKILL, power loss: its history entry has no end)."""

from __future__ import annotations

from ..errors import ApplianceError
from ..host import envfile
from ..host import lock as locks
from ..host.layout import Layout
from . import gates, history, slot
from .context import Context
from .flow import DEFAULT_TIMEOUT, JOURNAL_LINES, RollbackFailed, cutover, finish
from .history import Entry, Gate
from .signals import guard
from .target import Target
from .targets import target


def rollback(
    ctx: Context,
    instance: str | Target,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    to: str | None = None,
) -> Entry:
    """Return ``instance`` (a name of either shape, or a :class:`Target`) to ``to`` (default:
    the image in its rollback slot, by the ID it kept when its tag has moved since), through
    the same gates; after a killed cutover,
    :func:`recover` it instead. A target without a way back of its own (a group's head whose
    workers run elsewhere: the fleet's play moves them) stays where a failed rollback left it."""
    tgt = target(ctx, instance) if isinstance(instance, str) else instance
    name = tgt.name
    if interrupted_entry(ctx.layout, name) is not None:
        return recover(ctx, tgt, timeout=timeout)
    way_back = slot.read(ctx.layout, name)
    image = to or (pinned(ctx, tgt, way_back.image, way_back.image_id) if way_back else None)
    if not image:
        raise ApplianceError(
            f"{tgt.noun} {name} has no rollback target",
            fix=f"a rollback target is recorded by the first successful "
            f"`{tgt.command('cutover', 'IMAGE')}`",
        )
    # A deliberate return to a pre-MTP image is what a rollback is for: MTP off is allowed.
    return cutover(
        ctx,
        tgt,
        image,
        timeout=timeout,
        rollback=tgt.own_way_back,
        allow_no_mtp=True,
        kind="rollback",
        canary=False,
        way_back_required=False,
    )


def pinned(ctx: Context, tgt: Target, ref: str, image_id: str | None) -> str:
    """Where a way back recorded as ``ref`` naming ``image_id`` goes: ``ref`` while it still
    names that image (or no ID was recorded), else the ID itself (a tag that moved, e.g.
    ``latest`` after an ``appliance image build``, must not take the way back elsewhere)."""
    if image_id is None or ref == image_id:
        return ref
    try:
        now = tgt.inspect(ctx, ref).id
    except ApplianceError:
        now = None
    if now == image_id:
        return ref
    names = f"names another image ({now})" if now else "names no image here"
    ctx.progress(f"{ref} {names} now: returning to the image it named, {image_id}")
    return image_id


def interrupted_entry(layout: Layout, instance: str, *, locked: bool = False) -> Entry | None:
    """The last history entry when its process died without writing an end (SIGKILL, power
    loss), else None. ``locked``: the caller holds the instance's lock (no live holder)."""
    if not locked:
        holder = locks.current_holder(layout.lock_file(instance))
        if holder is not None:
            return None  # still running: not interrupted
    # No live holder (checked above, or the caller holds the lock): a "started" end is a kill.
    found = history.entries(layout.history_file(instance), strict=False)
    return found[-1] if found and found[-1].outcome == "interrupted" else None


def recovery_image(entry: Entry) -> str | None:
    """Where recovering ``entry`` goes: a killed cutover back to the image it left, a killed
    rollback on to the image it was returning to."""
    return entry.from_image if entry.kind == "cutover" else entry.to_image


def recovery_image_id(entry: Entry) -> str | None:
    """The ID :func:`recovery_image` named when ``entry`` began (None in an older line)."""
    return entry.from_image_id if entry.kind == "cutover" else entry.to_image_id


def recover(ctx: Context, instance: str | Target, *, timeout: float = DEFAULT_TIMEOUT) -> Entry:
    """Finish a cutover or rollback whose process was killed: write back the env files saved
    before it (their exact bytes, or the image it left when none were saved) and the rollback
    slot, restart unless that image is already what runs, gate it, and close the killed history
    entry (``rolled_back``, ``interrupted: killed``)."""
    tgt = target(ctx, instance) if isinstance(instance, str) else instance
    name = tgt.name
    layout = ctx.layout
    api_key = tgt.api_key()
    with (
        locks.hold(layout.lock_file(name), name, f"recovery of {name}") as held,
        guard(ctx.progress) as sig,
    ):
        sig.hold(within=timeout)  # recovery is the way back: not interrupted half-way
        entry = interrupted_entry(layout, name, locked=True)
        if entry is None:
            raise ApplianceError(
                f"{tgt.noun} {name} has no interrupted cutover to recover",
                fix=f"`appliance status {name}` shows its state",
            )
        image = recovery_image(entry)
        if image:
            image = pinned(ctx, tgt, image, recovery_image_id(entry))
        if not image:
            raise ApplianceError(
                f"the interrupted {entry.kind} of {name} started from no "
                f"{envfile.IMAGE_KEY}: there is nothing to return to",
                fix=f"`{tgt.command('cutover', 'IMAGE')}` to a working image",
            )
        info = tgt.inspect(ctx, image)
        held.note(entry.id)
        snap = tgt.read()
        saved = layout.saved_env(name)
        content = snap.with_image(image)
        if entry.kind == "cutover":
            prev = tgt.saved(saved)
            if prev is not None and _names(prev, image):
                content = prev  # byte-identical to before the killed cutover
            saved_slot = layout.saved_slot(name)
            if saved_slot.exists():
                slot.restore(layout.rollback_slot(name), saved_slot.read_bytes() or None)
        ctx.progress(
            f"recovering the interrupted {entry.kind} of {name} "
            f"({entry.from_image} -> {entry.to_image}): returning to {image}"
        )
        in_place = content == snap.raw() and tgt.runs(ctx, info)
        tgt.write(content)
        entry.interrupted = "killed"
        why = f"interrupted: the appliance (pid {entry.pid}) was killed"
        try:
            if in_place:
                ctx.progress(f"{name} already runs {image}: gating it without a restart")
            got = tgt.move(ctx, info, api_key, timeout, not in_place)
        except gates.GateFailed as failed:
            got = failed.gates
            entry.error = f"{why}; recovery to {image} failed gate {failed.gate!r}: {failed.detail}"
            _set_gates(entry, got)
            finish(ctx, entry, "failed", entry.error, saved)
            raise RollbackFailed(
                f"recovery of {name} failed: {entry.error}\n{tgt.journal(ctx, JOURNAL_LINES)}"
            ) from None
        _set_gates(entry, got)
        outcome: history.Outcome = "rolled_back" if entry.kind == "cutover" else "ok"
        entry.error = f"{why}; recovered by `{tgt.command('rollback')}`: on {image}"
        return finish(ctx, entry, outcome, entry.error, saved)


def _names(raw: bytes, image: str) -> bool:
    """The saved env file names ``image`` (else it is not where the recovery goes)."""
    try:
        return envfile.parse(raw).get(envfile.IMAGE_KEY) == image
    except ApplianceError:
        return False


def _set_gates(entry: Entry, got: list[Gate]) -> None:
    # A killed cutover's way back is its rollback; a killed rollback's completion its gates.
    if entry.kind == "cutover":
        entry.rollback_gates = got
    else:
        entry.gates = got
