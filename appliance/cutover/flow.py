"""Cutover and rollback as one state machine, and the status of an instance.

cutover(instance, image):
  preflight (nothing touched yet): reference valid, image present locally (never pulled), labels
  compatible with the instance's profile, the current image present too (it is the way back)
  -> lock the instance -> history "started" -> save the env file's bytes, record the current
  image as the rollback target -> write VLLM_IMAGE atomically -> restart -> gates
  -> ok: history "ok"
  -> a gate failed: write the saved bytes back, restart, same gates for the old image
     -> history "rolled_back", exit non-zero saying what failed and that it rolled back
     -> the way back failed too: history "failed", exit non-zero with the unit's journal.

rollback(instance) is a cutover to the image in the rollback slot, through the same gates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .. import apikey, imageref, labels, profiles
from ..errors import ApplianceError, UsageError
from ..profiles import Profile
from . import envfile, gates, history, metrics
from . import lock as locks
from .history import Entry, Gate
from .paths import Layout, check_instance, unit_name
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


@dataclass(frozen=True)
class Target:
    """How to reach and judge an instance: its profile, URL and served model name."""

    instance: str
    profile: Profile
    base_url: str
    api_key: str | None = None


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


def target(ctx: Context, instance: str, env: envfile.EnvFile) -> Target:
    """The instance's profile and URL: from the serve script its unit runs (what
    ``appliance install`` rendered), or from ``APPLIANCE_PROFILE``/``VLLM_PORT`` in the env file."""
    facts = _serve_script_facts(ctx, instance)
    name = env.get("APPLIANCE_PROFILE") or facts.get("profile")
    if not name:
        raise PreflightError(
            f"cannot tell which profile instance {instance} serves",
            fix=f"is {unit_name(instance)} installed (appliance install)?",
        )
    prof = profiles.get(name)
    host = env.get("VLLM_HOST") or facts.get("host") or prof.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    port = _port(instance, env, facts, prof)
    return Target(
        instance, prof, f"http://{host}:{port}", api_key=read_api_key(ctx.layout, instance)
    )


def _port(instance: str, env: envfile.EnvFile, facts: dict[str, str], prof: Profile) -> int:
    """The instance's port; a value that is not a TCP port names where it came from."""
    if value := env.get("VLLM_PORT"):
        where = f"VLLM_PORT={value!r} in {env.path}"
    elif value := facts.get("port"):
        where = f"PORT={value!r} in the serve script of {unit_name(instance)}"
    else:
        return prof.port
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise UsageError(f"{where} is not a TCP port", fix="set a port number from 1 to 65535")
    return port


def read_api_key(layout: Layout, instance: str) -> str | None:
    """The instance's API key (``appliance install`` writes it, 0600), None when it has none.

    vLLM guards ``/v1`` with it: without it the model and generation gates get 401. The one
    key-file rule is :mod:`appliance.apikey`'s.
    """
    return apikey.read(layout.api_key_file(instance))


_SCRIPT_PATH = re.compile(r"path=(\S+)")
_PROFILE_LINE = re.compile(r"^# Serve script of \S+: profile (\S+?)\.?$", re.MULTILINE)
_READONLY = re.compile(r"^readonly (PORT|HEALTH_HOST)=(.+)$", re.MULTILINE)


def _serve_script_facts(ctx: Context, instance: str) -> dict[str, str]:
    """Profile, port and health host from the serve script of the instance's unit."""
    try:
        exec_start = ctx.systemd.show(unit_name(instance), "ExecStart").get("ExecStart", "")
    except SystemdError:
        return {}
    m = _SCRIPT_PATH.search(exec_start)
    if not m:
        return {}
    try:
        text = (ctx.layout.root / m.group(1).lstrip("/")).read_text()
    except OSError:
        return {}
    facts = {}
    if pm := _PROFILE_LINE.search(text):
        facts["profile"] = pm.group(1)
    for key, value in _READONLY.findall(text):
        words = shlex.split(value)
        if words:
            facts["port" if key == "PORT" else "host"] = words[0]
    return facts


def _expect(tgt: Target, image: ImageInfo) -> gates.Expect:
    return gates.Expect(
        unit=unit_name(tgt.instance),
        base_url=tgt.base_url,
        served_model=tgt.profile.served_model_name,
        vllm_version=image.vllm_version,
        mtp=tgt.profile.mtp and image.mtp,
        api_key=tgt.api_key,
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
    envfile.write_atomic(
        layout.rollback_slot(instance), (json.dumps(data) + "\n").encode(), mode=0o644
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
) -> Entry:
    """Move ``instance`` to ``image`` through the gates; on failure, back to where it was."""
    check_instance(instance)
    imageref.validate(image)
    layout = ctx.layout
    env_path = layout.env_file(instance)
    env = envfile.read(env_path)
    tgt = target(ctx, instance, env)
    new = inspect_image(ctx, image)
    check_compatible(new, tgt.profile, allow_no_mtp=allow_no_mtp)
    current_ref = env.get(envfile.IMAGE_KEY)
    old: ImageInfo | None = None
    if current_ref and rollback:
        try:
            old = inspect_image(ctx, current_ref)
        except (PreflightError, UsageError) as exc:
            raise PreflightError(
                f"the current image cannot be the way back: {exc}",
                fix="restore it first, or pass --no-rollback to go without a way back",
            ) from exc

    with locks.hold(layout.lock_file(instance), instance, f"{kind} to {image}") as held:
        # Read again under the lock: the file a concurrent cutover left is the one we replace.
        env = envfile.read(env_path)
        current_ref = env.get(envfile.IMAGE_KEY)
        entry = Entry.begin(instance, kind, current_ref, image)
        held.note(entry.id)
        hist = layout.history_file(instance)
        history.append(hist, entry)
        ctx.progress(f"{kind} {instance}: {current_ref} -> {image}")

        saved = layout.saved_env(instance)
        envfile.write_atomic(saved, env.raw, mode=0o600)
        slot_path = layout.rollback_slot(instance)
        slot_before = slot_path.read_bytes() if slot_path.exists() else None
        if current_ref and current_ref != image:
            _write_slot(layout, instance, current_ref, entry.id)

        unit = unit_name(instance)
        try:
            envfile.write_atomic(env_path, env.with_value(envfile.IMAGE_KEY, image))
            entry.gates = _restart_and_wait(ctx, unit, _expect(tgt, new), timeout)
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
            else:
                why = f"NOT rolled back: {env_path} named no previous {envfile.IMAGE_KEY} to return to"
            if current_ref:
                fix = f"the unit runs {image}; `appliance rollback {instance}` returns to {current_ref}"
            else:
                fix = (
                    f"the unit runs {image}; `appliance cutover {instance} IMAGE` to a working one"
                )
            raise RollbackFailed(f"{kind} of {instance} failed: {failure}; {why}", fix=fix)

        ctx.progress(f"rolling back {instance} to {current_ref}")
        envfile.write_atomic(env_path, env.raw)
        # We are back where we were: the rollback target is what it was before.
        if slot_before is None:
            slot_path.unlink(missing_ok=True)
        else:
            envfile.write_atomic(slot_path, slot_before)
        try:
            entry.rollback_gates = _restart_and_wait(ctx, unit, _expect(tgt, old), timeout)
        except gates.GateFailed as back:
            entry.rollback_gates = back.gates
            journal = ctx.systemd.journal(unit, JOURNAL_LINES)
            entry.error = (
                f"{failure}; rollback to {current_ref} failed gate {back.gate!r}: {back.detail}"
            )
            _finish(ctx, entry, "failed", entry.error, saved)
            raise RollbackFailed(
                f"{kind} of {instance} failed: {failure}; the rollback to {current_ref} ALSO "
                f"failed gate {back.gate!r}: {back.detail}\nlast journal lines of {unit}:\n{journal}"
            ) from None
        entry.error = failure
        _finish(ctx, entry, "rolled_back", failure, saved)
        raise CutoverFailed(
            f"{kind} of {instance} failed: {failure}; rolled back to {current_ref}, "
            "which passed the gates and is serving"
        )


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
    return cutover(ctx, instance, image, timeout=timeout, allow_no_mtp=True, kind="rollback")


def _write_metrics(ctx: Context) -> None:
    """Refresh the state-metrics textfile; a failure is reported, never fails the cutover."""
    try:
        metrics.write(ctx.layout, ctx.docker_client)
    except (OSError, ApplianceError) as exc:
        ctx.progress(f"warning: state metrics not written: {exc}")
