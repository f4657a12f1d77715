"""Build an appliance image with the Docker SDK, then tag it per the scheme.

``build(client, "cpu-mtp")`` makes (or reuses) the bootstrapped base, downloads (or reuses) the
lock's wheelhouse, assembles a small build context (the Dockerfile, the entry point, vLLM's CLI
wrapper, the lock), and builds with the engine's classic builder. Every input is hashed into the
``io.gemma4-appliance.build-digest`` label: when an image with the same digest is already in the
engine the build is skipped (a warm run costs a label lookup), and any change to a Dockerfile,
lock, entry point or base rebuilds.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__, assets
from ..engine_api import versions
from ..errors import ApplianceError, UsageError
from ..host.names import CACHE_DIR
from ..oci import labels
from ..progress import QUIET, verbosity
from . import base, scheme, targets, wheelhouse
from .files import digest
from .lock import lock_path

Progress = Callable[[str], None]

# The CPU engine's entry point, a module of the package (copied into the CPU images).
VLLM_MAIN = Path(__file__).resolve().parents[1] / "engine" / "vllm_main.py"
# The middleware that refuses arrivals once a stop begins (copied into every image beside it).
STOP_GATE = VLLM_MAIN.with_name("stop_gate.py")
# vLLM's answers about the Gemma 4 model classes, made at the build (copied into every image).
MODEL_INFO_CACHE = VLLM_MAIN.with_name("model_info_cache.py")


def docker_folder() -> Path:
    """The Dockerfiles, entry point and locks: the checkout's ``docker/``, or the installed
    package's copy (:mod:`appliance.assets`)."""
    return assets.path("docker")


def system_cache() -> Path:
    """The per-machine cache (rootfs tarballs, wheelhouses): ``APPLIANCE_SYSTEM_CACHE`` or
    ``/var/cache/gemma4-appliance``."""
    return Path(os.environ.get("APPLIANCE_SYSTEM_CACHE", CACHE_DIR))


@dataclass
class BuildResult:
    """What one build produced."""

    target: str
    image_id: str
    tags: list[str]
    labels: dict[str, str]
    size_bytes: int
    seconds: float
    cached: bool
    steps: dict[str, float] = field(default_factory=dict)


def _revision() -> str:
    """The checkout's commit, or the package's version when built from an installed package."""
    where = assets.root()
    if where == assets.PACKAGED:
        return f"gemma4-appliance {__version__}"
    try:
        out = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _find_by_digest(client, build_digest: str):
    found = client.images.list(filters={"label": f"{scheme.BUILD_DIGEST}={build_digest}"})
    return found[0] if found else None


def build(
    client,
    target_name: str,
    *,
    repository: str = scheme.REPOSITORY,
    vllm_version: str | None = None,
    docker_dir: Path | None = None,
    cache_dir: Path | None = None,
    tag: bool = True,
    progress: Progress | None = None,
) -> BuildResult:
    """Build ``target_name`` (see :mod:`appliance.images.targets`) unless an identical image
    exists; apply the tag scheme unless ``tag`` is False. ``docker_dir``: :func:`docker_folder`
    unless given."""
    say = progress or (lambda _msg: None)
    docker_dir = docker_dir or docker_folder()
    target = targets.get(target_name)
    scheme.check_repository(repository)
    cache_dir = cache_dir or system_cache()
    version = target.vllm_version or vllm_version
    if version is None:
        raise UsageError(f"target {target.name} needs --vllm-version", fix="e.g. 0.32.0")
    if target.vllm_version and vllm_version and vllm_version != target.vllm_version:
        raise UsageError(
            f"target {target.name} is vLLM {target.vllm_version}, not {vllm_version}",
            fix="leave out --vllm-version for CPU targets",
        )
    mtp = versions.has_mtp(scheme.check_version(version))
    start = time.monotonic()
    steps: dict[str, float] = {}
    buildargs = {
        "VLLM_VERSION": version,
        "GEMMA4_MTP": labels.TRUE if mtp else labels.FALSE,
        "IMAGE_VERSION": scheme.image_version(version, mtp, broken=target.broken),
    }
    files = {
        "Dockerfile": (docker_dir / target.dockerfile).read_bytes(),
        "entrypoint.sh": (docker_dir / "entrypoint.sh").read_bytes(),
        "vllm_main.py": VLLM_MAIN.read_bytes(),
        "stop_gate.py": STOP_GATE.read_bytes(),
        "model_info_cache.py": MODEL_INFO_CACHE.read_bytes(),
    }
    identity: list[str] = [target.name, repr(sorted(buildargs.items()))]
    wheel_dir = None
    if target.uses_lock:
        t0 = time.monotonic()
        base_image = base.ensure_base(client, docker_dir, cache_dir)
        steps["base"] = time.monotonic() - t0
        say(f"base {base_image.ref} ({'cached' if base_image.cached else 'made'})")
        buildargs["BASE_IMAGE"] = base_image.ref
        identity.append(base_image.image_id)
        lock = lock_path(version, docker_dir)
        if not lock.exists():
            raise UsageError(f"no lock {lock}", fix=f"run: appliance image lock {version}")
        files["vllm.lock"] = lock.read_bytes()
        buildargs["INSTALLER"] = wheelhouse.INSTALLER
        identity.append(wheelhouse.INSTALLER)
    if target.parent is not None:
        t0 = time.monotonic()
        parent = build(
            client,
            target.parent,
            repository=repository,
            docker_dir=docker_dir,
            cache_dir=cache_dir,
            tag=tag,
            progress=progress,
        )
        steps["parent"] = time.monotonic() - t0
        # By id: the parent's tags may move, the broken image must sit on this exact parent.
        buildargs["FROM_IMAGE"] = parent.image_id
        identity.append(parent.image_id)
    build_digest = digest(*identity, *(k.encode() + v for k, v in sorted(files.items())))

    existing = _find_by_digest(client, build_digest)
    if existing is None:
        if target.uses_lock:
            t0 = time.monotonic()
            say(f"wheelhouse for vLLM {version} ...")
            wheel_dir = wheelhouse.ensure_wheelhouse(lock_path(version, docker_dir), cache_dir)
            steps["wheelhouse"] = time.monotonic() - t0
        buildargs["CREATED"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        buildargs["REVISION"] = _revision()
        t0 = time.monotonic()
        say(f"building {target.name} (vLLM {version}) ...")
        image_id = _docker_build(client, files, buildargs, build_digest, wheel_dir, say)
        steps["docker build"] = time.monotonic() - t0
        cached = False
    else:
        image_id = existing.id
        cached = True
        say(f"{target.name}: identical image {image_id[7:19]} already built")
    image = client.images.get(image_id)
    _check_variant(target, image.labels)
    tags = scheme.apply_tags(client, image_id, repository) if tag else []
    image = client.images.get(image_id)
    return BuildResult(
        target=target.name,
        image_id=image_id,
        tags=sorted(image.tags) if tag else tags,
        labels=dict(image.labels or {}),
        size_bytes=int(image.attrs.get("Size") or 0),
        seconds=time.monotonic() - start,
        cached=cached,
        steps=steps,
    )


def _check_variant(target: targets.Target, image_labels: dict | None) -> None:
    """Refuse to tag an image whose Dockerfile labelled it another build than its target's: its
    tags (``-cpu`` or not) and every check of an image against a profile go by that label."""
    found = labels.variant(image_labels)
    if found != target.variant:
        raise ApplianceError(
            f"target {target.name} built an image labelled {labels.VARIANT}={found or '(none)'}, "
            f"not {target.variant}",
            fix=f"its Dockerfile (docker/{target.dockerfile}) must write "
            f'LABEL {labels.VARIANT}="{target.variant}"',
        )


def _docker_build(client, files, buildargs, build_digest, wheel_dir, say) -> str:
    import docker.errors

    with tempfile.TemporaryDirectory(prefix="appliance-build-") as ctx:
        for name, data in files.items():
            path = Path(ctx) / name
            path.write_bytes(data)
            path.chmod(0o755 if name.endswith(".sh") else 0o644)
        serving = wheelhouse.serve(wheel_dir) if wheel_dir is not None else _no_wheels()
        with serving as url:
            if url is not None:
                buildargs = {**buildargs, "WHEELS_URL": url}
            log: list[str] = []
            image_id = None
            try:
                stream = client.api.build(
                    path=ctx,
                    buildargs=buildargs,
                    labels={scheme.BUILD_DIGEST: build_digest},
                    # The wheelhouse is served on the host's 127.0.0.1.
                    network_mode="host",
                    rm=True,
                    forcerm=True,
                    pull=False,
                    decode=True,
                )
                for chunk in stream:
                    if "stream" in chunk:
                        for line in chunk["stream"].rstrip().splitlines():
                            if line.strip():
                                log.append(line)
                                _say_step(say, line)
                    elif chunk.get("status") and not chunk.get("progressDetail"):
                        # The daemon pulling a missing base: one line per layer event, not
                        # its byte counts.
                        _say_step(say, f"{chunk.get('id', '')} {chunk['status']}".strip())
                    if "error" in chunk:
                        log.append(chunk["error"].rstrip())
                        raise ApplianceError("docker build failed: " + "\n".join(log[-15:]))
                    if "aux" in chunk and "ID" in chunk["aux"]:
                        image_id = chunk["aux"]["ID"]
            except docker.errors.APIError as exc:
                raise ApplianceError(f"docker build failed: {exc.explanation or exc}") from exc
    if image_id is None:
        raise ApplianceError("docker build finished without an image id: " + "\n".join(log[-10:]))
    return image_id


# The classic builder's own bookkeeping between steps: not what a step printed.
_BUILDER_NOISE = (" ---> ", "Removing intermediate container", "Successfully built ")


def _say_step(say, line: str) -> None:
    """A step header as it is, a line a ``RUN`` printed indented under it (issue 56 §3: the
    build showed the headers only); nothing under ``-q`` (:mod:`appliance.progress`)."""
    if verbosity() <= QUIET:
        return
    if line.startswith("Step "):
        say(line)
    elif not line.startswith(_BUILDER_NOISE):
        say(f"  {line}")


class _no_wheels:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
