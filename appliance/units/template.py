"""Render an instance's systemd unit, env file and serve script from a profile (no writing).

:func:`render` returns every file as ``{relative path: RenderedFile}``, the paths relative to
the root they are installed under, so ``appliance render --out DIR`` and ``appliance install
--root DIR`` lay out the same tree. Everything is validated first (instance name, profile, image
reference, GPU selection, paths); a bad input raises a :class:`~appliance.errors.UsageError`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import jinja2

from .. import imageref, labels
from ..engine.local import OFFLINE_ENV
from ..errors import UsageError
from ..profiles import Profile, get
from ..profiles import validate as pv

UNIT_TEMPLATE = "gemma4-vllm@.service"
ENV_DIR = "/etc/gemma4-vllm"
LIBEXEC_DIR = "/usr/local/libexec/gemma4-vllm"
UNIT_DIR = "/etc/systemd/system"
DATA_DIR = "/var/lib/gemma4-vllm"
CONTAINER_MODEL_DIR = "/models"  # where a CPU profile's tiny model pair is mounted
DEFAULT_IMAGE = "gemma4-vllm:latest"

START_TIMEOUT_S = 1800
STOP_GRACE_S = 60  # vLLM drains in-flight requests on SIGTERM
STOP_TIMEOUT_S = STOP_GRACE_S + 30
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 4 * START_TIMEOUT_S

# Docker container names and systemd instance names both; no dots first, no slashes.
_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_GPUS = re.compile(r"all|[0-9]+|device=[A-Za-z0-9:,/_-]+")
_PATH = re.compile(r"/[A-Za-z0-9._/@+-]*")
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
_ANY = {"0.0.0.0", "::", ""}

MODE_UNIT = 0o644
MODE_ENV = 0o644  # no secret in it: the API key has its own 0600 file
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
    port: int | None = None
    model_dir: str | None = None  # CPU profiles: the tiny model pair on the host
    hf_cache_dir: str | None = None
    vllm_cache_dir: str | None = None


@dataclass(frozen=True)
class Paths:
    """Where an instance's files live, relative to the root they are installed under."""

    instance: str
    unit: str = field(init=False)
    env: str = field(init=False)
    api_key: str = field(init=False)
    script: str = field(init=False)

    def __post_init__(self) -> None:
        def rel(p: str) -> str:
            return str(PurePosixPath(p).relative_to("/"))

        object.__setattr__(self, "unit", rel(f"{UNIT_DIR}/{UNIT_TEMPLATE}"))
        object.__setattr__(self, "env", rel(f"{ENV_DIR}/{self.instance}.env"))
        object.__setattr__(self, "api_key", rel(f"{ENV_DIR}/{self.instance}.api-key"))
        object.__setattr__(self, "script", rel(f"{LIBEXEC_DIR}/serve-{self.instance}.sh"))


def check_instance(name: str) -> str:
    """``name`` if it is a valid instance name, else a UsageError."""
    if not _INSTANCE.fullmatch(name or ""):
        raise UsageError(
            f"invalid instance name {name!r}",
            fix="use letters, digits, '-' and '_' (at most 64), starting with a letter or digit",
        )
    return name


def paths(instance: str) -> Paths:
    """The relative paths of ``instance``'s unit, env file, API key file and serve script."""
    return Paths(check_instance(instance))


def unit_name(instance: str) -> str:
    return f"gemma4-vllm@{check_instance(instance)}.service"


def container_name(instance: str) -> str:
    return f"gemma4-vllm-{check_instance(instance)}"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("appliance.units", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    return env


def _check_path(key: str, value: str) -> str:
    if not _PATH.fullmatch(value) or "/../" in value + "/":
        raise UsageError(
            f"{key} {value!r} is not a plain absolute path",
            fix="use an absolute path of letters, digits and ._/@+-",
        )
    return value


def env_values(profile: Profile, instance: str, opts: Options) -> dict[str, str]:
    """The env file's assignments, in order, from the options (defaults where unset)."""
    values = {"VLLM_IMAGE": imageref.validate(opts.image or DEFAULT_IMAGE)}
    gpu = profile.hardware.device != "cpu"
    if gpu:
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
        values["MODEL_DIR"] = _check_path("model dir", opts.model_dir or f"{DATA_DIR}/models/tiny")
    elif opts.model_dir is not None:
        raise UsageError(
            f"profile {profile.name} serves {profile.model}: --model-dir applies to the "
            "tiny dev model profiles only",
            fix="put the weights in the Hugging Face cache (--hf-cache-dir)",
        )
    if not profile.uses_devmodel:
        values["HF_CACHE_DIR"] = _check_path(
            "HF cache dir", opts.hf_cache_dir or f"{DATA_DIR}/huggingface"
        )
    values["VLLM_CACHE_DIR"] = _check_path(
        "vLLM cache dir", opts.vllm_cache_dir or f"{DATA_DIR}/cache/{instance}"
    )
    return values


def _arg_lines(args: list[str]) -> list[str]:
    """Shell-quoted arguments, a flag and its value on one line."""
    lines: list[str] = []
    for arg in args:
        if (
            lines
            and not arg.startswith("--")
            and lines[-1].startswith("--")
            and " " not in lines[-1]
        ):
            lines[-1] += " " + shlex.quote(arg)
        else:
            lines.append(shlex.quote(arg))
    return lines


def _docker_lines(profile: Profile) -> list[str]:
    """``docker run`` options after the fixed ones: IPC, GPUs, mounts, environment."""
    lines: list[str] = []
    if profile.hardware.device == "cpu":
        # Docker's default 64 MiB /dev/shm kills the CPU engine at start ("Insufficient space").
        lines.append("--shm-size 1g")
    else:
        # vLLM's workers (tensor parallelism, NCCL) talk through shared memory: the host's IPC.
        lines.append("--ipc host")
        lines.append('--gpus "$gpus"')
    if profile.uses_devmodel:
        lines.append(f'--volume "$MODEL_DIR:{CONTAINER_MODEL_DIR}:ro"')
    else:
        # Read-write: the hub's offline lookups may still write lock files into the cache.
        lines.append('--volume "$HF_CACHE_DIR:/root/.cache/huggingface"')
    lines.append('--volume "$VLLM_CACHE_DIR:/root/.cache/vllm"')
    env = {**OFFLINE_ENV, **profile.env}
    lines += [f"--env {shlex.quote(f'{k}={v}')}" for k, v in env.items()]
    return lines


def render(
    profile: str | Profile,
    instance: str,
    options: Options | None = None,
) -> dict[str, RenderedFile]:
    """Every file of ``instance`` serving ``profile``, keyed by path relative to the root.

    The API key file is not rendered: :func:`appliance.units.install` creates it on the host.
    Raises a UsageError (nothing rendered) on an invalid name, profile, image, GPU selection,
    path, or a profile with validation errors.
    """
    opts = options or Options()
    check_instance(instance)
    prof = get(profile) if isinstance(profile, str) else profile
    pv.require_valid(prof)
    values = env_values(prof, instance, opts)
    port = opts.port if opts.port is not None else prof.port
    if not 1 <= port <= 65535:
        raise UsageError(f"invalid port {port}", fix="use 1..65535")
    devmodel = CONTAINER_MODEL_DIR if prof.uses_devmodel else None
    base = prof.serve_args(devmodel=devmodel, port=port, speculative=False)
    context = {
        "profile": prof,
        "instance": instance,
        "container": container_name(instance),
        "labels": labels,
        "env_dir": ENV_DIR,
        "libexec_dir": LIBEXEC_DIR,
        "port": port,
        "health_host": "127.0.0.1" if prof.host in _ANY else prof.host,
        "loopback": prof.host in _LOOPBACK,
        "serve_lines": _arg_lines(base),
        "spec_args": prof.speculative_args(devmodel=devmodel),
        "per_request_args": prof.per_request_metrics_args(),
        "docker_lines": _docker_lines(prof),
        "path_keys": [k for k in values if k.endswith("_DIR")],
        "gpu": prof.hardware.device != "cpu",
        "uses_devmodel": prof.uses_devmodel,
        "values": values,
        # Go templates for `docker ... --format`: one "key=value" line per image label.
        "labels_format": '{{range $k, $v := .Config.Labels}}{{$k}}={{$v}}{{"\\n"}}{{end}}',
        "server_version_format": "{{.Server.Version}}",
        "gpus_hint": "one MIG slice per instance" if prof.hardware.mig else "default all",
        "start_timeout_s": START_TIMEOUT_S,
        "stop_grace_s": STOP_GRACE_S,
        "stop_timeout_s": STOP_TIMEOUT_S,
        "start_limit_burst": START_LIMIT_BURST,
        "start_limit_interval_s": START_LIMIT_INTERVAL_S,
    }
    env = _env()
    p = paths(instance)
    return {
        p.unit: RenderedFile(env.get_template(UNIT_TEMPLATE + ".j2").render(context), MODE_UNIT),
        p.env: RenderedFile(env.get_template("instance.env.j2").render(context), MODE_ENV),
        p.script: RenderedFile(
            env.get_template("gemma4-vllm-serve.sh.j2").render(context), MODE_SCRIPT
        ),
    }


def parse_env(text: str) -> dict[str, str]:
    """The assignments of an env file (systemd's EnvironmentFile= basics: last one wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def options_from_env(existing: Mapping[str, str], explicit: Options) -> Options:
    """``explicit`` with each unset option taken from an existing env file's value."""
    keys = {
        "image": "VLLM_IMAGE",
        "gpus": "VLLM_GPUS",
        "model_dir": "MODEL_DIR",
        "hf_cache_dir": "HF_CACHE_DIR",
        "vllm_cache_dir": "VLLM_CACHE_DIR",
    }
    merged = {
        attr: getattr(explicit, attr) if getattr(explicit, attr) is not None else existing.get(key)
        for attr, key in keys.items()
    }
    return Options(port=explicit.port, **merged)
