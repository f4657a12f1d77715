"""What the host says about an installed instance: its unit, env file, record and container.

Built on the instance record (:mod:`appliance.units.instance`): the env file is read once, by
the one env-file parser, and the strict record is built from those same bytes with
:func:`~appliance.units.instance.from_env`. Unlike :func:`~appliance.units.instance.read`, this
never raises for the host's state: a missing unit or env file, an env file the parser refuses or
one too incomplete for a record, a missing container or a Docker that cannot be asked are facts
for doctor to report (and bench to record), each in its own field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError
from ..host import envfile, reach
from ..host.layout import UNIT_DIR, Layout
from ..units.instance import Instance, from_env

# Where a unit template may be installed: the appliance's own place first, then the vendor ones.
UNIT_DIRS = (UNIT_DIR, Path("usr/lib/systemd/system"), Path("lib/systemd/system"))


@dataclass
class InstanceFacts:
    """What the host says about an installed instance; ``None`` fields were not found.

    ``env``: the env file as read (None when there is none or it breaks the one env-file rule:
    ``env_error``). ``record``: the instance record built from it (None when ``env`` lacks what
    the record needs: ``record_error``).
    """

    unit: str = ""  # the unit that serves it here (a group's head where this host runs it)
    unit_template: str = ""  # its templated unit file's name
    container: str = ""  # that unit's container
    unit_path: Path | None = None
    env_path: Path | None = None
    env: envfile.EnvFile | None = None
    env_error: str | None = None
    record: Instance | None = None
    record_error: str | None = None
    docker_error: str | None = None
    container_status: str | None = None
    container_image: str | None = None  # the reference the container was started from
    container_image_id: str | None = None
    image_labels: dict | None = None

    @property
    def env_image(self) -> str | None:
        """``VLLM_IMAGE`` in the env file (None when unset or unreadable)."""
        return self.env.get(envfile.IMAGE_KEY) or None if self.env else None


def read(instance: str, root: Path = Path("/"), docker_client=None) -> InstanceFacts:
    """Read the unit, env file, record and container of ``instance`` (read-only, never raises
    for the host's state: a Docker that cannot be asked is ``docker_error``)."""
    layout = Layout(Path(root))
    root = layout.root
    env_path = layout.env_file(instance)  # validates the name before any path is built
    shape = layout.shape(instance)
    # A group's head where this host runs it (it serves the API), else its worker.
    template = shape.templates[0]
    facts = InstanceFacts(unit=shape.unit, unit_template=template, container=shape.container)
    for d in UNIT_DIRS:
        if (root / d / template).is_file():
            facts.unit_path = root / d / template
            break
    if env_path.is_file():
        facts.env_path = env_path
        try:
            facts.env = envfile.read(env_path)  # parsed: a file outside the rule is env_error
        except (OSError, ApplianceError) as exc:
            facts.env, facts.env_error = None, str(exc)
        if facts.env is not None:
            try:
                facts.record = from_env(root, instance, facts.env)
            except ApplianceError as exc:
                facts.record_error = str(exc)
    if docker_client is None and not reach.docker(root):
        facts.docker_error = reach.why_not(root, reach.DOCKER_NOT)
        return facts
    _container_facts(facts, shape.container, docker_client)
    return facts


def _container_facts(facts: InstanceFacts, container: str, docker_client) -> None:
    try:
        import docker  # imported here: a check without an instance must not need Docker

        client = docker_client or docker.from_env(timeout=5)
        try:
            ctr = client.containers.get(container)
        except docker.errors.NotFound:
            return
        facts.container_status = ctr.status
        facts.container_image = ctr.attrs.get("Config", {}).get("Image")
        facts.container_image_id = ctr.attrs.get("Image")
        facts.image_labels = dict(ctr.attrs.get("Config", {}).get("Labels") or {})
        try:
            img = client.images.get(facts.container_image_id)
            facts.image_labels = {**(img.labels or {}), **facts.image_labels}
        except docker.errors.DockerException:
            pass
    except Exception as exc:  # noqa: BLE001 - docker missing, daemon down, permission: report, never crash
        facts.docker_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
