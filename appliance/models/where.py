"""Which profile, Hugging Face cache and token file a ``models`` command is about.

``--instance I`` reads the instance's env file (``APPLIANCE_PROFILE`` and ``HF_CACHE_DIR``, host
paths seen under ``--root``); ``--profile``/``--profile-file`` name the profile directly, with the
cache at ``--hf-cache-dir`` (taken literally) or the default the installer writes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from .. import profiles
from ..errors import UsageError
from ..host import envfile
from ..host.layout import Layout
from ..host.names import DATA_DIR
from ..profiles import DEVMODEL, Profile
from . import ModelSpec, hub_fix
from .token import DEFAULT_TOKEN_FILE

DEFAULT_HF_CACHE = f"{DATA_DIR}/huggingface"


@dataclass(frozen=True)
class Location:
    """A profile's models and where they live on this host."""

    profile: Profile
    hf_home: Path  # HF_CACHE_DIR: what the container sees as /root/.cache/huggingface
    token_file: Path
    token_file_explicit: bool
    selector: tuple[str, ...]  # how a fix command names the same models, e.g. 31b --root R

    @property
    def hub(self) -> Path:
        """The hub cache inside ``hf_home`` (huggingface_hub's ``HF_HUB_CACHE``)."""
        return self.hf_home / "hub"

    @property
    def specs(self) -> list[ModelSpec]:
        return specs(self.profile)

    def command(self, verb: str, *extra: str) -> str:
        """The ``appliance models VERB`` command line for these same models."""
        return shlex.join(["appliance", "models", verb, *self.selector, *extra])

    def fix(self) -> str:
        """What fixes a missing or broken model, on a connected host and on an air-gapped one."""
        token = ("--token-file", str(self.token_file)) if self.token_file_explicit else ()
        return hub_fix(self.selector, token)


def under_root(root: Path, host_path: str) -> Path:
    """``host_path`` (absolute on the host) as seen under ``root``."""
    p = Path(host_path)
    return root / p.relative_to("/") if p.is_absolute() else root / p


def locate(
    *,
    root: Path = Path("/"),
    profile: str | Profile | None = None,
    profile_file: Path | None = None,
    instance: str | None = None,
    hf_cache_dir: Path | None = None,
    token_file: Path | None = None,
    env: envfile.EnvFile | None = None,
) -> Location:
    """Resolve the options of a ``models`` command into a :class:`Location` (UsageError if they
    do not name exactly one profile). ``env``: the instance's env file when the caller has read
    it already (doctor); ``profile`` may be the instance's record's profile, already looked up."""
    if profile and profile_file:
        raise UsageError("give --profile or --profile-file, not both")
    selector: list[str] = []
    prof: Profile | None = None
    if isinstance(profile, Profile):
        prof = profile  # the instance's own: --instance names it in a fix command
    elif profile:
        prof = profiles.lookup(profile)  # a shipped name or the operator's file
        selector += ["--profile", profile]
    elif profile_file:
        prof = profiles.load_file(profile_file)
        selector += ["--profile-file", str(profile_file)]
    cache: Path | None = hf_cache_dir
    if instance is not None:
        if env is None:
            Layout(Path(root)).require_known(instance)  # an unknown name is bad input (exit 2)
        env = env or envfile.read(Layout(Path(root)).env_file(instance))
        if prof is None:
            name = env.get(envfile.PROFILE_KEY)
            if not name:
                raise UsageError(
                    f"{env.path} names no {envfile.PROFILE_KEY}",
                    fix=f"re-run appliance instance install {instance}, or pass --profile",
                )
            prof = profiles.installed(root, instance, name)
        if cache is None and (value := env.get(envfile.HF_CACHE_KEY)):
            cache = under_root(root, value)
        selector = [instance, *selector]
    if prof is None:
        raise UsageError("say which models", fix="pass --instance, --profile or --profile-file")
    if cache is None:
        cache = under_root(root, DEFAULT_HF_CACHE)
    elif hf_cache_dir is not None:
        selector += ["--hf-cache-dir", str(hf_cache_dir)]
    if root != Path("/"):
        selector += ["--root", str(root)]
    explicit = token_file is not None
    return Location(
        profile=prof,
        hf_home=Path(cache),
        token_file=Path(token_file) if explicit else under_root(root, DEFAULT_TOKEN_FILE),
        token_file_explicit=explicit,
        selector=tuple(selector),
    )


def specs(profile: Profile) -> list[ModelSpec]:
    """The target and (with speculative decoding) the drafter ``profile`` serves, from the hub."""
    if profile.uses_devmodel:
        raise UsageError(
            f"profile {profile.name} serves the tiny dev models from MODEL_DIR, not the hub",
            fix="build them with: appliance dev devmodel DIR",
        )
    out = [ModelSpec("target", profile.model, profile.revision)]
    spec = profile.speculative
    if spec is not None and spec.model:
        out.append(ModelSpec("drafter", spec.model, spec.revision))
    return out


def dir_specs(profile: Profile) -> list[ModelSpec]:
    """A tiny dev model profile's target and drafter: ``repo_id`` is the directory inside
    ``MODEL_DIR`` (``target``, ``drafter``)."""
    prefix = DEVMODEL + "/"
    out = []
    for role, model in (
        ("target", profile.model),
        ("drafter", profile.speculative.model if profile.speculative else None),
    ):
        if model:
            if not model.startswith(prefix):
                raise UsageError(f"profile {profile.name}: {role} {model!r} is not in MODEL_DIR")
            out.append(ModelSpec(role, model[len(prefix) :]))
    return out
