"""What a cutover talks to (the layout, systemd, Docker, a progress line) and the refusal
before anything is touched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ApplianceError
from ..host import reach
from ..host.layout import Layout
from ..host.systemd import Systemd

Progress = Callable[[str], None]


class PreflightError(ApplianceError):
    """The cutover was refused before anything was touched."""


@dataclass
class Context:
    """Everything a cutover talks to; the CLI builds one, tests build their own."""

    layout: Layout = field(default_factory=Layout)
    systemd: Systemd = field(default_factory=Systemd.from_env)
    docker_client: object | None = None
    progress: Progress = lambda _msg: None

    def docker(self):
        if self.docker_client is None:
            import docker

            if not reach.docker(self.layout.root):
                raise reach.refusal(self.layout.root, "Docker")

            try:
                self.docker_client = docker.from_env()
            except docker.errors.DockerException as exc:
                raise PreflightError(f"cannot reach the Docker engine: {exc}") from exc
        return self.docker_client
