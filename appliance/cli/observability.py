"""``appliance observability``: the observability plane's files, out of the package."""

from __future__ import annotations

from pathlib import Path

import click

from ..observability import plane


@click.group(name="observability")
def observability() -> None:
    """The observability plane: Prometheus, Alertmanager, Grafana, OTel Collector, Jaeger."""


@observability.command(name="write")
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="A new or empty folder (or one this wrote before, which is replaced).",
)
def write(out: Path) -> None:
    """Write the plane's compose file with its Prometheus and Grafana configs into --out.

    \b
    Example:
      appliance observability write --out /opt/gemma4-observability
      docker compose -f /opt/gemma4-observability/deploy/observability/compose.yaml up -d
    """
    compose = plane.write(out)
    click.echo(f"wrote the plane: docker compose -f {compose} up -d")
