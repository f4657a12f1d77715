"""Render an instance's files from a profile (no writing): the unit, env file, args file, script.

:func:`render` returns every file as ``{relative path: RenderedFile}``, the paths relative to
the root they are installed under, so ``appliance render --out DIR`` and ``appliance install
--root DIR`` lay out the same tree:

- ``etc/systemd/system/gemma4-vllm@.service``: the one templated unit (shared);
- ``usr/local/libexec/gemma4-vllm/serve``: the one serve script (shared, static:
  ``appliance/units/serve.sh``);
- ``etc/gemma4-vllm/<instance>.env``: the operator's values (image, profile, host, port, GPUs,
  paths), read by systemd and by :mod:`appliance.units.instance`;
- ``etc/gemma4-vllm/<instance>.args``: the profile's engine and docker arguments, one
  ``KIND VALUE`` record a line, read by the serve script as data.

Profile strings are data, never code: every value that reaches a file is validated first
(names, host, paths, GPU selection, image) or is an argument token that the serve script only
ever reads with ``read -r`` (one line each, no control characters). A bad input raises a
:class:`~appliance.errors.UsageError` before anything is rendered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import PurePosixPath

import jinja2

from .. import imageref, labels
from ..engine.local import OFFLINE_ENV
from ..errors import UsageError
from ..host.names import DATA_DIR, ENV_DIR, UNIT_TEMPLATE, check_instance
from ..models import DRAFTER_TYPES, dir_specs
from ..models import specs as hub_specs
from ..profiles import Profile, get
from ..profiles import validate as pv

LIBEXEC_DIR = "/usr/local/libexec/gemma4-vllm"
SERVE_SCRIPT = f"{LIBEXEC_DIR}/serve"
UNIT_DIR = "/etc/systemd/system"
CONTAINER_MODEL_DIR = "/models"  # where a CPU profile's tiny model pair is mounted
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
DEFAULT_IMAGE = "gemma4-vllm:latest"
ARGS_FORMAT = 1  # the serve script refuses an args file of another format

START_TIMEOUT_S = 1800
RESTART_SEC = 15
STOP_GRACE_S = 60  # vLLM drains in-flight requests on SIGTERM (the serve script's STOP_GRACE_S)
STOP_TIMEOUT_S = STOP_GRACE_S + 30
START_LIMIT_BURST = 3
# systemd counts starts in a fixed window and refuses the one after the burst: the window must
# hold burst starts that each hang to the start timeout and wait the restart delay, or a slowly
# failing image is reloaded forever (issue 11). The margin covers ExecStartPre/ExecStopPost.
START_LIMIT_MARGIN_S = 600

# Docker container names and systemd instance names both; no dots first, no slashes.
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_GPUS = re.compile(r"all|[0-9]+|device=[A-Za-z0-9:,/_-]+")
_PATH = re.compile(r"/[A-Za-z0-9._/@+-]*")
# An IPv4/IPv6 address or a host name; never starts with "-" (it would read as a flag).
_HOST = re.compile(r"[A-Za-z0-9:][A-Za-z0-9.:-]{0,252}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A hub repo id, a revision or a directory in MODEL_DIR, as the serve script accepts them: each
# path component starts with a letter or digit (no "..", no leading "-").
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
ANY_ADDRESS = {"0.0.0.0", "::"}
# The env file keys the serve script reads; a profile's args may require only these.
PATH_KEYS = ("MODEL_DIR", "HF_CACHE_DIR", "VLLM_CACHE_DIR")

MODE_UNIT = 0o644
MODE_ENV = 0o644  # no secret in it: the API key has its own 0600 file
MODE_ARGS = 0o644
MODE_SCRIPT = 0o755
MODE_SECRET = 0o600


@dataclass(frozen=True)
class RenderedFile:
    """One file to write: its text and its permission bits."""

    content: str
    mode: int


@dataclass(frozen=True)
class Options:
    """What an instance may set beyond its profile; ``None`` means the default (or the value
    already in the instance's env file, on install)."""

    image: str | None = None
    gpus: str | None = None
    host: str | None = None
    port: int | None = None
    model_dir: str | None = None  # CPU profiles: the tiny model pair on the host
    hf_cache_dir: str | None = None
    vllm_cache_dir: str | None = None


@dataclass(frozen=True)
class Paths:
    """Where an instance's files live, relative to the root they are installed under."""

    instance: str
    unit: str = field(init=False)
    script: str = field(init=False)
    env: str = field(init=False)
    args: str = field(init=False)
    api_key: str = field(init=False)

    def __post_init__(self) -> None:
        def rel(p: str) -> str:
            return str(PurePosixPath(p).relative_to("/"))

        object.__setattr__(self, "unit", rel(f"{UNIT_DIR}/{UNIT_TEMPLATE}"))
        object.__setattr__(self, "script", rel(SERVE_SCRIPT))
        object.__setattr__(self, "env", rel(f"{ENV_DIR}/{self.instance}.env"))
        object.__setattr__(self, "args", rel(f"{ENV_DIR}/{self.instance}.args"))
        object.__setattr__(self, "api_key", rel(f"{ENV_DIR}/{self.instance}.api-key"))


def check_host(host: str, where: str | None = None) -> str:
    """``host`` if it is an IP address or host name vLLM can bind, else a UsageError naming
    ``where`` it came from."""
    if not _HOST.fullmatch(host or ""):
        raise UsageError(
            f"{where or f'host {host!r}'} is not an IP address or host name",
            fix="use e.g. 127.0.0.1, ::1, 0.0.0.0 or a host name (letters, digits, '.:-')",
        )
    return host


def check_port(value: object, where: str = "port") -> int:
    """``value`` as a TCP port (1-65535), else a UsageError naming ``where`` it came from."""
    try:
        port = int(str(value), 10)
    except ValueError:
        port = 0
    if not 0 < port < 65536 or str(value).strip() != str(port):
        raise UsageError(f"{where} is not a TCP port", fix="set a port number from 1 to 65535")
    return port


def check_path(key: str, value: str) -> str:
    """``value`` if it is a plain absolute path (it becomes a mount), else a UsageError."""
    if not _PATH.fullmatch(value) or "/../" in value + "/":
        raise UsageError(
            f"{key} {value!r} is not a plain absolute path",
            fix="use an absolute path of letters, digits and ._/@+-",
        )
    return value


def check_token(value: str, where: str) -> str:
    """``value`` if it can be one record of the args file: one line, no control characters,
    not empty, no surrounding whitespace (the serve script's ``read -r`` would trim it)."""
    if not value or _CONTROL.search(value) or value != value.strip():
        raise UsageError(
            f"{where} {value!r} cannot be passed as one argument",
            fix="use a non-empty value on one line without control characters or "
            "surrounding spaces",
        )
    return value


def _check_profile(prof: Profile) -> None:
    """Refuse a profile whose strings could mean anything but data in a rendered file."""
    if not _PROFILE_NAME.fullmatch(prof.name or ""):
        raise UsageError(
            f"invalid profile name {prof.name!r}",
            fix="use letters, digits and '._-' (at most 64), starting with a letter or digit",
        )
    if _CONTROL.search(prof.description):
        raise UsageError(
            f"profile {prof.name}: the description must be one line without control characters"
        )
    check_host(prof.host, f"profile {prof.name}: host {prof.host!r}")
    check_port(prof.port, f"profile {prof.name}: port {prof.port!r}")
    for arg in prof.extra_args:
        if arg.split("=", 1)[0] in ("--host", "--port"):
            raise UsageError(
                f"profile {prof.name}: extra_args sets {arg.split('=', 1)[0]}",
                fix="the address is the instance's: install --host/--port (VLLM_HOST/VLLM_PORT)",
            )
    for key, value in prof.env.items():
        if not _ENV_KEY.fullmatch(key):
            raise UsageError(f"profile {prof.name}: invalid environment variable name {key!r}")
        check_token(value, f"profile {prof.name}: env {key}")


def paths(instance: str) -> Paths:
    """The relative paths of ``instance``'s files and of the shared unit and serve script."""
    return Paths(check_instance(instance))


def serve_script_text() -> str:
    """The one serve script (``appliance/units/serve.sh``), as installed."""
    return resources.files(__package__).joinpath("serve.sh").read_text()


@dataclass(frozen=True)
class UnitTiming:
    """The unit's restart and start-limit timings (one unit serves every profile)."""

    start_timeout_s: int
    restart_sec: int
    stop_timeout_s: int
    start_limit_burst: int
    start_limit_interval_s: int
    start_limit_margin_s: int = START_LIMIT_MARGIN_S


def start_limit_interval(start_timeout_s: int, restart_sec: int, burst: int) -> int:
    """The smallest ``StartLimitIntervalSec`` that still trips when every start fails slowly:
    ``burst`` starts, each hanging to ``start_timeout_s`` then waiting ``restart_sec``, plus
    :data:`START_LIMIT_MARGIN_S`."""
    return burst * (start_timeout_s + restart_sec) + START_LIMIT_MARGIN_S


def unit_timing(profile: Profile | None = None) -> UnitTiming:
    """The timings the unit is rendered with. ``profile`` is accepted for the arithmetic's
    tests: the unit is shared by every instance, so its timeouts are the largest any shipped
    profile needs (the 31B models' loads), the same for all."""
    return UnitTiming(
        start_timeout_s=START_TIMEOUT_S,
        restart_sec=RESTART_SEC,
        stop_timeout_s=STOP_TIMEOUT_S,
        start_limit_burst=START_LIMIT_BURST,
        start_limit_interval_s=start_limit_interval(
            START_TIMEOUT_S, RESTART_SEC, START_LIMIT_BURST
        ),
    )


def jinja_env(package: str = "appliance.units") -> jinja2.Environment:
    """The one Jinja setup of the unit templates (``package``'s ``templates/``): strict,
    unescaped, newlines kept."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader(package, "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def env_values(profile: Profile, instance: str, opts: Options) -> dict[str, str]:
    """The env file's assignments, in order, from the options (defaults where unset)."""
    port = opts.port if opts.port is not None else profile.port
    values = {
        "VLLM_IMAGE": imageref.validate(opts.image or DEFAULT_IMAGE),
        "APPLIANCE_PROFILE": profile.name,
        "VLLM_HOST": check_host(opts.host if opts.host is not None else profile.host),
        "VLLM_PORT": str(check_port(port, f"port {port}")),
    }
    if profile.hardware.device != "cpu":
        if opts.gpus is None and profile.hardware.mig:
            raise UsageError(
                f"profile {profile.name} runs one instance per MIG slice: say which slice",
                fix="pass --gpus device=GPU:MIG (e.g. device=0:1) or device=MIG-<uuid>",
            )
        gpus = opts.gpus or "all"
        if not _GPUS.fullmatch(gpus):
            raise UsageError(
                f"invalid GPU selection {gpus!r}", fix="use all, a count, or device=..."
            )
        values["VLLM_GPUS"] = gpus
    elif opts.gpus is not None:
        raise UsageError(f"profile {profile.name} runs on the CPU: --gpus does not apply")
    if profile.uses_devmodel:
        values["MODEL_DIR"] = check_path("model dir", opts.model_dir or f"{DATA_DIR}/models/tiny")
    elif opts.model_dir is not None:
        raise UsageError(
            f"profile {profile.name} serves {profile.model}: --model-dir applies to the "
            "tiny dev model profiles only",
            fix="put the weights in the Hugging Face cache (--hf-cache-dir)",
        )
    if not profile.uses_devmodel:
        values["HF_CACHE_DIR"] = check_path(
            "HF cache dir", opts.hf_cache_dir or f"{DATA_DIR}/huggingface"
        )
    values["VLLM_CACHE_DIR"] = check_path(
        "vLLM cache dir", opts.vllm_cache_dir or f"{DATA_DIR}/cache/{instance}"
    )
    return values


def _without_endpoint(args: list[str]) -> list[str]:
    """``args`` without ``--host H`` and ``--port P``: the serve script adds them from the env
    file, where the operator may change them."""
    out = list(args)
    for flag in ("--host", "--port"):
        i = out.index(flag)
        del out[i : i + 2]
    return out


def args_records(profile: Profile, env_keys: list[str]) -> list[tuple[str, str]]:
    """The args file's records, ``(kind, value)``, in order (see ``serve.sh`` for the kinds)."""
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
    records = [("format", str(ARGS_FORMAT)), ("profile", profile.name)]
    records += [("serve", a) for a in serve]
    records += [("mtp", a) for a in profile.speculative_args(devmodel=devmodel)]
    records += [("per-request", a) for a in profile.per_request_metrics_args()]
    records += [("docker", a) for a in docker]
    records += [("require", k) for k in env_keys if k == "VLLM_GPUS" or k in PATH_KEYS]
    records += model_records(profile)
    for kind, value in records:
        check_token(value, f"profile {profile.name}: {kind} argument")
    return records


def model_records(profile: Profile) -> list[tuple[str, str]]:
    """The ``model`` records (``ROLE hub REPO_ID [REVISION]`` or ``ROLE dir NAME``, NAME inside
    ``MODEL_DIR``) and, with a drafter, the ``drafter-type`` records: what the serve script checks
    is on the host before it starts the engine."""
    records = []
    if profile.uses_devmodel:
        for spec in dir_specs(profile):
            records.append(("model", f"{spec.role} dir {_model_name(profile, spec.repo_id)}"))
    else:
        for spec in hub_specs(profile):
            value = f"{spec.role} hub {_model_name(profile, spec.repo_id)}"
            if spec.revision:
                value += f" {_model_name(profile, spec.revision)}"
            records.append(("model", value))
    if any(v.startswith("drafter ") for _, v in records):
        records += [("drafter-type", t) for t in DRAFTER_TYPES]
    return records


def _model_name(profile: Profile, name: str) -> str:
    if not _MODEL_NAME.fullmatch(name):
        raise UsageError(
            f"profile {profile.name}: {name!r} is not a hub repo id, revision or model directory "
            "the serve script can check",
            fix="use ORG/NAME (letters, digits and '._-' in each part)",
        )
    return name


def render(
    profile: str | Profile,
    instance: str,
    options: Options | None = None,
) -> dict[str, RenderedFile]:
    """Every file of ``instance`` serving ``profile``, keyed by path relative to the root.

    The API key file is not rendered: :func:`appliance.units.install` creates it on the host.
    Raises a UsageError (nothing rendered) on an invalid name, profile, image, GPU selection,
    host, port, path, or a profile with validation errors.
    """
    opts = options or Options()
    check_instance(instance)
    prof = get(profile) if isinstance(profile, str) else profile
    if prof.multinode is not None:
        raise UsageError(
            f"profile {prof.name} serves one model across {prof.multinode.nodes} hosts",
            fix=f"appliance multinode install --profile {prof.name} (a head and worker units)",
        )
    _check_profile(prof)
    pv.require_valid(prof)
    values = env_values(prof, instance, opts)
    records = args_records(prof, list(values))
    context = {
        "profile": prof,
        "instance": instance,
        "labels": labels,
        "env_dir": ENV_DIR,
        "serve_script": SERVE_SCRIPT,
        "values": values,
        "records": records,
        "width": max(len(kind) for kind, _ in records),
        "args_format": ARGS_FORMAT,
        "gpus_hint": "one MIG slice per instance" if prof.hardware.mig else "default all",
        "timing": unit_timing(prof),
        "stop_grace_s": STOP_GRACE_S,
        "per_request_min_vllm": labels.PER_REQUEST_METRICS_MIN_VLLM,
    }
    env = jinja_env()
    p = paths(instance)
    # In the order they are written: what the others refer to first, the unit last.
    return {
        p.script: RenderedFile(serve_script_text(), MODE_SCRIPT),
        p.args: RenderedFile(env.get_template("instance.args.j2").render(context), MODE_ARGS),
        p.env: RenderedFile(env.get_template("instance.env.j2").render(context), MODE_ENV),
        p.unit: RenderedFile(env.get_template(UNIT_TEMPLATE + ".j2").render(context), MODE_UNIT),
    }


def options_from_env(existing: Mapping[str, str], explicit: Options) -> Options:
    """``explicit`` with each unset option taken from an existing env file's value."""
    keys = {
        "image": "VLLM_IMAGE",
        "gpus": "VLLM_GPUS",
        "host": "VLLM_HOST",
        "port": "VLLM_PORT",
        "model_dir": "MODEL_DIR",
        "hf_cache_dir": "HF_CACHE_DIR",
        "vllm_cache_dir": "VLLM_CACHE_DIR",
    }
    merged = {
        attr: getattr(explicit, attr) if getattr(explicit, attr) is not None else existing.get(key)
        for attr, key in keys.items()
    }
    if merged["port"] is not None and not isinstance(merged["port"], int):
        merged["port"] = check_port(merged["port"], f"VLLM_PORT={merged['port']!r}")
    return Options(**merged)
