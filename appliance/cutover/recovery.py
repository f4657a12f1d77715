"""The way back on demand: ``appliance rollback``, and the recovery of a cutover whose process
was killed (SIGKILL, power loss: its history entry has no end)."""

from __future__ import annotations

from pathlib import Path

from ..errors import EngineError, UsageError
from ..fsutil import write_atomic
from ..host import envfile
from ..host import lock as locks
from ..host.layout import Layout, check_instance
from . import gates, history, slot
from .context import Context
from .flow import (
    DEFAULT_TIMEOUT,
    JOURNAL_LINES,
    RollbackFailed,
    cutover,
    expect,
    finish,
    restart_and_wait,
)
from .history import Entry, Gate
from .preflight import inspect_image, running_image_id, target
from .signals import guard


def rollback(ctx: Context, instance: str, *, timeout: float = DEFAULT_TIMEOUT) -> Entry:
    """Return ``instance`` to the image in its rollback slot, through the same gates; after a
    killed cutover, :func:`recover` it instead."""
    check_instance(instance)
    if interrupted_entry(ctx.layout, instance) is not None:
        return recover(ctx, instance, timeout=timeout)
    image = slot.rollback_image(ctx.layout, instance)
    if not image:
        raise UsageError(
            f"instance {instance} has no rollback target",
            fix="a rollback target is recorded by the first successful `appliance cutover`",
        )
    # A deliberate return to a pre-MTP image is what a rollback is for: MTP off is allowed.
    return cutover(
        ctx,
        instance,
        image,
        timeout=timeout,
        allow_no_mtp=True,
        kind="rollback",
        canary=False,
        way_back_required=False,
    )


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


def recovery_command(layout: Layout, instance: str) -> str:
    """The one command that recovers a killed cutover of ``instance``."""
    root = "" if layout.root == Path("/") else f" --root {layout.root}"
    return f"appliance rollback {instance}{root}"


def recover(ctx: Context, instance: str, *, timeout: float = DEFAULT_TIMEOUT) -> Entry:
    """Finish a cutover or rollback whose process was killed: write back the env file saved
    before it (its exact bytes, or the image it left when none was saved) and the rollback slot,
    restart unless that image is already what runs, gate it, and close the killed history entry
    (``rolled_back``, ``interrupted: killed``)."""
    check_instance(instance)
    layout = ctx.layout
    tgt = target(ctx, instance)
    api_key = tgt.api_key()
    with (
        locks.hold(layout.lock_file(instance), instance, f"recovery of {instance}") as held,
        guard(ctx.progress) as sig,
    ):
        sig.hold(within=timeout)  # recovery is the way back: not interrupted half-way
        entry = interrupted_entry(layout, instance, locked=True)
        if entry is None:
            raise UsageError(
                f"instance {instance} has no interrupted cutover to recover",
                fix=f"`appliance status {instance}` shows its state",
            )
        image = recovery_image(entry)
        if not image:
            raise UsageError(
                f"the interrupted {entry.kind} of {instance} started from no "
                f"{envfile.IMAGE_KEY}: there is nothing to return to",
                fix=f"`appliance cutover {instance} IMAGE` to a working image",
            )
        info = inspect_image(ctx, image)
        held.note(entry.id)
        env = envfile.read(tgt.env_path)
        saved = layout.saved_env(instance)
        raw = env.with_value(envfile.IMAGE_KEY, image)
        if entry.kind == "cutover" and saved.exists():
            prev = saved.read_bytes()
            if envfile.parse(prev, str(saved)).get(envfile.IMAGE_KEY) == image:
                raw = prev  # byte-identical to before the killed cutover
            saved_slot = layout.saved_slot(instance)
            if saved_slot.exists():
                slot.restore(layout.rollback_slot(instance), saved_slot.read_bytes() or None)
        unit = tgt.unit
        ctx.progress(
            f"recovering the interrupted {entry.kind} of {instance} "
            f"({entry.from_image} -> {entry.to_image}): returning to {image}"
        )
        in_place = (
            raw == env.raw
            and ctx.systemd.state(unit).active == "active"
            and _running_or_none(ctx, tgt.container) == info.id
        )
        write_atomic(tgt.env_path, raw)
        entry.interrupted = "killed"
        why = f"interrupted: the appliance (pid {entry.pid}) was killed"
        try:
            if in_place:
                ctx.progress(f"{unit} already runs {image}: gating it without a restart")
            got = restart_and_wait(
                ctx, unit, expect(tgt, info, api_key), timeout, restart=not in_place
            )
        except gates.GateFailed as failed:
            got = failed.gates
            entry.error = f"{why}; recovery to {image} failed gate {failed.gate!r}: {failed.detail}"
            _set_gates(entry, got)
            finish(ctx, entry, "failed", entry.error, saved)
            journal = ctx.systemd.journal(unit, JOURNAL_LINES)
            raise RollbackFailed(
                f"recovery of {instance} failed: {entry.error}\n"
                f"last journal lines of {unit}:\n{journal}"
            ) from None
        _set_gates(entry, got)
        outcome: history.Outcome = "rolled_back" if entry.kind == "cutover" else "ok"
        entry.error = f"{why}; recovered by `{recovery_command(layout, instance)}`: on {image}"
        return finish(ctx, entry, outcome, entry.error, saved)


def _set_gates(entry: Entry, got: list[Gate]) -> None:
    # A killed cutover's way back is its rollback; a killed rollback's completion its gates.
    if entry.kind == "cutover":
        entry.rollback_gates = got
    else:
        entry.gates = got


def _running_or_none(ctx: Context, container: str) -> str | None:
    try:
        return running_image_id(ctx, container)
    except EngineError:
        return None
