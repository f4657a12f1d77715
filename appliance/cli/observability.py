"""``appliance observability``: the observability plane's files, out of the package."""

from __future__ import annotations

from pathlib import Path

import click

from ..observability import plane
from .options import OutputPath


@click.group(name="observability")
def observability() -> None:
    """The observability plane: Prometheus, Alertmanager, Grafana, OTel Collector, Jaeger."""


@observability.command(name="write")
@click.option(
    "--out",
    required=True,
    type=OutputPath(directory=True),
    help="A new or empty folder, or one this wrote before (updated: your changes are kept).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace the files you changed too (yours are kept beside them as NAME.old).",
)
def write(out: Path, force: bool) -> None:
    """Write the plane's compose file with its Prometheus and Grafana configs into --out.

    Over a plane written before, a file you changed (an Alertmanager receiver) is kept: the new
    one goes beside it as NAME.new, with the diff shown. Files you added are never touched.

    \b
    Example:
      appliance observability write --out /opt/gemma4-observability
      docker compose -f /opt/gemma4-observability/deploy/observability/compose.yaml up -d
    """
    written = plane.write(out, force=force)
    for kept in written.kept:
        click.echo(kept.diff, nl=False)
        click.echo(
            f"kept {kept.path} as you changed it; the new one is {kept.new.name} beside it "
            "(diff above): merge it, or write again with --force",
            err=True,
        )
    for old in written.saved:
        click.echo(
            f"replaced {old.with_suffix('')}, which you changed; yours is {old.name}", err=True
        )
    click.echo(f"wrote the plane: docker compose -f {written.compose} up -d")
