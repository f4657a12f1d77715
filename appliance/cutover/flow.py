"""Cutover and rollback as one state machine, and the status of an instance.

cutover(instance, image):
  preflight (nothing touched yet): reference valid, the output canary's set valid (when on),
  image present locally (never pulled), labels compatible with the instance's profile (its
  build, CPU or CUDA, among them), not a floating tag (``latest``: unless forced), the
  current image present too (it is the way back), nothing else sets VLLM_IMAGE for the unit
  (a second EnvironmentFile, a drop-in)
  -> lock the instance -> canary "before" on the old image (an engine error refuses the
  cutover, still untouched) -> history "started" (both images' IDs too) -> save the env file's
  bytes and the rollback slot's, record the current image (and its ID) as the rollback target
  -> write VLLM_IMAGE atomically
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from .. import canary as canaries
from ..canary import baseline as baselines
from ..canary.gate import GATE as CANARY_GATE
from ..errors import ApplianceError, EngineError, UsageError
from ..fsutil import private_dir, write_atomic
from ..host import envfile
from ..host import lock as locks
from ..judge import traffic_acceptance
from ..oci import imageref
from . import gates, history, live, metrics, slot
from .context import Context, PreflightError
from .history import Entry, Gate
from .preflight import ImageInfo, check_compatible, check_pinned, way_back
from .signals import Guard, Interrupted, guard
from .target import Snapshot, Target
from .targets import target

DEFAULT_TIMEOUT = gates.DEFAULT_TIMEOUT  # the unit's stop and start budgets, and the gates

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


def cutover(
    ctx: Context,
    instance: str | Target,
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
    canary_before: Path | None = None,
    force: bool = False,
    live_acceptance: live.Settings | None = live.DEFAULT,
) -> Entry:
    """Move ``instance`` (a name of either shape, or a :class:`Target`) to ``image`` through the
    gates; on failure, back to where it was.

    ``canary``: run the output canary (None: the profile's ``[canary] enabled``);
    ``canary_files``: the operator's JSONL cases, added to the shipped set;
    ``canary_timeout``: the seconds each side of the canary may take (on top of ``timeout``).
    ``canary_before``: the old image's answers recorded earlier (``appliance canary record``),
    judged against instead of recording them now (a group's head, after its workers moved).
    ``way_back_required``: refuse when the current image cannot be the way back (a rollback
    goes ahead instead: a missing or broken current image is what it is there for).
    ``allow_unit_overrides``: warn instead of refusing when a drop-in or another env file may
    set the image (:func:`unit_overrides`).
    ``force``: a cutover to a floating tag (``latest``, ``mtp``...: :func:`check_pinned`) goes
    ahead instead of being refused.
    ``live_acceptance``: judge the new image's acceptance on the live traffic against the old
    one's (:mod:`.live`; None: off).
    """
    m = _refusals(
        ctx,
        instance,
        image,
        kind,
        rollback=rollback,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_files,
        way_back_required=way_back_required,
        allow_unit_overrides=allow_unit_overrides,
        force=force,
    )
    # Refused up to here, nothing is written, not even the lock.
    layout = ctx.layout
    lock = locks.hold(layout.lock_file(m.name), m.name, f"{kind} to {image}")
    with lock as held, guard(ctx.progress) as sig:
        _before(ctx, m, held, sig, canary_timeout, canary_before, live_acceptance)
        return _move(ctx, m, sig, timeout, canary_timeout, live_acceptance)


@dataclass
class _Cutover:
    """What one cutover carries from phase to phase: the refusals' findings (the target, the
    images), then what it read and saved under the lock."""

    tgt: Target
    image: str
    kind: history.Kind
    rollback: bool
    way_back_required: bool
    api_key: str | None
    plan: canaries.Plan
    new: ImageInfo
    old: ImageInfo | None  # the way back (None: none to return to)
    unusable: bool  # the image it would leave cannot be inspected
    first_ref: str | None  # the image the env file named before the lock
    # Under the lock (_before):
    snap: Snapshot | None = None
    current_ref: str | None = None
    kept: baselines.Baseline | None = None
    baseline: canaries.Record | None = None
    traffic: traffic_acceptance.Traffic | None = None
    entry: Entry | None = None
    saved: Path | None = None
    slot_path: Path | None = None
    slot_before: bytes | None = None

    @property
    def name(self) -> str:
        return self.tgt.name


def _refusals(
    ctx: Context,
    instance: str | Target,
    image: str,
    kind: history.Kind,
    *,
    rollback: bool,
    allow_no_mtp: bool,
    canary: bool | None,
    canary_files: tuple[Path, ...],
    way_back_required: bool,
    allow_unit_overrides: bool,
    force: bool,
) -> _Cutover:
    """Phase 1, nothing touched: every refusal a cutover can meet before it takes the lock."""
    tgt = target(ctx, instance) if isinstance(instance, str) else instance
    name = tgt.name
    imageref.validate(image)
    layout = ctx.layout
    locks.refuse_if_busy(layout.lock_file(name), name)
    tgt.check_way_back(rollback)
    tgt.check_peers()
    api_key = tgt.api_key()
    # The canary asks the API: a host that runs only a group's worker has none.
    enabled = canary if tgt.answers else False
    # The canary's set is read and checked here: a malformed line refuses the cutover untouched.
    plan = canaries.plan(tgt.profile, root=layout.root, enabled=enabled, files=canary_files)
    new, warnings = _judged(ctx, tgt, image, allow_no_mtp, pinned=kind == "cutover" and not force)
    for warning in warnings:
        ctx.progress(f"warning: {warning}")
    first_ref = tgt.read().image
    old, unusable = way_back(ctx, first_ref, image, rollback, way_back_required, tgt.inspect)
    # Systemd last: the refusals above need only the files and Docker.
    tgt.check_overrides(ctx, allow=allow_unit_overrides)
    return _Cutover(
        tgt, image, kind, rollback, way_back_required, api_key, plan, new, old, unusable, first_ref
    )


def _before(
    ctx: Context,
    m: _Cutover,
    held: locks.InstanceLock,
    sig: Guard,
    canary_timeout: float,
    canary_before: Path | None,
    live_acceptance: live.Settings | None,
) -> None:
    """Phase 2, under the lock: read the files again, record the old image's answers and live
    traffic (an engine error or a signal refuses, still untouched), then the history line, the
    saved env file and the rollback slot, together."""
    tgt, name, layout, image = m.tgt, m.name, ctx.layout, m.image
    for d in layout.private_dirs(name):
        private_dir(d)
    # Read again under the lock: the files a concurrent cutover left are the ones we
    # replace, and the image they name is the way back.
    m.snap = snap = tgt.read()
    m.current_ref = current_ref = snap.image
    if current_ref != m.first_ref:
        m.old, m.unusable = way_back(
            ctx, current_ref, image, m.rollback, m.way_back_required, tgt.inspect
        )
    ctx.progress(f"{m.kind} {name}: {current_ref} -> {image}")
    # Read before the canary runs: a broken baseline file refuses with nothing touched.
    m.kept = baselines.load(layout.canary_baseline(name)) if m.plan.enabled else None
    # While the old image serves, before anything is written: an engine that cannot answer
    # the canary refuses the cutover with nothing touched; so does a signal.
    try:
        m.baseline = _canary_before(
            ctx, m.plan, tgt, m.api_key, current_ref, canary_timeout, canary_before
        )
        # The old image's live traffic, while it serves and nothing is touched.
        m.traffic = live.before(
            ctx,
            tgt.base_url,
            live_acceptance if tgt.answers else None,
            new_drafts=tgt.profile.mtp and m.new.mtp,
        )
    except Interrupted as stop:
        raise CutoverInterrupted(
            f"{m.kind} of {name} interrupted by {stop.name} before anything was touched"
        ) from None
    # The history line, the saved files and the slot go together: a signal waits for them.
    sig.defer()
    was = m.old.id if m.old is not None else _image_id(ctx, tgt, current_ref)
    m.entry = entry = Entry.begin(name, m.kind, current_ref, image, was, m.new.id)
    held.note(entry.id)
    history.append(layout.history_file(name), entry)

    m.saved = layout.saved_env(name)
    tgt.save(m.saved, snap)
    m.slot_path = layout.rollback_slot(name)
    m.slot_before = m.slot_path.read_bytes() if m.slot_path.exists() else None
    # Kept until the cutover ends, for `appliance rollback` after a kill (recover()).
    write_atomic(layout.saved_slot(name), m.slot_before or b"", mode=0o644)
    if current_ref and current_ref != image:
        slot.write(layout, name, current_ref, entry.id, was)


def _move(
    ctx: Context,
    m: _Cutover,
    sig: Guard,
    timeout: float,
    canary_timeout: float,
    live_acceptance: live.Settings | None,
) -> Entry:
    """Phase 3: write the new image, restart, the gates, the canary and the live acceptance;
    on a failed gate or a signal, the way back (:func:`_way_back`)."""
    tgt, image, entry = m.tgt, m.image, m.entry
    assert entry is not None and m.snap is not None and m.saved is not None
    touched = False
    canary_result = None
    try:
        sig.arm()  # a signal that came meanwhile interrupts here, before the env write
        touched = True
        tgt.write(m.snap.with_image(image))
        entry.gates = tgt.move(ctx, m.new, m.api_key, timeout, True)
        if m.baseline is not None:
            canary_result = _canary_after(
                ctx, m.plan, m.baseline, tgt, m.api_key, image, entry, canary_timeout, m.kept
            )
        if m.traffic is not None and live_acceptance is not None:
            live.after(ctx, tgt.base_url, m.traffic, live_acceptance, entry.gates, timeout)
        sig.hold()  # every gate passed: a signal from here on is too late to matter
    except gates.GateFailed as failed:
        entry.gates = failed.gates
        failure = f"{image} failed gate {failed.gate!r}: {failed.detail}"
    except Interrupted as stop:
        entry.gates = interrupted_gates(stop, entry.gates)
        entry.interrupted = stop.name
        failure = f"interrupted by {stop.name} during the gates of {image}"
        ctx.progress(f"{failure}: returning to {m.current_ref or 'the previous env file'}")
    else:
        if canary_result is not None:
            _keep_baseline(ctx, m.name, canary_result)
        return finish(ctx, entry, "ok", None, m.saved)
    # The way back is not interrupted by the operator's next Ctrl-C or hang-up; it is bounded
    # by the same --timeout as the gates.
    sig.hold(within=timeout)
    _way_back(ctx, m, failure, touched, timeout)


def _way_back(ctx: Context, m: _Cutover, failure: str, touched: bool, timeout: float) -> NoReturn:
    """The files back as they were, the old image restarted through the same gates; always
    raises, saying what failed and where the instance is now."""
    tgt, name, kind, image, entry = m.tgt, m.name, m.kind, m.image, m.entry
    current_ref, saved = m.current_ref, m.saved
    assert entry is not None and m.snap is not None and saved is not None
    assert m.slot_path is not None
    if not touched:
        # Stopped before the env file was written: the unit was never touched.
        slot.restore(m.slot_path, m.slot_before)
        entry.error = f"{failure}; stopped before the env file was written, nothing changed"
        finish(ctx, entry, "rolled_back", entry.error, saved)
        raise CutoverInterrupted(f"{kind} of {name} {entry.error}")

    if not m.rollback or m.old is None:
        entry.error = failure
        finish(ctx, entry, "failed", failure, saved)
        if not m.rollback:
            why = "NOT rolled back (--no-rollback)"
        elif m.unusable:
            why = f"NOT rolled back: the image it left, {current_ref}, cannot be inspected"
        else:
            why = f"NOT rolled back: {tgt.env_files} named no previous {envfile.IMAGE_KEY} "
            why += "to return to"
        if current_ref and not m.unusable:
            fix = f"{name} runs {image}; `{tgt.command('rollback')}` returns to {current_ref}"
        else:
            fix = f"{name} runs {image}; `{tgt.command('cutover', 'IMAGE')}` to a "
            fix += "working one"
        raise RollbackFailed(f"{kind} of {name} failed: {failure}; {why}", fix=fix)

    ctx.progress(f"rolling back {name} to {current_ref}")
    tgt.write(m.snap.raw())
    # We are back where we were: the rollback target is what it was before.
    slot.restore(m.slot_path, m.slot_before)
    try:
        entry.rollback_gates = tgt.move(ctx, m.old, m.api_key, timeout, True)
    except gates.GateFailed as back:
        entry.rollback_gates = back.gates
        journal = tgt.journal(ctx, JOURNAL_LINES)
        entry.error = (
            f"{failure}; rollback to {current_ref} failed gate {back.gate!r}: {back.detail}"
        )
        finish(ctx, entry, "failed", entry.error, saved)
        raise RollbackFailed(
            f"{kind} of {name} failed: {failure}; the rollback to {current_ref} ALSO "
            f"failed gate {back.gate!r}: {back.detail}\n{journal}"
        ) from None
    entry.error = failure
    finish(ctx, entry, "rolled_back", failure, saved)
    what = "was" if entry.interrupted else "failed:"
    raise CutoverFailed(
        f"{kind} of {name} {what} {failure}; rolled back to {current_ref}, "
        "which passed the gates and is serving"
    )


def check(
    ctx: Context,
    name: str,
    image: str,
    *,
    allow_no_mtp: bool = False,
    allow_unit_overrides: bool = False,
    force: bool = False,
) -> dict[str, object]:
    """The cutover's preflight of ``name`` to ``image``, touching nothing: the reference valid,
    the image here, compatible with the profile, not a floating tag (unless ``force``), no unit
    override, the env file readable.
    Returns what the fleet's play compares across a group's hosts (the image IDs, the image the
    env file names now and its ID: the way back) and whether ``name`` already runs ``image``."""
    tgt = target(ctx, name)
    imageref.validate(image)
    new, warnings = _judged(ctx, tgt, image, allow_no_mtp, pinned=not force)
    tgt.check_overrides(ctx, allow=allow_unit_overrides)
    current = tgt.read().image
    node = tgt.node
    return {
        "name": name,
        "shape": tgt.noun,
        "roles": sorted(node.roles) if node else [],
        "ranks": [node.rank] if node and "worker" in node.roles else [],
        "remote_ranks": list(tgt.remote_ranks),
        # The units of the nodes this host runs, by role: the group's play stops the head
        # before any worker moves (gotchas/multinode-cross-host-cutover.md).
        "units": {role: tgt.unit(role) for role in sorted(node.roles)} if node else {},
        "image": image,
        "image_id": new.id,
        "env_image": current,
        "env_image_id": tgt.inspect(ctx, current).id if current else None,
        "runs_image": current == image and tgt.runs(ctx, new),
        # The output canary (the profile's [canary]) where the API answers: the group's play
        # records the head's answers before any worker moves.
        "canary": tgt.answers and tgt.profile.canary.enabled,
        "warnings": warnings,
    }


def _judged(
    ctx: Context, tgt: Target, image: str, allow_no_mtp: bool, *, pinned: bool
) -> tuple[ImageInfo, list[str]]:
    """``image`` as the host has it, refused when it cannot serve ``tgt``'s profile or, with
    ``pinned``, when it is a floating tag; and the warnings about it."""
    new = tgt.inspect(ctx, image)
    warnings = check_compatible(new, tgt.profile, allow_no_mtp=allow_no_mtp)
    if pinned:
        check_pinned(ctx, new, tgt.inspect)
    return new, warnings


def _image_id(ctx: Context, tgt: Target, ref: str | None) -> str | None:
    """The ID ``ref`` names now (None when there is no ref, or it cannot be inspected: the
    history and the slot then keep the reference alone, as before IDs were kept)."""
    if not ref:
        return None
    try:
        return tgt.inspect(ctx, ref).id
    except ApplianceError:
        return None


def interrupted_gates(stop: Interrupted, so_far: list[Gate]) -> list[Gate]:
    """The gates up to a signal, and the interruption as the failed one."""
    done = list(stop.gates if stop.gates is not None else so_far)
    at = done[-1].seconds if done else 0.0
    return [*done, Gate("interrupted", False, at, f"{stop.name} received")]


def _canary_before(
    ctx: Context,
    plan: canaries.Plan,
    tgt: Target,
    api_key: str | None,
    image: str | None,
    within: float,
    recorded: Path | None = None,
) -> canaries.Record | None:
    """Record the old image's answers, or read them from ``recorded`` (None when the canary is
    off)."""
    if not plan.enabled:
        ctx.progress("canary: off")
        return None
    if not image:
        # Nothing was serving by this env file: there is no baseline to keep answers from.
        ctx.progress(f"canary: skipped (the env file names no {envfile.IMAGE_KEY} to record)")
        return None
    if recorded is not None:
        try:
            rec = canaries.recorded(plan, recorded, image)
        except UsageError as exc:
            raise PreflightError(exc.message, fix=exc.fix) from exc
        ctx.progress(f"canary: the answers of {image} recorded before, from {recorded}")
        canaries.save(rec, ctx.layout.canary_record(tgt.name, "before"))
        return rec
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
    tgt: Target,
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
