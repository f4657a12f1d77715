"""The instance's settings as the unit gives them (systemd's ``EnvironmentFile=``), checked.

The env file is the operator's and may be edited by hand between two starts: every value is
checked here, by the rules ``appliance instance install`` writes them with, before any reaches
docker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ApplianceError, UsageError
from ..host import values
from ..oci import imageref
from .argsfile import ServeArgs

EX_TEMPFAIL = 75  # sysexits' EX_TEMPFAIL: the unit restarts on it (only 78 is final)


class FolderNotThere(ApplianceError):
    """A model folder the env file names is not there yet: most likely a file system mounted
    late (a network share, a `nofail` disk); systemd restarts the unit, which tries again."""

    exit_code = EX_TEMPFAIL


@dataclass(frozen=True)
class Settings:
    """The values of one instance's env file that the serve program uses."""

    image: str
    host: str
    port: int
    gpus: str | None
    model_dir: str | None
    hf_cache_dir: str | None
    vllm_cache_dir: str | None


def endpoint(env: Mapping[str, str], env_file: str) -> tuple[str, int]:
    """``VLLM_HOST`` and ``VLLM_PORT``, checked."""
    host = env.get("VLLM_HOST", "")
    if not host:
        raise UsageError(f"VLLM_HOST is not set in {env_file}")
    values.check_host(host, f"VLLM_HOST={host} in {env_file}")
    port = env.get("VLLM_PORT", "")
    if not port:
        raise UsageError(f"VLLM_PORT is not set in {env_file}")
    return host, values.check_port(port, f"VLLM_PORT={port} in {env_file}")


def settings(env: Mapping[str, str], args: ServeArgs, instance: str, env_file: str) -> Settings:
    """The checked settings; a UsageError naming the key, its value and ``env_file``."""
    image = env.get("VLLM_IMAGE", "")
    if not image:
        raise UsageError(f"VLLM_IMAGE is not set (expected in {env_file})")
    try:
        imageref.validate(image)
    except UsageError:
        raise UsageError(
            f"VLLM_IMAGE={image} in {env_file} is not a valid image reference"
        ) from None
    profile = env.get("APPLIANCE_PROFILE", "")
    if profile != args.profile:
        raise UsageError(
            f"APPLIANCE_PROFILE={profile} in {env_file}, but the args file is profile "
            f"{args.profile}",
            fix=f"appliance instance install {instance} --profile {profile or 'PROFILE'}",
        )
    host, port = endpoint(env, env_file)
    for key in args.require:
        if not env.get(key):
            raise UsageError(f"{key} is not set in {env_file}")
    for key in values.PATH_KEYS:
        if env.get(key):
            values.check_path(key, env[key], f"{key}={env[key]} in {env_file}")
    model_dir = env.get("MODEL_DIR") or None
    for key in ("MODEL_DIR", "HF_CACHE_DIR"):
        folder = env.get(key) or None
        if folder is not None and not os.path.isdir(folder):
            if (folder + "/").startswith(("/tmp/", "/var/tmp/")):
                raise UsageError(
                    f"{key}={folder} in {env_file} is not a directory (the unit has a private "
                    "/tmp and /var/tmp)",
                    fix="keep models elsewhere, e.g. /var/lib/gemma4-vllm/models",
                )
            raise FolderNotThere(
                f"{key}={folder} in {env_file} is not a directory (yet?): exit "
                f"{EX_TEMPFAIL}, systemd starts the instance again",
                fix="if it is on a file system mounted later, the unit waits for it "
                "(RequiresMountsFor=); else create it or correct the env file",
            )
    gpus = env.get("VLLM_GPUS") or None
    if gpus is not None:
        values.check_gpus(gpus, f"VLLM_GPUS={gpus} in {env_file}")
    return Settings(
        image=image,
        host=host,
        port=port,
        gpus=gpus,
        model_dir=model_dir,
        hf_cache_dir=env.get("HF_CACHE_DIR") or None,
        vllm_cache_dir=env.get("VLLM_CACHE_DIR") or None,
    )
