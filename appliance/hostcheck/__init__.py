"""``appliance host check``: is this host ready for an instance of a profile? Read-only.

One finding per question, each ``ok`` / ``warn`` / ``blocker`` with one line and its fix
(:mod:`.findings`); one module per job: :mod:`.nvidia` (driver, GPUs; doctor's GPU check too),
:mod:`.docker` (engine, GPU access, data root), :mod:`.disk` (weights), :mod:`.ports`,
:mod:`.system` (systemd, user, the API key file). :func:`run` asks them all about a
:class:`Target`: what ``appliance instance install`` would install (:func:`target`), which is
also what install checks before it writes anything.

    report = hostcheck.run(hostcheck.for_profile(profiles.get("l4x4-31b-mtp")))
    report.ok, report.text()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from .. import images
from ..errors import ApplianceError, UsageError
from ..host import cdi, envfile, reach
from ..host.layout import Layout
from ..host.names import DATA_DIR
from ..images import choice
from ..models.where import under_root
from ..profiles import Profile, lookup
from ..profiles.catalog import MIN_DRIVER
from ..units import Options, Planned, planned
from . import docker, placement
from .disk import weights_finding
from .docker import build_unchecked, docker_findings, engine_finding
from .findings import Finding, Report, Status
from .nvidia import Query, given, gpu_findings, host_findings, query
from .ports import port_finding
from .system import (
    api_key_finding,
    node_exporter_finding,
    python_finding,
    systemd_finding,
    user_finding,
)

__all__ = [
    "Finding",
    "HostNotReady",
    "Report",
    "Status",
    "Target",
    "check",
    "check_suggested",
    "for_profile",
    "gate",
    "host_only",
    "run",
    "suggested",
    "target",
]


class HostNotReady(ApplianceError):
    """``appliance instance install`` refused: the host check found blockers (one line, the
    first)."""

    def __init__(self, report: Report, command: str) -> None:
        first = report.blockers[0]
        more = len(report.blockers) - 1
        super().__init__(
            f"host not ready for profile {report.profile}: {first.name}: {first.message}"
            + (f" (and {more} more blocker(s))" if more else ""),
            fix=f"`{command}` lists each with its fix; or install with --force REASON",
        )
        self.report = report


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
    gpus: str | None = None  # the env file's VLLM_GPUS: the devices it is given
    serves: bool = True  # False: only a group's worker runs here, and it binds no API port


def for_profile(profile: Profile, root: Path = Path("/"), image: str | None = None) -> Target:
    """A profile with install's defaults: its host and port, the default cache, and ``image``
    (default: the build's ``latest``, what install falls back to)."""
    return Target(
        profile=profile,
        host=profile.host,
        port=profile.port,
        hf_home=under_root(root, f"{DATA_DIR}/huggingface"),
        image=image or choice.fallback(profile.hardware.device),
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
        host=values[envfile.HOST_KEY],
        port=int(values[envfile.PORT_KEY]),
        hf_home=under_root(root, values.get(envfile.HF_CACHE_KEY) or f"{DATA_DIR}/huggingface"),
        image=values[envfile.IMAGE_KEY],
        root=root,
        instance=instance,
        api_key=api_key,
        own_port=kept_port == values[envfile.PORT_KEY],
        gpus=values.get(envfile.GPUS_KEY),
    )


def run(t: Target, *, docker_client=None, gpu_query=None, told: bool = False) -> Report:
    """Every check that applies to ``t`` (never raises for a failed one). The user and systemd
    are this host's only when ``t.root`` is ``/`` (another root is a tree being built). Under
    another root this host's GPUs, port and Docker are the tree's only where it names its own
    (host/reach.py) or ``told`` (``install --host-check``): else each is one "not asked"
    finding, never ready."""
    findings = _this_host(t.root)
    cpu = t.profile.hardware.device != "cuda"  # asks nothing of the GPUs
    asks_docker = docker_client is not None or told or reach.docker(t.root)
    engine = docker.connect(docker_client) if asks_docker else None
    if cpu or gpu_query is not None or told or reach.gpus(t.root):
        findings += _gpus(t, gpu_query, engine)
    else:
        findings.append(not_asked("gpu", t.root, reach.GPUS_NOT))
    if engine is not None:
        findings += docker_findings(t.profile, t.image, root=t.root, engine=engine)
    else:
        findings.append(not_asked("docker.engine", t.root, reach.DOCKER_NOT))
        findings.append(build_unchecked(t.image, "Docker was not asked"))
    findings.append(weights_finding(t.profile, t.hf_home))
    if not t.serves:
        findings.append(Finding("port", "ok", "a group's worker binds no API port here"))
    elif told or reach.ports(t.root):
        findings.append(port_finding(t.host, t.port, own=t.own_port))
    else:
        port = f"{t.host}:{t.port} on this host is not the tree's"
        findings.append(not_asked("port", t.root, port))
    if t.api_key is not None:
        findings.append(api_key_finding(t.api_key))
    return Report(t.profile.name, t.instance, tuple(findings))


def not_asked(name: str, root: Path, clause: str) -> Finding:
    """A finding a tree's check could not make without asking this host (never ``ok``)."""
    return Finding(
        name, "warn", reach.why_not(root, clause), "run `appliance host check` on the host itself"
    )


def _gpus(t: Target, q: Query | None, engine: docker.Engine | None = None) -> list[Finding]:
    # The devices the instance is given (its env file's device set), else those it would get:
    # the next free of its kind past the other instances' (appliance/hostcheck/placement.py);
    # and how they go to Docker: the tree's CDI specs, in the folders Docker reads where it
    # answered, and whether its CDI is on (None: not asked, the spec decides).
    if t.profile.hardware.device != "cuda":
        return gpu_findings(t.profile, q)
    q = q if q is not None else query()
    if q.error is not None:
        return gpu_findings(t.profile, q)
    docker_cdi = engine.cdi if engine is not None else None
    dirs = docker.cdi_dirs(engine.info) if docker_cdi else cdi.DIRS
    way = {"specs": cdi.read(t.root, dirs), "docker_cdi": docker_cdi}
    devices = given(q, t.gpus) if t.gpus else None
    if devices is not None:
        return gpu_findings(t.profile, q, devices=devices, **way)
    held = set(placement.claimed(t.root, t.instance, q))
    if placement.EVERY in held:  # another instance is given all of them
        held = {a for d in q.devices for a in d.aliases}
    return gpu_findings(t.profile, q, taken=frozenset(held), **way)


def _this_host(root: Path) -> list[Finding]:
    # What the README asks of the host itself; another root is a tree being built.
    if root != Path("/"):
        return []
    return [user_finding(), systemd_finding(), python_finding(), node_exporter_finding()]


def host_only(why: str, root: Path = Path("/"), *, docker_client=None, gpu_query=None) -> Report:
    """``appliance host check`` with no profile to judge (``why``: none was given and none
    suggested): the host itself, the driver and GPUs, Docker. Exit 1 on a blocker as ever."""
    findings = _this_host(root)
    if gpu_query is not None or reach.gpus(root):
        findings += host_findings(gpu_query, MIN_DRIVER)
    else:
        findings.append(not_asked("gpu", root, reach.GPUS_NOT))
    if docker_client is not None or reach.docker(root):
        findings.append(engine_finding(docker_client))
    else:
        findings.append(not_asked("docker.engine", root, reach.DOCKER_NOT))
    findings.append(
        Finding("profile", "warn", why, "give one: --profile NAME (appliance profiles list)")
    )
    return Report(None, None, tuple(findings))


def for_install(plan: Planned) -> Target:
    """What an install of either shape is about to install (its key file is checked when NAME
    is installed already: install creates a missing one and tightens its mode; a host that runs
    only a group's worker binds no API port)."""
    key = plan.key_files[0] if plan.existing else None  # the one guarding the API
    t = target(
        plan.profile,
        plan.env_values(),
        root=plan.root,
        instance=plan.instance,
        api_key=key,
        kept_port=plan.existing.get(envfile.PORT_KEY),
    )
    return replace(t, serves=plan.shape.answers)


def check(
    profile: str | None,
    instance: str | None = None,
    *,
    root: Path = Path("/"),
    options: Options | None = None,
    docker_client=None,
) -> Report:
    """``appliance host check``: instance ``instance`` as ``appliance instance install`` would
    install it (installed or not; ``profile`` None: the one its env file names), or without an
    instance the profile ``profile`` (a shipped name or the operator's file) with install's
    defaults and ``options``."""
    o = options or Options()
    client = docker_client or images.reachable(root)
    if instance is not None:
        env_path = Layout(root).env_file(instance)
        if profile is None and not env_path.exists():  # nothing says which profile NAME runs
            raise envfile.unknown_instance(
                instance, env_path, alternative="name the profile to install: --profile P"
            )
        plan = planned(profile, instance, root=root, options=options)
        if o.image is None and not plan.existing.get(envfile.IMAGE_KEY):
            chosen = _default(client, plan.profile)
            plan = replace(plan, options=replace(plan.options, image=chosen))
        return run(for_install(plan), docker_client=client)
    if profile is None:
        raise UsageError(
            "say which instance or profile", fix="appliance host check NAME, or --profile P"
        )
    prof = lookup(profile)
    t = for_profile(prof, root, o.image or _default(client, prof))
    t = Target(
        profile=t.profile,
        host=o.host or t.host,
        port=o.port or t.port,
        hf_home=under_root(root, o.hf_cache_dir) if o.hf_cache_dir else t.hf_home,
        image=t.image,
        root=root,
    )
    return run(t, docker_client=client)


def check_suggested(
    root: Path = Path("/"), options: Options | None = None, *, docker_client=None
) -> tuple[Report, str | None]:
    """``appliance host check`` with neither instance nor profile: the check of the profile
    ``appliance profiles suggest`` puts first, and the line saying it was taken; where none can
    be suggested (no driver, no GPU, nothing fits) the host alone (:func:`host_only`), None."""
    from . import suggest

    if not reach.gpus(root):
        why = "no profile suggested: " + reach.why_not(root, reach.GPUS_NOT)
        return host_only(why, root, docker_client=docker_client), None
    try:
        name, said = suggest.best()
    except UsageError as exc:
        return host_only(exc.message, root, docker_client=docker_client), None
    return check(name, None, root=root, options=options, docker_client=docker_client), said


def _default(client, profile: Profile) -> str:
    """The image install would give a new instance of ``profile`` (appliance/images/choice.py)."""
    return choice.default_image(client, profile.hardware.device, profile.mtp, profile.name).ref


def suggested(need: str, fix: str) -> tuple[str, str]:
    """The profile ``appliance profiles suggest`` puts first for this host's GPUs, and the line
    that says it was taken; without a GPU or a fitting profile a UsageError: ``need`` (what the
    command lacks), why none was suggested, and ``fix``."""
    from . import suggest

    try:
        return suggest.best()
    except UsageError as exc:
        raise UsageError(f"{need}: {exc.message}", fix=fix) from None


def gate(plan: Planned, *, force: str | None, command: str) -> Report:
    """The host check ``appliance instance install`` makes before writing: HostNotReady on a
    blocker unless ``force`` (the operator's reason) is given; the report either way."""
    if force is not None and not force.strip():
        raise UsageError("--force needs a reason", fix='--force "why this host is fine"')
    report = run(for_install(plan), told=True)  # --host-check: this host is asked
    if report.blockers and force is None:
        raise HostNotReady(report, command)
    return report
