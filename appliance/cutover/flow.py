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
  -> canary "after" on the new image, compared with "before" (the last gate)
  -> ok: history "ok"
  -> a gate failed, or SIGINT/SIGTERM/SIGHUP arrived (signals.py): write the saved bytes back,
     restart, same gates for the old image (further signals are ignored meanwhile)
     -> history "rolled_back", exit non-zero saying what failed and that it rolled back
     -> the way back failed too: history "failed", exit non-zero with the unit's journal.

rollback(instance) is a cutover to the image in the rollback slot, through the same gates,
without the canary (the way back must not wait on, or be refused by, a comparison). When the
last cutover was killed (SIGKILL, power loss: its history entry has no end), rollback is
:func:`recover` instead: back to where that cutover started (the saved env file's bytes and
rollback slot), through the gates, and the killed entry is closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import canary as canaries
from .. import imageref, labels, versions
from ..canary.gate import GATE as CANARY_GATE
from ..errors import ApplianceError, EngineError, UsageError
from ..fsutil import private_dir, write_atomic
from ..host import envfile
from ..host import lock as locks
from ..host.layout import ENV_DIR, Layout, check_instance
from ..host.systemd import Systemd, SystemdError
from ..profiles import Profile
from ..units.instance import Instance
from ..units.instance import read as read_instance
from . import gates, history, metrics
from .history import Entry, Gate
from .signals import Interrupted, guard

Progress = Callable[[str], None]
DEFAULT_TIMEOUT = 600.0
JOURNAL_LINES = 20


class PreflightError(ApplianceError):
    """The cutover was refused before anything was touched."""


class CutoverFailed(ApplianceError):
    """The new image failed its gates; the previous one is serving again."""

    exit_code = 1


class RollbackFailed(ApplianceError):
    """The new image failed and the way back failed too (or was not allowed)."""

    exit_code = 4


class CutoverInterrupted(ApplianceError):
    """A signal stopped the cutover before anything was touched."""

    exit_code = 1


@dataclass(frozen=True)
class ImageInfo:
    """An image as the local Docker engine knows it."""

    ref: str
    id: str
    vllm_version: str | None
    mtp: bool
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Context:
    """Everything a cutover talks to; the CLI builds one, tests build their own."""

    layout: Layout = field(default_factory=Layout)
    systemd: Systemd = field(default_factory=Systemd.from_env)
    docker_client: object | None = None
    progress: Progress = lambda _msg: None

    def docker(self):
        if self.docker_client is None:
            import docker

            try:
                self.docker_client = docker.from_env()
            except docker.errors.DockerException as exc:
                raise PreflightError(f"cannot reach the Docker engine: {exc}") from exc
        return self.docker_client


# ---- preflight ---------------------------------------------------------------------------


def inspect_image(ctx: Context, ref: str) -> ImageInfo:
    """The local image ``ref``; never pulls. A missing image is a :class:`PreflightError`."""
    import docker

    imageref.validate(ref)
    try:
        img = ctx.docker().images.get(ref)
    except docker.errors.ImageNotFound:
        raise PreflightError(
            f"image {ref} is not on this host",
            fix="the appliance never pulls: build it (appliance image build) or docker load it",
        ) from None
    except docker.errors.DockerException as exc:
        raise PreflightError(f"cannot inspect image {ref}: {exc}") from exc
    found = dict(img.labels or {})
    return ImageInfo(
        ref=ref,
        id=img.id,
        vllm_version=labels.vllm_version(found),
        mtp=labels.supports_mtp(found),
        labels=found,
    )


def check_compatible(image: ImageInfo, profile: Profile, *, allow_no_mtp: bool) -> None:
    """Refuse an image whose labels cannot serve ``profile`` (clear error naming both)."""
    if image.vllm_version is None:
        raise PreflightError(
            f"image {image.ref} has no {labels.VLLM_VERSION} label, so it is not an appliance "
            "image and its engine cannot be checked",
            fix="build it with `appliance image build`",
        )
    if image.mtp and not versions.has_mtp(image.vllm_version):
        raise PreflightError(
            f"image {image.ref} is labelled {labels.MTP}=true but its vLLM {image.vllm_version} "
            f"has no Gemma 4 MTP (needs >= {labels.MTP_MIN_VLLM})",
            fix="rebuild the image: its labels are wrong",
        )
    if profile.mtp and not image.mtp and not allow_no_mtp:
        raise PreflightError(
            f"profile {profile.name} requests Gemma 4 MTP but image {image.ref} "
            f"(vLLM {image.vllm_version}) does not support it",
            fix="choose an MTP image, or return to a pre-MTP image on purpose with "
            "`appliance rollback` or `--allow-no-mtp`",
        )


def target(ctx: Context, name: str) -> Instance:
    """The instance's facts (profile, URL, image, key file), read once from its env file."""
    return read_instance(ctx.layout.root, name)


def _expect(inst: Instance, image: ImageInfo, api_key: str | None) -> gates.Expect:
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


def running_image_id(ctx: Context, container: str) -> str | None:
    """The ID of the image ``container`` runs (``docker inspect -f '{{.Image}}'``); None when
    there is no such container."""
    import docker

    try:
        return ctx.docker().containers.get(container).attrs.get("Image") or None
    except docker.errors.NotFound:
        return None
    except docker.errors.DockerException as exc:
        raise EngineError(f"cannot inspect container {container}: {exc}") from exc


def unit_overrides(ctx: Context, inst: Instance) -> list[str]:
    """What besides the instance's env file could set ``VLLM_IMAGE`` for its unit: another
    ``EnvironmentFile`` (a later one wins), or a drop-in that names ``VLLM_IMAGE``. Empty when
    the unit is not loaded. Raises :class:`SystemdError` when systemd cannot be asked."""
    unit = inst.unit
    props = ctx.systemd.show(unit, "LoadState", "DropInPaths")
    if props.get("LoadState") == "not-found":
        return []
    own = f"/{ENV_DIR}/{inst.name}.env"
    files = [v.split(" (", 1)[0] for v in ctx.systemd.show_all(unit, "EnvironmentFiles") if v]
    problems = []
    if files and files != [own]:
        problems.append(f"{unit} reads {len(files)} EnvironmentFile(s): {', '.join(files)}")
        for f in files:
            if f == own:
                continue
            try:
                value = envfile.parse(_under(ctx, f).read_bytes(), f).get(envfile.IMAGE_KEY)
            except (OSError, ApplianceError) as exc:
                problems.append(f"{f} cannot be read ({exc})")
                continue
            if value is not None:
                problems.append(f"{f} sets {envfile.IMAGE_KEY}={value}")
    for d in props.get("DropInPaths", "").split():
        try:
            text = _under(ctx, d).read_text(errors="replace")
        except OSError:
            continue
        if envfile.IMAGE_KEY in text:
            problems.append(f"drop-in {d} names {envfile.IMAGE_KEY}")
    return problems


def _under(ctx: Context, path: str) -> Path:
    return ctx.layout.root / path.lstrip("/")


def check_unit_overrides(ctx: Context, inst: Instance, *, allow: bool) -> None:
    """Refuse (or, with ``allow``, warn) when something besides the env file may set the image:
    the cutover would edit a file the unit does not go by."""
    try:
        problems = unit_overrides(ctx, inst)
    except SystemdError as exc:
        ctx.progress(f"warning: cannot check {inst.unit} for overrides ({exc})")
        return
    if not problems:
        return
    what = "; ".join(problems)
    if allow:
        ctx.progress(
            f"warning: {what}; going ahead (--allow-unit-overrides): the image gate checks "
            "what the container really runs"
        )
        return
    raise PreflightError(
        f"{inst.unit} may not run the image {inst.env_path.name} names: {what}",
        fix="remove the override (then `systemctl daemon-reload`), or pass "
        "--allow-unit-overrides (the gates still check the running container's image)",
    )


# ---- the state machine -------------------------------------------------------------------


def _read_slot(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rollback_image(layout: Layout, instance: str) -> str | None:
    """The image ``appliance rollback INSTANCE`` would return to (the rollback slot)."""
    slot = _read_slot(layout.rollback_slot(instance))
    return slot.get("image") if isinstance(slot, dict) else None


def _write_slot(layout: Layout, instance: str, image: str, entry_id: str) -> None:
    data = {"image": image, "recorded": time.time(), "entry": entry_id}
    write_atomic(layout.rollback_slot(instance), json.dumps(data) + "\n", mode=0o644)


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
    old, unusable = _way_back(ctx, tgt.image, image, rollback, way_back_required)

    lock = locks.hold(layout.lock_file(instance), instance, f"{kind} to {image}")
    with lock as held, guard(ctx.progress) as sig:
        for d in layout.private_dirs(instance):
            private_dir(d)
        # Read again under the lock: the file a concurrent cutover left is the one we replace,
        # and the image it names is the way back.
        env = envfile.read(env_path)
        current_ref = env.get(envfile.IMAGE_KEY)
        if current_ref != tgt.image:
            old, unusable = _way_back(ctx, current_ref, image, rollback, way_back_required)
        ctx.progress(f"{kind} {instance}: {current_ref} -> {image}")
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
            _write_slot(layout, instance, current_ref, entry.id)

        unit = tgt.unit
        touched = False
        try:
            sig.arm()  # a signal that came meanwhile interrupts here, before the env write
            touched = True
            write_atomic(env_path, env.with_value(envfile.IMAGE_KEY, image))
            entry.gates = _restart_and_wait(ctx, unit, _expect(tgt, new, api_key), timeout)
            if baseline is not None:
                _canary_after(ctx, plan, baseline, tgt, api_key, image, entry, canary_timeout)
            sig.hold()  # every gate passed: a signal from here on is too late to matter
        except gates.GateFailed as failed:
            entry.gates = failed.gates
            failure = f"{image} failed gate {failed.gate!r}: {failed.detail}"
        except Interrupted as stop:
            entry.gates = _interrupted_gates(stop, entry.gates)
            entry.interrupted = stop.name
            failure = f"interrupted by {stop.name} during the gates of {image}"
            ctx.progress(f"{failure}: returning to {current_ref or 'the previous env file'}")
        else:
            return _finish(ctx, entry, "ok", None, saved)
        # The way back is not interrupted by the operator's next Ctrl-C or hang-up; it is bounded
        # by the same --timeout as the gates.
        sig.hold(within=timeout)
        if not touched:
            # Stopped before the env file was written: the unit was never touched.
            _restore_slot(slot_path, slot_before)
            entry.error = f"{failure}; stopped before the env file was written, nothing changed"
            _finish(ctx, entry, "rolled_back", entry.error, saved)
            raise CutoverInterrupted(f"{kind} of {instance} {entry.error}")

        if not rollback or old is None:
            entry.error = failure
            _finish(ctx, entry, "failed", failure, saved)
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
        _restore_slot(slot_path, slot_before)
        try:
            entry.rollback_gates = _restart_and_wait(ctx, unit, _expect(tgt, old, api_key), timeout)
        except gates.GateFailed as back:
            entry.rollback_gates = back.gates
            journal = ctx.systemd.journal(unit, JOURNAL_LINES)
            entry.error = (
                f"{failure}; rollback to {current_ref} failed gate {back.gate!r}: {back.detail}"
            )
            _finish(ctx, entry, "failed", entry.error, saved)
            raise RollbackFailed(
                f"{kind} of {instance} failed: {failure}; the rollback to {current_ref} ALSO "
                f"failed gate {back.gate!r}: {back.detail}\n"
                f"last journal lines of {unit}:\n{journal}"
            ) from None
        entry.error = failure
        _finish(ctx, entry, "rolled_back", failure, saved)
        what = "was" if entry.interrupted else "failed:"
        raise CutoverFailed(
            f"{kind} of {instance} {what} {failure}; rolled back to {current_ref}, "
            "which passed the gates and is serving"
        )


def _way_back(
    ctx: Context, current_ref: str | None, image: str, rollback: bool, required: bool
) -> tuple[ImageInfo | None, str | None]:
    """The image the cutover returns to on failure, and why it cannot when it cannot (a
    PreflightError when the way back is ``required``)."""
    if not current_ref or not rollback:
        return None, None
    try:
        return inspect_image(ctx, current_ref), None
    except (PreflightError, UsageError) as exc:
        if required:
            raise PreflightError(
                f"the current image cannot be the way back: {exc}",
                fix="restore it first, or pass --no-rollback to go without a way back",
            ) from exc
        ctx.progress(
            f"warning: the current image {current_ref} cannot be inspected ({exc}): "
            f"going ahead; if {image} fails too there is no way back"
        )
        return None, str(exc)


def _restore_slot(slot_path: Path, before: bytes | None) -> None:
    if before is None:
        slot_path.unlink(missing_ok=True)
    else:
        write_atomic(slot_path, before)


def _interrupted_gates(stop: Interrupted, so_far: list[Gate]) -> list[Gate]:
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
) -> None:
    """The canary gate: run the set on the new image and judge it against ``baseline``.

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


def _restart_and_wait(
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


def _finish(
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


def rollback(ctx: Context, instance: str, *, timeout: float = DEFAULT_TIMEOUT) -> Entry:
    """Return ``instance`` to the image in its rollback slot, through the same gates; after a
    killed cutover, :func:`recover` it instead."""
    check_instance(instance)
    if interrupted_entry(ctx.layout, instance) is not None:
        return recover(ctx, instance, timeout=timeout)
    image = rollback_image(ctx.layout, instance)
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


# ---- after a kill ------------------------------------------------------------------------


def interrupted_entry(layout: Layout, instance: str, *, locked: bool = False) -> Entry | None:
    """The last history entry when its process died without writing an end (SIGKILL, power
    loss), else None. ``locked``: the caller holds the instance's lock (no live holder)."""
    live: frozenset[str] = frozenset()
    if not locked:
        holder = locks.current_holder(layout.lock_file(instance))
        if holder is not None:
            return None  # still running: not interrupted
    found = history.entries(layout.history_file(instance), live_ids=live, strict=False)
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
                _restore_slot(layout.rollback_slot(instance), saved_slot.read_bytes() or None)
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
            got = _restart_and_wait(
                ctx, unit, _expect(tgt, info, api_key), timeout, restart=not in_place
            )
        except gates.GateFailed as failed:
            got = failed.gates
            entry.error = f"{why}; recovery to {image} failed gate {failed.gate!r}: {failed.detail}"
            _set_gates(entry, got)
            _finish(ctx, entry, "failed", entry.error, saved)
            journal = ctx.systemd.journal(unit, JOURNAL_LINES)
            raise RollbackFailed(
                f"recovery of {instance} failed: {entry.error}\n"
                f"last journal lines of {unit}:\n{journal}"
            ) from None
        _set_gates(entry, got)
        outcome: history.Outcome = "rolled_back" if entry.kind == "cutover" else "ok"
        entry.error = f"{why}; recovered by `{recovery_command(layout, instance)}`: on {image}"
        return _finish(ctx, entry, outcome, entry.error, saved)


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


def _write_metrics(ctx: Context) -> None:
    """Refresh the state-metrics textfile; a failure is reported, never fails the cutover."""
    try:
        metrics.write(ctx.layout, ctx.docker_client, ctx.systemd)
    except (OSError, ApplianceError) as exc:
        ctx.progress(f"warning: state metrics not written: {exc}")
