"""What the host says about an installed instance: its unit, env file and container (read-only).

Doctor checks these facts and bench records the running image's labels. Unlike the instance
record (``appliance.units.instance``: profile, host, port, image, which raises on an incomplete
env file), this never raises for the host's state: a missing unit, env file or container, or a
Docker that cannot be asked, is a fact for doctor to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cutover import envfile
from .cutover.paths import Layout
from .errors import UsageError
from .units import UNIT_TEMPLATE, container_name
from .units.template import UNIT_DIR

# Where a unit template may be installed: the appliance's own place first, then the vendor ones.
UNIT_DIRS = (
    Path(UNIT_DIR).relative_to("/"),
    Path("usr/lib/systemd/system"),
    Path("lib/systemd/system"),
)


@dataclass
class InstanceFacts:
    """What the host says about an installed instance; ``None`` fields were not found."""

    unit_path: Path | None = None
    env_path: Path | None = None
    env_image: str | None = None
    env_error: str | None = None  # the env file breaks the one env-file rule
    docker_error: str | None = None
    container_status: str | None = None
    container_image: str | None = None  # the reference the container was started from
    container_image_id: str | None = None
    image_labels: dict | None = None


def read(instance: str, root: Path = Path("/"), docker_client=None) -> InstanceFacts:
    """Read the unit, env file and container of ``instance`` (read-only, never raises for the
    host's state: a Docker that cannot be asked is ``docker_error``)."""
    env = Layout(root).env_file(instance)  # validates the name before any path is built
    facts = InstanceFacts()
    for d in UNIT_DIRS:
        if (root / d / UNIT_TEMPLATE).is_file():
            facts.unit_path = root / d / UNIT_TEMPLATE
            break
    if env.is_file():
        facts.env_path = env
        try:
            facts.env_image = envfile.parse(env.read_bytes(), str(env)).get(envfile.IMAGE_KEY)
        except (OSError, UsageError) as exc:
            facts.env_error = str(exc)
    try:
        import docker  # imported here: a check without an instance must not need Docker

        client = docker_client or docker.from_env(timeout=5)
        try:
            ctr = client.containers.get(container_name(instance))
        except docker.errors.NotFound:
            return facts
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
    return facts
