"""The checks before a cutover touches anything: the image is here (never pulled) and fits
the profile, the way back is an image that is here too, nothing but the env file sets the
unit's image."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..engine_api import versions
from ..errors import ApplianceError, EngineError, UsageError
from ..host import envfile
from ..host.layout import ENV_DIR
from ..host.systemd import Systemd, SystemdError, SystemdNotNamed
from ..images import scheme, variant
from ..oci import imageref, labels
from ..profiles import Profile
from ..units.instance import Instance
from .context import Context, PreflightError


@dataclass(frozen=True)
class ImageInfo:
    """An image as the local Docker engine knows it."""

    ref: str
    id: str
    vllm_version: str | None
    mtp: bool
    labels: dict[str, str] = field(default_factory=dict)


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


def check_compatible(image: ImageInfo, profile: Profile, *, allow_no_mtp: bool) -> list[str]:
    """Refuse an image whose labels cannot serve ``profile`` (clear error naming both): the
    other build (CPU for a GPU profile, or the reverse), no appliance labels, MTP it lacks.
    Returns the warnings (an image that does not say which build it is)."""
    built = variant.fit(image.ref, image.labels, profile.hardware.device, profile.name)
    if built.refusal is not None:
        raise PreflightError(built.refusal, fix=built.fix)
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
    return [built.warning] if built.warning else []


def check_pinned(
    ctx: Context,
    image: ImageInfo,
    inspect: Callable[[Context, str], ImageInfo] = inspect_image,
) -> None:
    """Refuse a floating tag (``mtp``, ``latest``, ``pre-mtp``, their ``-cpu`` forms: the next
    ``appliance image build`` moves them, and the unit's next plain restart would run whatever
    the tag names then, ungated), naming the version tag of the image it names now (its ID
    when that tag is not here)."""
    if not scheme.floating(image.ref):
        return
    instead = scheme.version_ref(image.labels, image.ref)
    try:
        same = instead is not None and inspect(ctx, instead).id == image.id
    except (PreflightError, UsageError):
        same = False
    raise PreflightError(
        f"{image.ref} is a floating tag: `appliance image build` moves it, and the next restart "
        "would run whatever it names then, without the gates",
        fix=f"cut over to {instead if same else image.id} (what it names now), or pass --force",
    )


def running_image_id(ctx: Context, container: str) -> str | None:
    """The ID of the image ``container`` runs (``docker inspect -f '{{.Image}}'``); None when
    there is no such container."""
    return running_image(ctx, container)[0]


def running_image(ctx: Context, container: str) -> tuple[str | None, str | None]:
    """The ID of the image ``container`` runs and the reference it was started from
    (``.Config.Image``); (None, None) when there is no such container."""
    import docker

    try:
        attrs = ctx.docker().containers.get(container).attrs
    except docker.errors.NotFound:
        return None, None
    except docker.errors.DockerException as exc:
        raise EngineError(f"cannot inspect container {container}: {exc}") from exc
    return attrs.get("Image") or None, (attrs.get("Config") or {}).get("Image") or None


def unit_overrides(ctx: Context, inst: Instance) -> list[str]:
    """What besides the instance's env file could set ``VLLM_IMAGE`` for its unit: another
    ``EnvironmentFile`` (a later one wins), or a drop-in that names ``VLLM_IMAGE``. Empty when
    the unit is not loaded. Raises :class:`SystemdError` when systemd cannot be asked."""
    return env_overrides(ctx.systemd, ctx.layout.root, inst.unit, f"/{ENV_DIR}/{inst.name}.env")


def env_overrides(systemd: Systemd, root: Path, unit: str, own: str) -> list[str]:
    """What besides ``own`` (the env file the appliance writes) could set ``VLLM_IMAGE`` for
    ``unit`` on the host whose files are under ``root`` and whose systemd is ``systemd``."""
    props = systemd.show(unit, "LoadState", "DropInPaths")
    if props.get("LoadState") == "not-found":
        return []
    files = [v.split(" (", 1)[0] for v in systemd.show_all(unit, "EnvironmentFiles") if v]
    problems = []
    if files and files != [own]:
        problems.append(f"{unit} reads {len(files)} EnvironmentFile(s): {', '.join(files)}")
        for f in files:
            if f == own:
                continue
            try:
                value = envfile.parse(_under(root, f).read_bytes(), f).get(envfile.IMAGE_KEY)
            except (OSError, ApplianceError) as exc:
                problems.append(f"{f} cannot be read ({exc})")
                continue
            if value is not None:
                problems.append(f"{f} sets {envfile.IMAGE_KEY}={value}")
    for d in props.get("DropInPaths", "").split():
        try:
            text = _under(root, d).read_text(errors="replace")
        except OSError:
            continue
        if envfile.IMAGE_KEY in text:
            problems.append(f"drop-in {d} names {envfile.IMAGE_KEY}")
    return problems


def _under(root: Path, path: str) -> Path:
    return Path(root) / path.lstrip("/")


def check_unit_overrides(ctx: Context, inst: Instance, *, allow: bool) -> None:
    """Refuse (or, with ``allow``, warn) when something besides the env file may set the image:
    the cutover would edit a file the unit does not go by."""
    check_overrides(ctx, {inst.unit: lambda: unit_overrides(ctx, inst)}, inst.env_path.name, allow)


def check_overrides(
    ctx: Context, checks: dict[str, Callable[[], list[str]]], env_name: str, allow: bool
) -> None:
    """Run each unit's override check (``{unit: check}``); refuse, or with ``allow`` warn, on
    any finding. A unit systemd cannot be asked about is refused (it could not be restarted)."""
    problems = []
    for unit, check in checks.items():
        try:
            problems += check()
        except SystemdNotNamed:
            raise  # a tree whose systemd is not named: bad input, its own one line (exit 2)
        except SystemdError as exc:
            # A systemd that cannot be asked cannot restart the unit either: refused here,
            # before the env file is written, not after a restart and a way back that fail.
            raise PreflightError(
                f"cannot ask systemd about {unit}: {exc}",
                fix="run it where the unit's systemd answers (APPLIANCE_SYSTEMD_PREFIX names "
                "another one)",
            ) from exc
    if not problems:
        return
    what = "; ".join(problems)
    if allow:
        ctx.progress(
            f"warning: {what}; going ahead (--allow-unit-overrides): the image gate checks "
            "what the container really runs"
        )
        return
    units = ", ".join(checks)
    raise PreflightError(
        f"{units} may not run the image {env_name} names: {what}",
        fix="remove the override (then `systemctl daemon-reload`), or pass "
        "--allow-unit-overrides (the gates still check the running container's image)",
    )


def way_back(
    ctx: Context,
    current_ref: str | None,
    image: str,
    rollback: bool,
    required: bool,
    inspect: Callable[[Context, str], ImageInfo] = inspect_image,
) -> tuple[ImageInfo | None, str | None]:
    """The image the cutover returns to on failure, and why it cannot when it cannot (a
    PreflightError when the way back is ``required``). ``inspect``: how the target finds an
    image (a group: on every host)."""
    if not current_ref or not rollback:
        return None, None
    try:
        return inspect(ctx, current_ref), None
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
