"""Docker: the engine answers and is recent enough, its containers can reach the GPUs (as CDI
devices, through the nvidia runtime or its hook), its data root has room for the image, and the
image (when here) is the build the profile runs on."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..host import cdi
from ..images import variant
from ..profiles import Profile
from .findings import Finding

# `docker run --gpus` (what the serve program passes) arrived in Docker 19.03.
MIN_DOCKER_GPUS = (19, 3)
# Free space wanted under Docker's data root when the image is not there yet: a margin, not a
# measurement (the CUDA CPU images differ; the CPU image built here is 3.6 GB).
IMAGE_ROOM_GIB = {"cuda": 30, "cpu": 8}
HOOK = "nvidia-container-runtime-hook"
DEFAULT_SOCKET = "unix:///var/run/docker.sock"  # the SDK's default without DOCKER_HOST
INSTALL = "install Docker (apt-get install docker.io) and start it: systemctl enable --now docker"


@dataclass(frozen=True)
class Engine:
    """What the Docker engine said when asked once: its client, version and info, or why it did
    not answer (``error``)."""

    client: object = None
    version: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    error: Exception | None = None

    @property
    def cdi(self) -> bool | None:
        """Whether Docker takes CDI devices: ``docker info`` lists the CDI spec folders it
        reads only where CDI is on (None: the engine did not answer)."""
        return None if self.error is not None else bool(cdi_dirs(self.info))


def connect(client=None) -> Engine:
    """Ask the engine (``client``: a Docker SDK client; default: from the environment,
    ``DOCKER_HOST`` included) for its version and info."""
    import docker.errors

    import docker

    try:
        client = client or docker.DockerClient.from_env(timeout=10)
        return Engine(client, client.version(), client.info())
    except (docker.errors.DockerException, OSError) as exc:
        return Engine(error=exc)


def cdi_dirs(info: dict) -> tuple[str, ...]:
    """Docker's CDI spec folders (``docker info``'s ``CDISpecDirs``): none where CDI is off or
    Docker is older than the field."""
    dirs = info.get("CDISpecDirs") or ()
    return tuple(d for d in dirs if isinstance(d, str) and d.startswith("/"))


def docker_findings(
    profile: Profile,
    image: str,
    client=None,
    *,
    root: Path = Path("/"),
    engine: Engine | None = None,
) -> list[Finding]:
    """``docker.engine``, then (GPU profiles) ``docker.gpus``, ``docker.data_root`` and (when
    the image is here) ``docker.image``. ``engine``: what Docker said (default: asked through
    ``client``, :func:`connect`); ``root``: the tree whose CDI specs are read."""
    import docker.errors

    engine = engine or connect(client)
    if engine.error is not None:
        return [absent(engine.error), build_unchecked(image, "no Docker engine answered")]
    client, version, info = engine.client, engine.version, engine.info
    cuda = profile.hardware.device == "cuda"
    text = version.get("Version", "?")
    out = []
    if cuda and _version(text) < MIN_DOCKER_GPUS:
        out.append(
            Finding(
                "docker.engine",
                "blocker",
                f"Docker {text} is older than 19.03: it has no --gpus",
                "upgrade Docker",
            )
        )
    else:
        out.append(
            Finding("docker.engine", "ok", f"Docker {text} (API {version.get('ApiVersion')})")
        )
    if cuda:
        out.append(gpu_access(info, root))
    try:
        found = client.images.get(image)  # looked up once, for the two findings below
    except (docker.errors.DockerException, OSError):
        found = None
    out.append(_data_root(info, image, found is not None, profile.hardware.device))
    if found is not None:
        out.append(_image_build(found, image, profile))
    else:
        out.append(build_unchecked(image, f"{image} is not here"))
    return out


def build_unchecked(image: str, why: str) -> Finding:
    """``docker.image`` when the image's build (CPU or CUDA) cannot be read here; the serve
    program checks it at every start (a wrong build exits 78)."""
    return Finding(
        "docker.image",
        "warn",
        f"image build not checked: {why}",
        f"the serve program checks {image}'s build at start; or `appliance host check` where "
        "Docker answers",
    )


def absent(exc: Exception, host: str | None = None) -> Finding:
    """``docker.engine`` when the engine does not answer: one plain line, the socket named where
    there is none (the SDK's own text is a nested exception tuple)."""
    host = host if host is not None else os.environ.get("DOCKER_HOST", DEFAULT_SOCKET)
    fix = INSTALL
    path = host.removeprefix("unix://")
    if host.startswith(("unix://", "/")) and not Path(path).exists():
        return Finding(
            "docker.engine", "blocker", f"no Docker socket at {path}: is docker running?", fix
        )
    return Finding(
        "docker.engine",
        "blocker",
        f"the Docker engine at {host} does not answer ({type(exc).__name__})",
        fix,
    )


def engine_finding(client=None) -> Finding:
    """``docker.engine`` alone (host check without a profile)."""
    import docker.errors

    import docker

    try:
        client = client or docker.DockerClient.from_env(timeout=10)
        version = client.version()
    except (docker.errors.DockerException, OSError) as exc:
        return absent(exc)
    return Finding(
        "docker.engine",
        "ok",
        f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion')})",
    )


def _image_build(found, image: str, profile: Profile) -> Finding:
    """``docker.image`` for the image ``found`` here: a CPU image for a GPU profile (or the
    reverse) is a blocker."""
    device = profile.hardware.device
    fit = variant.fit(image, found.labels, device, profile.name)
    if fit.refusal is not None:
        return Finding("docker.image", "blocker", fit.refusal, fit.fix or "")
    if fit.warning is not None:
        return Finding("docker.image", "warn", fit.warning, "build it with `appliance image build`")
    return Finding("docker.image", "ok", f"image {image} is a {device} build")


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def gpu_access(info: dict, root: Path = Path("/")) -> Finding:
    """How Docker can give a container GPUs: CDI devices (CDI on and a spec in its folders under
    ``root``), the nvidia runtime, or the runtime hook; a blocker where none of them."""
    runtimes = sorted(info.get("Runtimes") or {})
    dirs = cdi_dirs(info)
    specs = cdi.read(root, dirs) if dirs else ()
    if specs:
        return Finding(
            "docker.gpus",
            "ok",
            f"Docker takes CDI devices (CDI on; spec {specs[0].path}, "
            f"{len(specs[0].names)} device name(s))",
        )
    if "nvidia" in runtimes:
        return Finding("docker.gpus", "ok", "Docker has the nvidia runtime")
    if shutil.which(HOOK):
        return Finding("docker.gpus", "ok", f"--gpus through {HOOK} (NVIDIA Container Toolkit)")
    configure = "nvidia-ctk runtime configure --runtime=docker && systemctl restart docker"
    present = cdi.read(root)  # the documented folders, where Docker does not read them
    if present:
        why = "Docker's CDI is off" if not dirs else f"Docker reads CDI specs from {dirs}"
        return Finding(
            "docker.gpus",
            "blocker",
            f"a CDI spec ({present[0].path}) but {why}, and no nvidia runtime or {HOOK} for "
            "--gpus: no container gets a GPU",
            f"{cdi.ENABLE}; or {configure}",
        )
    return Finding(
        "docker.gpus",
        "blocker",
        f"Docker cannot give containers GPUs: no nvidia runtime (runtimes: "
        f"{', '.join(runtimes) or 'none'}), no {HOOK}, no CDI spec",
        f"install the NVIDIA Container Toolkit, then {configure}",
    )


def _data_root(info: dict, image: str, present: bool, device: str) -> Finding:
    root = info.get("DockerRootDir") or "/var/lib/docker"
    try:
        free = shutil.disk_usage(root).free
    except OSError as exc:
        return Finding("docker.data_root", "warn", f"cannot measure {root}: {exc}")
    gib = free / 2**30
    if present:
        return Finding(
            "docker.data_root", "ok", f"image {image} present; {gib:.1f} GiB free at {root}"
        )
    want = IMAGE_ROOM_GIB.get(device, 0)
    if gib < want:
        return Finding(
            "docker.data_root",
            "warn",
            f"{gib:.1f} GiB free at {root}, image {image} is not there yet (allow {want} GiB)",
            "free space there, or move Docker's data-root to a larger disk",
        )
    return Finding("docker.data_root", "ok", f"{gib:.1f} GiB free at {root}")
