"""What the engine's container is run with: the args file's record, from a profile.

The container policy (no capability, no new privileges, an init, a pids limit, shared memory,
no media fetching, offline) and the exact ``vllm serve`` arguments of the profile, less the
address (the env file's), with the MTP flags and the queue bound apart: the serve program passes
those only to an image whose labels say it has them (:mod:`appliance.serve.container`).
"""

from __future__ import annotations

from ..engine.local import OFFLINE_ENV
from ..errors import UsageError
from ..host.names import ENV_DIR
from ..host.values import REQUIRABLE_KEYS
from ..models.where import dir_specs
from ..models.where import specs as hub_specs
from ..profiles import Profile
from ..serve.argsfile import MODEL_NAME, ModelRecord, ServeArgs, check_argument
from ..serve.container import CONTAINER_MODEL_DIR

# The only media domain vLLM may fetch from: a name that never resolves, so none is fetched.
MEDIA_DOMAIN_NONE = "media-fetching-disabled.invalid"
# Least privilege for the engine container, every profile (tested on the CPU images).
CONTAINER_LIMITS = (
    # No capability at all: vLLM runs as root in the container but needs none. Root still owns
    # the caches and weights the unit mounts (owner permissions: no CAP_DAC_OVERRIDE needed).
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    # Docker's init as PID 1: reaps vLLM's worker processes and forwards docker stop's SIGTERM.
    "--init",
    # A fork bomb stops here. Counts threads: the tiny CPU engine ran 73 on 2 cores (torch and
    # OpenMP threads grow with the cores); a 4-GPU host's workers a few hundred.
    "--pids-limit",
    "4096",
)
# No --ulimit nofile: vLLM's attempt to raise its open-files limit fails without
# CAP_SYS_RESOURCE (a warning), and it keeps dockerd's limit; a --ulimit above dockerd's own hard
# limit stops the container at create ("error setting rlimit type 7", seen on this host).


def _without_endpoint(args: list[str]) -> list[str]:
    """``args`` without ``--host H`` and ``--port P``: the serve program adds them from the env
    file, where the operator may change them."""
    out = list(args)
    for flag in ("--host", "--port"):
        i = out.index(flag)
        del out[i : i + 2]
    return out


def serve_args(profile: Profile, env_keys: list[str]) -> ServeArgs:
    """The args file's record: the engine and container arguments of ``profile`` and the env
    keys (of ``env_keys``) the instance must set."""
    devmodel = CONTAINER_MODEL_DIR if profile.uses_devmodel else None
    serve = _without_endpoint(profile.serve_args(devmodel=devmodel, speculative=False))
    # Gemma 4 is multimodal and vLLM fetches image URLs from the host's network (the container
    # has host networking): a caller could make it GET loopback-only services. vLLM refuses any
    # http(s) media URL whose host is not listed; the only name listed is one that never resolves
    # (RFC 6761 .invalid), so no URL is fetched at all. data: URLs still work; file: URLs need
    # --allowed-local-media-path, which no profile sets. In vLLM since 0.11 (0.19 and 0.32 here).
    serve += ["--allowed-media-domains", MEDIA_DOMAIN_NONE]
    docker = list(CONTAINER_LIMITS)
    if profile.hardware.device == "cuda" and profile.tensor_parallel_size > 1:
        # The tensor-parallel workers' NCCL talks through shared memory. vLLM's docs allow
        # --shm-size here too, but that was never run on GPUs in this project: keep the host's IPC
        # namespace, the configuration the reference host was tested with.
        docker += ["--ipc", "host"]
    else:
        # A private /dev/shm, big enough: Docker's default 64 MiB kills the CPU engine at start
        # ("Insufficient space in /dev/shm"); a single GPU's engine needs it for its processes.
        docker += ["--shm-size", "1g" if profile.hardware.device == "cpu" else "16g"]
    # Redirects off: an allowed media host must not bounce vLLM to another one.
    for key, value in {**OFFLINE_ENV, "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0", **profile.env}.items():
        docker += ["--env", f"{key}={value}"]
    args = ServeArgs(
        profile=profile.name,
        serve=tuple(serve),
        mtp=tuple(profile.speculative_args(devmodel=devmodel)),
        per_request=tuple(profile.per_request_metrics_args()),
        queue=tuple(profile.queue_args()),
        docker=tuple(docker),
        require=tuple(k for k in env_keys if k in REQUIRABLE_KEYS),
        models=model_records(profile),
    )
    check_arguments(args, profile)
    return args


def check_arguments(args: ServeArgs, profile: Profile) -> None:
    """Refuse an argument that could not be passed as one (a UsageError naming it)."""
    for kind in ("serve", "mtp", "per_request", "queue", "docker"):
        for value in getattr(args, kind):
            check_argument(value, f"profile {profile.name}: {kind} argument")


def model_records(profile: Profile) -> tuple[ModelRecord, ...]:
    """The models the serve program checks are on the host before it starts the engine: the
    hub's (in ``HF_CACHE_DIR``) or the tiny pair's directories (in ``MODEL_DIR``)."""
    if profile.uses_devmodel:
        return tuple(
            ModelRecord(spec.role, "dir", _model_name(profile, spec.repo_id))
            for spec in dir_specs(profile)
        )
    return tuple(
        ModelRecord(
            spec.role,
            "hub",
            _model_name(profile, spec.repo_id),
            _model_name(profile, spec.revision) if spec.revision else None,
        )
        for spec in hub_specs(profile)
    )


def _model_name(profile: Profile, name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise UsageError(
            f"profile {profile.name}: {name!r} is not a hub repo id, revision or model directory "
            "the serve program can check",
            fix="use ORG/NAME (letters, digits and '._-' in each part)",
        )
    return name


def args_text(args: ServeArgs, instance: str) -> str:
    """The args file of ``instance``."""
    return args.to_json(
        f"{ENV_DIR}/{instance}.args: the engine arguments of gemma4-vllm@{instance}.service, "
        f"from profile {args.profile}. Generated by `appliance instance install`; do not edit: "
        "change the profile (or APPLIANCE_PROFILE in the env file) and re-run "
        "`appliance instance install`."
    )
