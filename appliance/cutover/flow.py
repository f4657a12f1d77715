"""Cutover and rollback as one state machine, and the status of an instance.

cutover(instance, image):
  preflight (nothing touched yet): reference valid, the output canary's set valid (when on),
  image present locally (never pulled), labels compatible with the instance's profile, the
  current image present too (it is the way back), nothing else sets VLLM_IMAGE for the unit
  (a second EnvironmentFile, a drop-in)
  -> lock the instance -> canary "before" on the old image (an engine error refuses the
  cutover, still untouched) -> history "started" -> save the env file's bytes and the rollback
  slot's, record the current image as the rollback target -> write VLLM_IMAGE atomically
  -> restart -> gates (the running container's image ID among them)
  -> canary "after" on the new image, compared with "before" (the last gate); when the old image
     drafted nothing (no MTP), its acceptance is judged against the instance's acceptance
     baseline instead (the last passing canary record that drafted)
  -> ok: the after-record becomes the acceptance baseline when it drafted; history "ok"
  -> a gate failed, or SIGINT/SIGTERM/SIGHUP arrived (signals.py): write the saved bytes back,
     restart, same gates for the old image (further signals are ignored meanwhile)
     -> history "rolled_back", exit non-zero saying what failed and that it rolled back
     -> the way back failed too: history "failed", exit non-zero with the unit's journal.

rollback(instance) (:mod:`.recovery`) is a cutover to the image in the rollback slot, through
the same gates, without the canary (the way back must not wait on, or be refused by, a
comparison). When the
last cutover was killed (SIGKILL, power loss: its history entry has no end), rollback is
:func:`appliance.cutover.recovery.recover` instead: back to where that cutover started (the
saved env file's bytes and rollback slot), through the gates, and the killed entry is closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from .. import canary as canaries
from .. import imageref
from ..canary import baseline as baselines
from ..canary.gate import GATE as CANARY_GATE
from ..errors import ApplianceError, EngineError, UsageError
from ..fsutil import private_dir, write_atomic
from ..host import envfile
from ..host import lock as locks
from ..host.layout import check_instance
from ..host.systemd import SystemdError
from ..units.instance import Instance
from . import gates, history, metrics, slot
from .context import Context, PreflightError
from .history import Entry, Gate
from .preflight import (
    ImageInfo,
    check_compatible,
    check_unit_overrides,
    inspect_image,
    running_image_id,
    target,
    way_back,
)
from .signals import Interrupted, guard

DEFAULT_TIMEOUT = 600.0

JOURNAL_LINES = 20


class CutoverFailed(ApplianceError):
    """The new image failed its gates; the previous one is serving again."""

    exit_code = 1


class RollbackFailed(ApplianceError):
    """The new image failed and the way back failed too (or was not allowed)."""

    exit_code = 4


class CutoverInterrupted(ApplianceError):
    """A signal stopped the cutover before anything was touched."""

    exit_code = 1


def expect(inst: Instance, image: ImageInfo, api_key: str | None) -> gates.Expect:
    return gates.Expect(
        unit=inst.unit,
        base_url=inst.base_url,
        served_model=inst.served_model,
        vllm_version=image.vllm_version,
        mtp=inst.profile.mtp and image.mtp,
        api_key=api_key,
        container=inst.container,
        image=image.ref,
        image_id=image.id,
    )


def cutover(
    ctx: Context,
    instance: str,
    image: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    rollback: bool = True,
    allow_no_mtp: bool = False,
    kind: history.Kind = "cutover",
    canary: bool | None = None,
    canary_files: tuple[Path, ...] = (),
    way_back_required: bool = True,
    allow_unit_overrides: bool = False,
    canary_timeout: float = canaries.DEFAULT_TIMEOUT,
) -> Entry:
    """Move ``instance`` to ``image`` through the gates; on failure, back to where it was.

    ``canary``: run the output canary (None: the profile's ``[canary] enabled``);
    ``canary_files``: the operator's JSONL cases, added to the shipped set;
    ``canary_timeout``: the seconds each side of the canary may take (on top of ``timeout``).
    ``way_back_required``: refuse when the current image cannot be the way back (a rollback
    goes ahead instead: a missing or broken current image is what it is there for).
    ``allow_unit_overrides``: warn instead of refusing when a drop-in or another env file may
    set the image (:func:`unit_overrides`).
    """
    check_instance(instance)
    imageref.validate(image)
    layout = ctx.layout
    tgt = target(ctx, instance)
    env_path = tgt.env_path
    api_key = tgt.api_key()
    # The canary's set is read and checked here: a malformed line refuses the cutover untouched.
    plan = canaries.plan(tgt.profile, root=layout.root, enabled=canary, files=canary_files)
    new = inspect_image(ctx, image)
    check_compatible(new, tgt.profile, allow_no_mtp=allow_no_mtp)
    check_unit_overrides(ctx, tgt, allow=allow_unit_overrides)
    # Refused here, nothing is written, not even the lock.
    old, unusable = way_back(ctx, tgt.image, image, rollback, way_back_required)

    lock = locks.hold(layout.lock_file(instance), instance, f"{kind} to {image}")
    with lock as held, guard(ctx.progress) as sig:
        for d in layout.private_dirs(instance):
            private_dir(d)
        # Read again under the lock: the file a concurrent cutover left is the one we replace,
        # and the image it names is the way back.
        env = envfile.read(env_path)
        current_ref = env.get(envfile.IMAGE_KEY)
        if current_ref != tgt.image:
            old, unusable = way_back(ctx, current_ref, image, rollback, way_back_required)
        ctx.progress(f"{kind} {instance}: {current_ref} -> {image}")
        # Read before the canary runs: a broken baseline file refuses with nothing touched.
        kept = baselines.load(layout.canary_baseline(instance)) if plan.enabled else None
        # While the old image serves, before anything is written: an engine that cannot answer
        # the canary refuses the cutover with nothing touched; so does a signal.
        try:
            baseline = _canary_before(ctx, plan, tgt, api_key, current_ref, canary_timeout)
        except Interrupted as stop:
            raise CutoverInterrupted(
                f"{kind} of {instance} interrupted by {stop.name} before anything was touched"
            ) from None
        # The history line, the saved files and the slot go together: a signal waits for them.
        sig.defer()
        entry = Entry.begin(instance, kind, current_ref, image)
        held.note(entry.id)
        hist = layout.history_file(instance)
        history.append(hist, entry)

        saved = layout.saved_env(instance)
        write_atomic(saved, env.raw, mode=0o600)
        slot_path = layout.rollback_slot(instance)
        slot_before = slot_path.read_bytes() if slot_path.exists() else None
        # Kept until the cutover ends, for `appliance rollback` after a kill (recover()).
        write_atomic(layout.saved_slot(instance), slot_before or b"", mode=0o644)
        if current_ref and current_ref != image:
            slot.write(layout, instance, current_ref, entry.id)

        unit = tgt.unit
        touched = False
        canary_result = None
        try:
            sig.arm()  # a signal that came meanwhile interrupts here, before the env write
            touched = True
            write_atomic(env_path, env.with_value(envfile.IMAGE_KEY, image))
            entry.gates = restart_and_wait(ctx, unit, expect(tgt, new, api_key), timeout)
            if baseline is not None:
                canary_result = _canary_after(
                    ctx, plan, baseline, tgt, api_key, image, entry, canary_timeout, kept
                )
            sig.hold()  # every gate passed: a signal from here on is too late to matter
        except gates.GateFailed as failed:
            entry.gates = failed.gates
            failure = f"{image} failed gate {failed.gate!r}: {failed.detail}"
        except Interrupted as stop:
            entry.gates = interrupted_gates(stop, entry.gates)
            entry.interrupted = stop.name
            failure = f"interrupted by {stop.name} during the gates of {image}"
            ctx.progress(f"{failure}: returning to {current_ref or 'the previous env file'}")
        else:
            if canary_result is not None:
                _keep_baseline(ctx, instance, canary_result)
            return finish(ctx, entry, "ok", None, saved)
        # The way back is not interrupted by the operator's next Ctrl-C or hang-up; it is bounded
        # by the same --timeout as the gates.
        sig.hold(within=timeout)
        if not touched:
            # Stopped before the env file was written: the unit was never touched.
            slot.restore(slot_path, slot_before)
            entry.error = f"{failure}; stopped before the env file was written, nothing changed"
            finish(ctx, entry, "rolled_back", entry.error, saved)
            raise CutoverInterrupted(f"{kind} of {instance} {entry.error}")

        if not rollback or old is None:
            entry.error = failure
            finish(ctx, entry, "failed", failure, saved)
            if not rollback:
                why = "NOT rolled back (--no-rollback)"
            elif unusable:
                why = f"NOT rolled back: the image it left, {current_ref}, cannot be inspected"
            else:
                why = (
                    f"NOT rolled back: {env_path} named no previous {envfile.IMAGE_KEY} "
                    "to return to"
                )
            if current_ref and not unusable:
                fix = (
                    f"the unit runs {image}; `appliance rollback {instance}` returns to "
                    f"{current_ref}"
                )
            else:
                fix = (
                    f"the unit runs {image}; `appliance cutover {instance} IMAGE` to a working one"
                )
            raise RollbackFailed(f"{kind} of {instance} failed: {failure}; {why}", fix=fix)

        ctx.progress(f"rolling back {instance} to {current_ref}")
        write_atomic(env_path, env.raw)
        # We are back where we were: the rollback target is what it was before.
        slot.restore(slot_path, slot_before)
        try:
            entry.rollback_gates = restart_and_wait(ctx, unit, expect(tgt, old, api_key), timeout)
        except gates.GateFailed as back:
            entry.rollback_gates = back.gates
            journal = ctx.systemd.journal(unit, JOURNAL_LINES)
            entry.error = (
                f"{failure}; rollback to {current_ref} failed gate {back.gate!r}: {back.detail}"
            )
            finish(ctx, entry, "failed", entry.error, saved)
            raise RollbackFailed(
                f"{kind} of {instance} failed: {failure}; the rollback to {current_ref} ALSO "
                f"failed gate {back.gate!r}: {back.detail}\n"
                f"last journal lines of {unit}:\n{journal}"
            ) from None
        entry.error = failure
        finish(ctx, entry, "rolled_back", failure, saved)
        what = "was" if entry.interrupted else "failed:"
        raise CutoverFailed(
            f"{kind} of {instance} {what} {failure}; rolled back to {current_ref}, "
            "which passed the gates and is serving"
        )


def interrupted_gates(stop: Interrupted, so_far: list[Gate]) -> list[Gate]:
    """The gates up to a signal, and the interruption as the failed one."""
    done = list(stop.gates if stop.gates is not None else so_far)
    at = done[-1].seconds if done else 0.0
    return [*done, Gate("interrupted", False, at, f"{stop.name} received")]


def _canary_before(
    ctx: Context,
    plan: canaries.Plan,
    tgt: Instance,
    api_key: str | None,
    image: str | None,
    within: float,
) -> canaries.Record | None:
    """Record the old image's answers (None when the canary is off)."""
    if not plan.enabled:
        ctx.progress("canary: off")
        return None
    if not image:
        # Nothing was serving by this env file: there is no baseline to keep answers from.
        ctx.progress(f"canary: skipped (the env file names no {envfile.IMAGE_KEY} to record)")
        return None
    try:
        return canaries.before(
            plan,
            tgt.base_url,
            tgt.served_model,
            api_key=api_key,
            image=image,
            save_to=ctx.layout.canary_record(tgt.name, "before"),
            progress=ctx.progress,
            within=within,
        )
    except EngineError as exc:
        raise PreflightError(
            f"the output canary cannot record the serving image {image}: {exc}",
            fix="the canary records the old image's answers before the restart: get it "
            "serving, or pass --no-canary",
        ) from exc


def _canary_after(
    ctx: Context,
    plan: canaries.Plan,
    baseline: canaries.Record,
    tgt: Instance,
    api_key: str | None,
    image: str,
    entry: Entry,
    within: float,
    kept: baselines.Baseline | None = None,
) -> canaries.Result:
    """The canary gate: run the set on the new image and judge it against ``baseline`` (and
    against ``kept``, the acceptance baseline, when ``baseline`` drafted nothing).

    Appends the gate to ``entry.gates`` and keeps the figures in ``entry.canary``; a failure (or
    an engine error while it runs) raises :class:`gates.GateFailed`, so the cutover rolls back.
    """
    since_restart = entry.gates[-1].seconds if entry.gates else 0.0
    try:
        result = canaries.after(
            plan,
            baseline,
            tgt.base_url,
            tgt.served_model,
            api_key=api_key,
            image=image,
            save_to=ctx.layout.canary_record(tgt.name, "after"),
            progress=ctx.progress,
            within=within,
            acceptance_baseline=kept,
        )
    except (EngineError, UsageError) as exc:
        entry.canary = {
            "verdict": "error",
            "error": str(exc),
            "seconds_before": baseline.seconds,
            "seconds_per_prompt_before": round(baseline.seconds_per_prompt, 3),
        }
        gate = Gate(CANARY_GATE, False, since_restart, f"the canary could not run: {exc}")
        entry.gates.append(gate)
        ctx.progress(f"canary: FAILED ({gate.detail})")
        raise gates.GateFailed(gate.name, gate.detail, entry.gates) from exc
    entry.canary = result.figures()
    gate = Gate(
        CANARY_GATE,
        result.ok,
        round(since_restart + result.after.seconds, 2),
        result.summary(),
    )
    entry.gates.append(gate)
    if not result.ok:
        raise gates.GateFailed(gate.name, gate.detail, entry.gates)
    return result


def _keep_baseline(ctx: Context, instance: str, result: canaries.Result) -> None:
    """Keep the passed cutover's after-record as the acceptance baseline when it drafted; a
    failure to write it is reported, never undoes a cutover that passed."""
    try:
        kept = baselines.keep(result.after, ctx.layout.canary_baseline(instance))
    except (OSError, ApplianceError) as exc:
        ctx.progress(f"warning: acceptance baseline not kept: {exc}")
        return
    if kept is not None:
        ctx.progress(f"canary: the acceptance baseline of {instance} is now {kept.describe()}")


def restart_and_wait(
    ctx: Context, unit: str, expect: gates.Expect, timeout: float, *, restart: bool = True
) -> list[Gate]:
    """Restart ``unit`` and gate it; ``restart=False`` gates the engine already running (any
    start counts)."""
    if restart:
        ctx.progress(f"restarting {unit}")
        expect = dataclasses.replace(expect, previous_invocation=ctx.systemd.invocation_id(unit))
        try:
            ctx.systemd.restart(unit)
        except SystemdError as exc:
            raise gates.GateFailed(
                "restart", str(exc), [Gate("restart", False, 0.0, str(exc))]
            ) from exc
    return gates.wait(
        ctx.systemd,
        expect,
        timeout=timeout,
        progress=ctx.progress,
        running_image=lambda c: running_image_id(ctx, c),
    )


def finish(
    ctx: Context, entry: Entry, outcome: history.Outcome, error: str | None, saved: Path
) -> Entry:
    entry.outcome = outcome
    entry.error = error
    entry.finished = time.time()
    history.append(ctx.layout.history_file(entry.instance), entry)
    with contextlib.suppress(FileNotFoundError):
        saved.unlink()
    with contextlib.suppress(FileNotFoundError):
        ctx.layout.saved_slot(entry.instance).unlink()
    _write_metrics(ctx)
    return entry


def _write_metrics(ctx: Context) -> None:
    """Refresh the state-metrics textfile; a failure is reported, never fails the cutover."""
    try:
        metrics.write(ctx.layout, ctx.docker_client, ctx.systemd)
    except (OSError, ApplianceError) as exc:
        ctx.progress(f"warning: state metrics not written: {exc}")
