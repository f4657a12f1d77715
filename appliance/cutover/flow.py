"""Cutover and rollback as one state machine, and the status of an instance.

cutover(instance, image):
  preflight (nothing touched yet): reference valid, the output canary's set valid (when on),
  image present locally (never pulled), labels compatible with the instance's profile, the
  current image present too (it is the way back)
  -> lock the instance -> canary "before" on the old image (an engine error refuses the
  cutover, still untouched) -> history "started" -> save the env file's bytes, record the
  current image as the rollback target -> write VLLM_IMAGE atomically -> restart -> gates
  -> canary "after" on the new image, compared with "before" (the last gate)
  -> ok: history "ok"
  -> a gate failed: write the saved bytes back, restart, same gates for the old image
     -> history "rolled_back", exit non-zero saying what failed and that it rolled back
     -> the way back failed too: history "failed", exit non-zero with the unit's journal.

rollback(instance) is a cutover to the image in the rollback slot, through the same gates,
without the canary (the way back must not wait on, or be refused by, a comparison).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .. import canary as canaries
from .. import imageref, labels
from ..canary.gate import GATE as CANARY_GATE
from ..errors import ApplianceError, EngineError, UsageError
from ..fsutil import write_atomic
from ..profiles import Profile
from ..units.instance import Instance
from ..units.instance import read as read_instance
from . import envfile, gates, history, metrics
from . import lock as locks
from .history import Entry, Gate
from .paths import Layout, check_instance
from .systemd import Systemd, SystemdError

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


def _has_mtp_engine(version: str) -> bool:
    try:
        return Version(version) >= Version(labels.MTP_MIN_VLLM)
    except InvalidVersion:
        return False


def check_compatible(image: ImageInfo, profile: Profile, *, allow_no_mtp: bool) -> None:
    """Refuse an image whose labels cannot serve ``profile`` (clear error naming both)."""
    if image.vllm_version is None:
        raise PreflightError(
            f"image {image.ref} has no {labels.VLLM_VERSION} label, so it is not an appliance "
            "image and its engine cannot be checked",
            fix="build it with `appliance image build`",
        )
    if image.mtp and not _has_mtp_engine(image.vllm_version):
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
) -> Entry:
    """Move ``instance`` to ``image`` through the gates; on failure, back to where it was.

    ``canary``: run the output canary (None: the profile's ``[canary] enabled``);
    ``canary_files``: the operator's JSONL cases, added to the shipped set.
    ``way_back_required``: refuse when the current image cannot be the way back (a rollback
    goes ahead instead: a missing or broken current image is what it is there for).
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
    current_ref = tgt.image
    old: ImageInfo | None = None
    unusable: str | None = None  # why the current image cannot be the way back
    if current_ref and rollback:
        try:
            old = inspect_image(ctx, current_ref)
        except (PreflightError, UsageError) as exc:
            if way_back_required:
                raise PreflightError(
                    f"the current image cannot be the way back: {exc}",
                    fix="restore it first, or pass --no-rollback to go without a way back",
                ) from exc
            unusable = str(exc)
            ctx.progress(
                f"warning: the current image {current_ref} cannot be inspected ({unusable}): "
                f"going ahead; if {image} fails too there is no way back"
            )

    with locks.hold(layout.lock_file(instance), instance, f"{kind} to {image}") as held:
        # Read again under the lock: the file a concurrent cutover left is the one we replace.
        env = envfile.read(env_path)
        current_ref = env.get(envfile.IMAGE_KEY)
        ctx.progress(f"{kind} {instance}: {current_ref} -> {image}")
        # While the old image serves, before anything is written: an engine that cannot answer
        # the canary refuses the cutover with nothing touched.
        baseline = _canary_before(ctx, plan, tgt, api_key, current_ref)
        entry = Entry.begin(instance, kind, current_ref, image)
        held.note(entry.id)
        hist = layout.history_file(instance)
        history.append(hist, entry)

        saved = layout.saved_env(instance)
        write_atomic(saved, env.raw, mode=0o600)
        slot_path = layout.rollback_slot(instance)
        slot_before = slot_path.read_bytes() if slot_path.exists() else None
        if current_ref and current_ref != image:
            _write_slot(layout, instance, current_ref, entry.id)

        unit = tgt.unit
        try:
            write_atomic(env_path, env.with_value(envfile.IMAGE_KEY, image))
            entry.gates = _restart_and_wait(ctx, unit, _expect(tgt, new, api_key), timeout)
            if baseline is not None:
                _canary_after(ctx, plan, baseline, tgt, api_key, image, entry)
        except gates.GateFailed as failed:
            entry.gates = failed.gates
            failure = f"{image} failed gate {failed.gate!r}: {failed.detail}"
        else:
            return _finish(ctx, entry, "ok", None, saved)

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
        if slot_before is None:
            slot_path.unlink(missing_ok=True)
        else:
            write_atomic(slot_path, slot_before)
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
        raise CutoverFailed(
            f"{kind} of {instance} failed: {failure}; rolled back to {current_ref}, "
            "which passed the gates and is serving"
        )


def _canary_before(
    ctx: Context, plan: canaries.Plan, tgt: Instance, api_key: str | None, image: str | None
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


def _restart_and_wait(ctx: Context, unit: str, expect: gates.Expect, timeout: float) -> list[Gate]:
    ctx.progress(f"restarting {unit}")
    expect = dataclasses.replace(expect, previous_invocation=ctx.systemd.invocation_id(unit))
    try:
        ctx.systemd.restart(unit)
    except SystemdError as exc:
        raise gates.GateFailed(
            "restart", str(exc), [Gate("restart", False, 0.0, str(exc))]
        ) from exc
    return gates.wait(ctx.systemd, expect, timeout=timeout, progress=ctx.progress)


def _finish(
    ctx: Context, entry: Entry, outcome: history.Outcome, error: str | None, saved: Path
) -> Entry:
    entry.outcome = outcome
    entry.error = error
    entry.finished = time.time()
    history.append(ctx.layout.history_file(entry.instance), entry)
    with contextlib.suppress(FileNotFoundError):
        saved.unlink()
    _write_metrics(ctx)
    return entry


def rollback(ctx: Context, instance: str, *, timeout: float = DEFAULT_TIMEOUT) -> Entry:
    """Return ``instance`` to the image in its rollback slot, through the same gates."""
    check_instance(instance)
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


def _write_metrics(ctx: Context) -> None:
    """Refresh the state-metrics textfile; a failure is reported, never fails the cutover."""
    try:
        metrics.write(ctx.layout, ctx.docker_client)
    except (OSError, ApplianceError) as exc:
        ctx.progress(f"warning: state metrics not written: {exc}")
