"""The engine's ``docker run`` command: the args file's arguments, the instance's settings, and
the image's labels deciding the Gemma 4 MTP flags, the queue bound, the drain on stop, the stop
gate and how the API key travels.

An image not labelled MTP is served without the speculative config, so pointing ``VLLM_IMAGE``
at a pre-MTP image is a safe rollback. The key never enters an argument or the container's
config: an image whose entry point reads it from stdin gets the checked key alone as the stdin
of ``docker run -i``; an older image (the rollback target after an upgrade) gets it by name,
``--env VLLM_API_KEY``, and a journal line says ``docker inspect`` shows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..engine_api import versions
from ..errors import UsageError
from ..host import cdi
from ..host.layout import Shape
from ..oci import labels
from .argsfile import ServeArgs
from .docker import DRAIN_S
from .environment import Settings

CONTAINER_MODEL_DIR = "/models"  # where a CPU profile's tiny model pair is mounted
CONTAINER_VLLM_CACHE = "/root/.cache/vllm"  # vLLM's cache root in the image (VLLM_CACHE_ROOT)
# torch.compile's caches, which vLLM leaves in the container's /tmp unless its own model compile
# runs: with tensor parallelism, vocab_parallel_embedding.py's get_masked_input_and_mask is
# compiled at the first forward (C++ on CPU, Triton on a GPU), and was rebuilt at every start,
# about 10 s of CPU a rank on CPU. Inductor's folder is mounted at the path it defaults to for
# root because its precompiled headers go there whatever TORCHINDUCTOR_CACHE_DIR says
# (torch/_inductor/codecache.py, _HEADER_DIR). Both caches key entries by source, flags and
# compiler version: an upgrade adds entries, never reads stale ones.
CONTAINER_INDUCTOR_CACHE = "/tmp/torchinductor_root"
CONTAINER_TRITON_CACHE = f"{CONTAINER_VLLM_CACHE}/triton"


@dataclass(frozen=True)
class Command:
    """The docker command to exec, what reaches its stdin and environment, and what to log."""

    argv: list[str]
    stdin: Path | None = None  # the API key file, for an image that takes the key on stdin
    env: dict[str, str] = field(default_factory=dict, repr=False)  # the old key path only
    notes: list[str] = field(default_factory=list)
    key: str | None = field(default=None, repr=False)  # that file's key, checked: stdin's bytes
    image: str = ""  # VLLM_IMAGE, as the env file names it


def speculative_args(args: ServeArgs, image_labels: Mapping[str, str]) -> tuple[list[str], str]:
    """The MTP flags this image gets, and the journal line saying why."""
    if not args.mtp:
        return [], f"profile {args.profile} has no speculative decoding"
    if not labels.supports_mtp(image_labels):
        why = f"image is not labelled {labels.MTP}={labels.TRUE}: serving without speculative"
        return [], why + " decoding"
    out = list(args.mtp)
    version = labels.vllm_version(image_labels)
    if version and versions.has_per_request_metrics(version):
        out += args.per_request
    return out, f"serving with Gemma 4 MTP speculative decoding ({' '.join(args.mtp)})"


def queue_args(args: ServeArgs, image_labels: Mapping[str, str]) -> tuple[list[str], str | None]:
    """The queue bound's flag this image gets, and the journal line saying why (None: the
    profile has no bound)."""
    if not args.queue:
        return [], None
    version = labels.vllm_version(image_labels)
    if version and versions.has_queue_bound(version):
        return list(args.queue), f"queue bound {' '.join(args.queue)}: 503 past it"
    return [], (
        f"image's vLLM {version or 'unlabelled'} has no --max-num-queued-reqs (needs >= "
        f"{labels.QUEUE_BOUND_MIN_VLLM}): serving with vLLM's unbounded queue"
    )


def drain_args(image_labels: Mapping[str, str]) -> tuple[list[str], str]:
    """The flag that lets in-flight requests finish when the unit stops, and the journal line
    saying what a stop does to them on this image."""
    version = labels.vllm_version(image_labels)
    if version and versions.has_drain(version):
        flag = ["--shutdown-timeout", str(DRAIN_S)]
        return (
            flag,
            f"a stop lets in-flight requests finish for up to {DRAIN_S} s ({' '.join(flag)})",
        )
    return [], (
        f"image's vLLM {version or 'unlabelled'} has no --shutdown-timeout (needs >= "
        f"{labels.DRAIN_MIN_VLLM}): a stop ends in-flight requests at once"
    )


def stop_gate_args(
    args: ServeArgs, image_labels: Mapping[str, str], image: str
) -> tuple[list[str], str | None]:
    """The middleware that turns arrivals away with 503 once a stop begins, and the journal line
    saying what they get on this image (None: a headless worker, which serves no HTTP)."""
    if "--headless" in args.serve:
        return [], None
    if labels.has_stop_gate(image_labels):
        flag = ["--middleware", labels.STOP_GATE_MIDDLEWARE]
        return flag, (
            "from a stop's SIGTERM on, new requests and /health get 503 with Retry-After "
            f"({' '.join(flag)})"
        )
    return [], (
        f"image {image} is not labelled {labels.STOP_GATE}={labels.TRUE} (built by an older "
        "appliance): during a stop, new requests get vLLM's HTTP 500 and /health answers 200; "
        "rebuild the image with `appliance image build`"
    )


def check_build(settings: Settings, image_labels: Mapping[str, str]) -> None:
    """Refuse an image of the other build than the instance runs: a CPU image given GPUs, or a
    CUDA image given none. Install writes ``VLLM_GPUS`` for a GPU profile and never for a CPU
    one, so the env file's devices say which build the profile runs on; an image that does not
    say which build it is is let through (its labels are read again by the cutover)."""
    device = "cuda" if settings.gpus else "cpu"
    found = labels.variant(image_labels)
    if found is None or found == device:
        return
    given = f"VLLM_GPUS={settings.gpus}" if settings.gpus else "no VLLM_GPUS"
    raise UsageError(
        f"image {settings.image} is a {found} build ({labels.VARIANT}={found}) and this "
        f"instance's profile runs on {device} ({given} in its env file)",
        fix=f"cut over to a {device} image (`appliance cutover NAME IMAGE`) or set VLLM_IMAGE "
        "to one",
    )


def command(
    instance: str,
    args: ServeArgs,
    settings: Settings,
    image_labels: Mapping[str, str],
    key: str | None,
    key_file: Path,
    devices: list[str] | None = None,
) -> Command:
    """The ``docker run`` of ``instance``; ``key`` is the checked API key (None: no key file);
    ``devices`` how its GPUs go to Docker (CDI devices or ``--gpus``, :func:`.cdi.passing`;
    None: ``--gpus`` with the env file's ``VLLM_GPUS``). A UsageError (exit 78) for an image of
    the other build (:func:`check_build`)."""
    check_build(settings, image_labels)
    image_version = image_labels.get(labels.VERSION) or "unlabelled"
    vllm = labels.vllm_version(image_labels) or "unlabelled"
    mtp = image_labels.get(labels.MTP) or "unlabelled"
    notes = [f"image {settings.image}: version {image_version}, vLLM {vllm}, Gemma 4 MTP {mtp}"]
    spec, why = speculative_args(args, image_labels)
    notes.append(why)
    queue, why = queue_args(args, image_labels)
    if why:
        notes.append(why)
    drain, why = drain_args(image_labels)
    notes.append(why)
    gate, why = stop_gate_args(args, image_labels, settings.image)
    if why:
        notes.append(why)
    key_args: list[str] = []
    stdin, stdin_key, env = None, None, {}
    if key is not None and labels.reads_api_key_stdin(image_labels):
        key_args = ["--interactive", "--env", f"{labels.API_KEY_STDIN_ENV}=1"]
        stdin, stdin_key = key_file, key
    elif key is not None:
        notes.append(
            f"image {settings.image} is not labelled {labels.API_KEY_STDIN}={labels.TRUE} (built "
            "by an older appliance): the API key goes to the container as --env VLLM_API_KEY, "
            "visible in `docker inspect`; rebuild the image with `appliance image build` to "
            "keep it out"
        )
        key_args = ["--env", "VLLM_API_KEY"]
        env = {"VLLM_API_KEY": key}
    gpu_args: list[str] = []
    if devices is not None:
        gpu_args = list(devices)
    elif settings.gpus:
        gpu_args = cdi.gpus_args(settings.gpus)
    volumes: list[str] = []
    if settings.model_dir:
        volumes += ["--volume", f"{settings.model_dir}:{CONTAINER_MODEL_DIR}:ro"]
    if settings.hf_cache_dir:
        # Read-write: the hub's offline lookups may still write lock files into the cache.
        volumes += ["--volume", f"{settings.hf_cache_dir}:/root/.cache/huggingface"]
    if settings.vllm_cache_dir:
        volumes += [
            "--volume",
            f"{settings.vllm_cache_dir}:{CONTAINER_VLLM_CACHE}",
            "--volume",
            f"{settings.vllm_cache_dir}/torchinductor:{CONTAINER_INDUCTOR_CACHE}",
            "--env",  # Triton's folder follows its variable; Inductor's headers do not
            f"TRITON_CACHE_DIR={CONTAINER_TRITON_CACHE}",
        ]
    argv = [
        "run",
        "--rm",
        "--name",
        Shape(instance).container,
        "--pull",
        "never",
        "--label",
        f"{labels.INSTANCE}={instance}",
        # Host networking: vLLM binds VLLM_HOST on the host itself, so loopback means loopback.
        "--network",
        "host",
        *args.docker,
        *gpu_args,
        *volumes,
        *key_args,
        settings.image,
        *args.serve,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        *spec,
        *queue,
        *drain,
        *gate,
    ]
    return Command(argv, stdin, env, notes, stdin_key, settings.image)
