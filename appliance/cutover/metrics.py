"""Cutovers as Prometheus state metrics: the textfile node_exporter's textfile collector reads.

Rebuilt from scratch after every cutover or rollback from the env files (the image each instance
runs) and the histories (event counts, last time): counters derived from an append-only history
never go backwards, and a lost textfile is rebuilt exactly by the next cutover. The last
cutover that ran the output canary gives the canary's series; the acceptance baseline kept in
the state directory gives the baseline's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..canary import baseline as baselines
from ..errors import ApplianceError
from ..host import envfile, reach
from ..host.layout import Layout
from ..observability import state_metrics
from ..oci import labels
from . import history


def states(layout: Layout, docker_client=None, systemd=None) -> list[state_metrics.InstanceState]:
    """One :class:`state_metrics.InstanceState` per installed instance; with ``systemd`` (an
    :class:`appliance.host.systemd.Systemd`) each carries its unit's state, so a unit that
    gave up at its start limit reaches the alert."""

    out = []
    for instance in layout.installed():
        try:
            env = envfile.read(layout.env_file(instance))
            image, env_error = env.get(envfile.IMAGE_KEY) or "", None
            gpus = env.get(envfile.GPUS_KEY) or ""
        except ApplianceError as exc:  # marked in its own series; the others are written
            image, env_error, gpus = "", str(exc), ""
        found: dict[str, str] = {}
        if docker_client is not None and image:
            import docker

            try:
                found = dict(docker_client.images.get(image).labels or {})
            except docker.errors.DockerException:
                found = {}  # a missing image still has a state: its version is unknown
        done = [
            e
            for e in history.entries(layout.history_file(instance), strict=False)
            if e.outcome in state_metrics.OUTCOMES
        ]
        ran = [e for e in done if e.canary]
        last_canary = (
            state_metrics.CanaryState.from_figures(
                ran[-1].finished or ran[-1].started, ran[-1].canary
            )
            if ran
            else None
        )
        out.append(
            state_metrics.InstanceState(
                instance=instance,
                image=image,
                vllm_version=labels.vllm_version(found) or "unknown",
                mtp=labels.supports_mtp(found),
                events=Counter((e.kind, e.outcome) for e in done),
                last_cutover=max((e.finished or e.started for e in done), default=None),
                canary=last_canary,
                unit=_unit(layout, instance, systemd) if systemd is not None else None,
                baseline=_baseline(layout, instance),
                env_error=env_error,
                gpus=gpus,
            )
        )
    return out


def _unit(layout: Layout, name: str, systemd) -> state_metrics.UnitStatus:
    """The state of the unit that serves ``name`` here: an instance's unit, or a group's head
    and worker units with a failed one first (either one down is the group down)."""
    found = [state_metrics.unit_status(systemd, u) for u in layout.shape(name).units]
    return next((u for u in found if u.active == "failed"), found[0])


def _baseline(layout: Layout, instance: str) -> state_metrics.BaselineState | None:
    """The instance's acceptance baseline; None when there is none or its file is broken
    (`appliance status` says why, and the next cutover refuses it: the textfile still goes out)."""
    try:
        kept = baselines.load(layout.canary_baseline(instance))
    except ApplianceError:
        return None
    if kept is None:
        return None
    return state_metrics.BaselineState(kept.acceptance, kept.tokens_per_step)


def write(layout: Layout, docker_client=None, systemd=None) -> Path:
    """Write the state textfile for every instance under ``layout`` (see :func:`states`)."""
    return write_states(layout, states(layout, docker_client, systemd))


def write_states(layout: Layout, found: list[state_metrics.InstanceState]) -> Path:
    """Write ``found`` (from :func:`states`) as ``layout``'s state textfile."""
    return state_metrics.write_textfile(layout.metrics_textfile(), found, top=layout.state_dir)


def refresh(layout: Layout, systemd=None) -> Path | None:
    """Rewrite the state textfile if there is one, e.g. after an uninstall: the removed
    instance's series go (Prometheus would show it serving on). None when there is none."""
    if not layout.metrics_textfile().exists():
        return None
    return write(layout, local_docker(layout.root), systemd)


def local_docker(root: Path = Path("/")):
    """The Docker client of the tree under ``root``, or None when it has none a command may ask
    (host/reach.py) or the engine cannot be reached (labels then read unknown)."""
    import docker

    if not reach.docker(root):
        return None
    try:
        return docker.from_env()
    except docker.errors.DockerException:
        return None
