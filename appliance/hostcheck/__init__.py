"""``appliance host check``: is this host ready for an instance of a profile? Read-only.

One finding per question, each ``ok`` / ``warn`` / ``blocker`` with one line and its fix
(:mod:`.findings`); one module per job: :mod:`.nvidia` (driver, GPUs; doctor's GPU check too),
:mod:`.docker` (engine, GPU access, data root), :mod:`.disk` (weights), :mod:`.ports`,
:mod:`.system` (systemd, user, the API key file). :func:`run` asks them all about a
:class:`Target`: what ``appliance install`` would install (:func:`target`), which is also what
install checks before it writes anything.

    report = hostcheck.run(hostcheck.for_profile(profiles.get("l4x4-31b-mtp")))
    report.ok, report.text()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..host.names import DATA_DIR
from ..models.where import under_root
from ..profiles import Profile
from .disk import weights_finding
from .docker import docker_findings
from .findings import Finding, Report, Status
from .nvidia import gpu_findings
from .ports import port_finding
from .system import api_key_finding, systemd_finding, user_finding

__all__ = ["Finding", "Report", "Status", "Target", "for_profile", "run", "target"]

DEFAULT_IMAGE = "gemma4-vllm:latest"  # units.template.DEFAULT_IMAGE (units imports this side)


@dataclass(frozen=True)
class Target:
    """What the checks are about: a profile, where its instance binds, its cache and image;
    ``instance`` and ``api_key`` when it is (or is being) installed; ``own_port`` when the
    port is the installed instance's own (busy while it runs)."""

    profile: Profile
    host: str
    port: int
    hf_home: Path
    image: str
    root: Path = Path("/")
    instance: str | None = None
    api_key: Path | None = None
    own_port: bool = False


def for_profile(profile: Profile, root: Path = Path("/")) -> Target:
    """A profile with install's defaults: its host and port, the default cache and image."""
    return Target(
        profile=profile,
        host=profile.host,
        port=profile.port,
        hf_home=under_root(root, f"{DATA_DIR}/huggingface"),
        image=DEFAULT_IMAGE,
        root=root,
    )


def target(
    profile: Profile,
    values: Mapping[str, str],
    *,
    root: Path = Path("/"),
    instance: str | None = None,
    api_key: Path | None = None,
    kept_port: str | None = None,
) -> Target:
    """The instance an env file's ``values`` describe (``units.template.env_values``: what
    install writes). ``kept_port``: the port the installed env file had, if any."""
    return Target(
        profile=profile,
        host=values["VLLM_HOST"],
        port=int(values["VLLM_PORT"]),
        hf_home=under_root(root, values.get("HF_CACHE_DIR") or f"{DATA_DIR}/huggingface"),
        image=values["VLLM_IMAGE"],
        root=root,
        instance=instance,
        api_key=api_key,
        own_port=kept_port == values["VLLM_PORT"],
    )


def run(t: Target, *, docker_client=None, gpu_query=None) -> Report:
    """Every check that applies to ``t`` (never raises for a failed one). The user and systemd
    are this host's only when ``t.root`` is ``/`` (another root is a tree being built)."""
    findings: list[Finding] = []
    if t.root == Path("/"):
        findings.append(user_finding())
        findings.append(systemd_finding())
    findings += gpu_findings(t.profile, gpu_query)
    findings += docker_findings(t.profile, t.image, docker_client)
    findings.append(weights_finding(t.profile, t.hf_home))
    findings.append(port_finding(t.host, t.port, own=t.own_port))
    if t.api_key is not None:
        findings.append(api_key_finding(t.api_key))
    return Report(t.profile.name, t.instance, tuple(findings))
