"""Render an instance's files from a profile (no writing): the unit, env file, args file, script.

:func:`render` returns every file as ``{relative path: RenderedFile}``, the paths relative to
the root they are installed under, so ``appliance instance render --out DIR`` and
``appliance instance install --root DIR`` lay out the same tree:

- ``etc/systemd/system/gemma4-vllm@.service``: the one templated unit (shared);
- ``usr/local/libexec/gemma4-vllm/serve``: the one serve program (shared: :mod:`appliance.serve`
  bundled as one zip application);
- ``etc/gemma4-vllm/<instance>.env``: the operator's values (image, profile, host, port, GPUs,
  paths), read by systemd and by :mod:`appliance.units.instance`;
- ``etc/gemma4-vllm/<instance>.args``: the profile's engine and docker arguments (JSON,
  :mod:`appliance.serve.argsfile`), read by the serve program as data;
- ``etc/systemd/system/gemma4-vllm@<instance>.service.d/mounts.conf``: ``RequiresMountsFor=``
  the instance's model and cache folders (a late mount is waited for, not taken for a missing
  model).

Profile strings are data, never code: every value that reaches a file is validated first
(names, host, paths, GPU selection, image) or is an argument the serve program passes to docker
as one argument, as is (one line each, no control characters). A bad input raises a
:class:`~appliance.errors.UsageError` before anything is rendered.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ..errors import UsageError
from ..host import envfile
from ..host.layout import STATE_DIR, Layout
from ..host.names import (
    COMPILE_CACHE_DIR,
    DATA_DIR,
    ENV_DIR,
    STATE_UNIT,
    UNIT_TEMPLATE,
    Role,
    check_instance,
)
from ..host.values import PATH_KEYS, check_gpus, check_host, check_path, check_port
from ..images.choice import fallback
from ..observability.names import DEBIAN_TEXTFILE_DIR
from ..oci import imageref, labels
from ..profiles import PROFILE_NAME, Profile, get
from ..profiles import validate as pv
from ..serve import bundle
from ..serve.argsfile import CONTROL, check_argument
from .engine_args import args_text, serve_args
from .timing import DRAIN_S, STOP_GRACE_S, unit_timing

# Paths relative to the root, the keys of a rendered tree; and as the units name them.
REL = Layout(Path())
SERVE_SCRIPT = str(Layout().serve_program)
# Where `pip install` as root and the Ansible role (appliance_bin) put the appliance's command.
APPLIANCE_BIN = "/usr/local/bin/appliance"
# When no image is named and install found none on the host (appliance/images/choice.py): the
# build's latest, gemma4-vllm:latest for a GPU profile, gemma4-vllm:latest-cpu for a CPU one.
DEFAULT_IMAGE = fallback("cuda")

# Docker container names and systemd instance names both; no dots first, no slashes.
_PROFILE_NAME = re.compile(PROFILE_NAME)  # the record's own rule; also for a replaced record
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

MODE_UNIT = 0o644
MODE_ENV = 0o644  # no secret in it: the API key has its own 0600 file
MODE_ARGS = 0o644
MODE_PROGRAM = 0o755
MODE_SECRET = 0o600


@dataclass(frozen=True)
class RenderedFile:
    """One file to write: its text and its permission bits."""

    content: str | bytes
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


def rel(path: Path) -> str:
    """``path`` (of :data:`REL`) as the key of a rendered tree."""
    return path.as_posix()


def check_profile(prof: Profile) -> None:
    """Refuse a profile whose strings could mean anything but data in a rendered file."""
    if not _PROFILE_NAME.fullmatch(prof.name or ""):
        raise UsageError(
            f"invalid profile name {prof.name!r}",
            fix="use letters, digits and '._-' (at most 64), starting with a letter or digit",
        )
    if CONTROL.search(prof.description):
        raise UsageError(
            f"profile {prof.name}: the description must be one line without control characters"
        )
    check_host(prof.host, f"profile {prof.name}: host {prof.host!r}")
    check_port(prof.port, f"profile {prof.name}: port {prof.port!r}")
    for arg in prof.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in ("--host", "--port"):
            raise UsageError(
                f"profile {prof.name}: extra_args sets {flag}",
                fix="the address is the instance's: install --host/--port (VLLM_HOST/VLLM_PORT)",
            )
        if flag == "--shutdown-timeout":
            raise UsageError(
                f"profile {prof.name}: extra_args sets {flag}",
                fix=f"the unit sets it: in-flight requests get {DRAIN_S} s of its "
                f"{STOP_GRACE_S} s stop grace",
            )
    for key, value in prof.env.items():
        if not _ENV_KEY.fullmatch(key):
            raise UsageError(f"profile {prof.name}: invalid environment variable name {key!r}")
        check_argument(value, f"profile {prof.name}: env {key}")


@functools.cache
def serve_program() -> bytes:
    """The one serve program (:mod:`appliance.serve`, bundled by :mod:`appliance.serve.bundle`),
    as installed."""
    return bundle.build()


def jinja_env(package: str = "appliance.units") -> jinja2.Environment:
    """The one Jinja setup of the unit templates (``package``'s ``templates/``, then this
    package's, so every unit includes the one hardening block): strict, unescaped, newlines
    kept."""
    loaders = [jinja2.PackageLoader(package, "templates")]
    if package != "appliance.units":
        loaders.append(jinja2.PackageLoader("appliance.units", "templates"))
    return jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
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
        envfile.IMAGE_KEY: imageref.validate(opts.image or fallback(profile.hardware.device)),
        envfile.PROFILE_KEY: profile.name,
        envfile.HOST_KEY: check_host(opts.host if opts.host is not None else profile.host),
        envfile.PORT_KEY: str(check_port(port, f"port {port}")),
    }
    if profile.hardware.device != "cpu":
        if opts.gpus is None and profile.hardware.mig:
            raise UsageError(
                f"profile {profile.name} runs one instance per MIG slice: say which slice",
                fix="install on the host (it takes the next free slice nvidia-smi lists), or "
                "pass --gpus device=MIG-<uuid> (or device=GPU:MIG, e.g. device=0:1)",
            )
        values[envfile.GPUS_KEY] = check_gpus(opts.gpus or "all")
    elif opts.gpus is not None:
        raise UsageError(f"profile {profile.name} runs on the CPU: --gpus does not apply")
    if profile.uses_devmodel:
        model_dir = opts.model_dir or f"{DATA_DIR}/models/tiny"
        values[envfile.MODEL_DIR_KEY] = check_path("model dir", model_dir)
    elif opts.model_dir is not None:
        raise UsageError(
            f"profile {profile.name} serves {profile.model}: --model-dir applies to the "
            "tiny dev model profiles only",
            fix="put the weights in the Hugging Face cache (--hf-cache-dir)",
        )
    if not profile.uses_devmodel:
        values[envfile.HF_CACHE_KEY] = check_path(
            "HF cache dir", opts.hf_cache_dir or f"{DATA_DIR}/huggingface"
        )
    values[envfile.VLLM_CACHE_KEY] = check_path(
        "vLLM cache dir", opts.vllm_cache_dir or f"{COMPILE_CACHE_DIR}/{instance}"
    )
    return values


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
            fix=f"install each host's node: appliance instance install NAME --profile {prof.name} "
            "--role head|worker|both [--rank N]",
        )
    check_profile(prof)
    pv.require_valid(prof)
    values = env_values(prof, instance, opts)
    args = serve_args(prof, list(values))
    context = {
        **base_context(prof, instance, values),
        # install gives a new instance the next free device set of its kind, by UUID
        # (appliance/hostcheck/placement.py); all where it could not ask nvidia-smi.
        "gpus_hint": "one MIG slice per instance" if prof.hardware.mig else "install's own set",
    }
    env = jinja_env()
    unit = env.get_template(UNIT_TEMPLATE + ".j2").render(context)
    # In the order they are written: what the others refer to first, the unit last.
    return {
        **program(),
        rel(REL.args_file(instance)): RenderedFile(args_text(args, instance), MODE_ARGS),
        rel(REL.env_file(instance)): RenderedFile(
            env.get_template("instance.env.j2").render(context), MODE_ENV
        ),
        rel(REL.unit_template): RenderedFile(unit, MODE_UNIT),
        **mounts_dropin(instance, values),
        **state_units(),
    }


def base_context(prof: Profile, name: str, values: Mapping[str, str]) -> dict[str, object]:
    """What the unit templates of either shape read: the profile, NAME, the env file's values,
    the paths, and the unit's timings and start-limit arithmetic (one source, units.timing)."""
    return {
        "profile": prof,
        "instance": name,
        "labels": labels,
        "env_dir": ENV_DIR,
        "serve_script": SERVE_SCRIPT,
        "values": values,
        "timing": unit_timing(),
        "stop_grace_s": STOP_GRACE_S,
        "drain_s": DRAIN_S,
    }


def program() -> dict[str, RenderedFile]:
    """The one serve program every unit of either shape runs."""
    return {rel(REL.serve_program): RenderedFile(serve_program(), MODE_PROGRAM)}


def mounts_dropin(
    name: str, values: Mapping[str, str], role: Role | None = None
) -> dict[str, RenderedFile]:
    """The drop-in making ``name``'s unit (group ``name``'s node ``role``) wait for the mounts
    of the folders its env file's ``values`` name (a late mount is waited for, not taken for a
    missing model)."""
    context = {
        "instance": name,
        "env_dir": ENV_DIR,
        "mounts_dropin": Layout().mounts_dropin(name, role),
        "mounts": [values[k] for k in PATH_KEYS if k in values],
    }
    text = jinja_env().get_template("mounts.conf.j2").render(context)
    return {rel(REL.mounts_dropin(name, role)): RenderedFile(text, MODE_UNIT)}


def state_units() -> dict[str, RenderedFile]:
    """The host's state-metrics service and timer (the same for every instance)."""
    textfile = Layout(Path("/")).metrics_textfile()
    context = {
        "appliance_bin": APPLIANCE_BIN,
        "textfile": textfile,
        "textfile_dir": textfile.parent,
        "distro_textfile_dir": DEBIAN_TEXTFILE_DIR,
        "state_dir_name": STATE_DIR.relative_to("var/lib"),
    }
    env = jinja_env()
    service, timer = REL.state_units
    return {
        rel(service): RenderedFile(
            env.get_template(f"{STATE_UNIT}.service.j2").render(context), MODE_UNIT
        ),
        rel(timer): RenderedFile(
            env.get_template(f"{STATE_UNIT}.timer.j2").render(context), MODE_UNIT
        ),
    }


def options_from_env(existing: Mapping[str, str], explicit: Options) -> Options:
    """``explicit`` with each unset option taken from an existing env file's value."""
    keys = {
        "image": envfile.IMAGE_KEY,
        "gpus": envfile.GPUS_KEY,
        "host": envfile.HOST_KEY,
        "port": envfile.PORT_KEY,
        "model_dir": envfile.MODEL_DIR_KEY,
        "hf_cache_dir": envfile.HF_CACHE_KEY,
        "vllm_cache_dir": envfile.VLLM_CACHE_KEY,
    }
    merged = {
        attr: getattr(explicit, attr) if getattr(explicit, attr) is not None else existing.get(key)
        for attr, key in keys.items()
    }
    if merged["port"] is not None and not isinstance(merged["port"], int):
        merged["port"] = check_port(merged["port"], f"{envfile.PORT_KEY}={merged['port']!r}")
    return Options(**merged)
