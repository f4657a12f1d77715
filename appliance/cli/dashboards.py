"""``appliance observability``: generate the dashboards, rules and scrape config."""

from __future__ import annotations

from pathlib import Path

import click

from ..observability import generate as gen


@click.group()
def observability() -> None:
    """Grafana dashboards, Prometheus rules and alerts, generated from code."""


@observability.command()
@click.option("--check", is_flag=True, help="Verify the committed files; write nothing.")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Repository root holding grafana/ and prometheus/.")
def generate(check: bool, root: Path) -> None:
    """Write grafana/dashboards/*.json and prometheus/*.yml from appliance/observability.

    \b
    Example:
      appliance observability generate --check
    """
    if check:
        gen.check_or_raise(root)
        click.echo("observability files are up to date")
        return
    res = gen.generate(root)
    for rel in res.written:
        click.echo(f"wrote {rel}")
    if not res.written:
        click.echo("nothing to write: up to date")
    for p in res.problems:
        click.echo(f"warning: {p}", err=True)
