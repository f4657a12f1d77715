"""``appliance dev generate``: every committed generated file, written or checked in one shape."""

from __future__ import annotations

from pathlib import Path

import click

from ..dev import generate as gen


@click.command()
@click.option("--check", is_flag=True, help="Verify the committed files; write nothing.")
@click.option(
    "--repo",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=Path("."),
    show_default=True,
    help="The repository checkout holding grafana/, prometheus/ and systemd/.",
)
def generate(check: bool, repo: Path) -> None:
    """Regenerate the dashboards, rules, scrape config and the example unit, env and args files.

    Fails (exit 1, with the command that fixes it) on a stale, missing or stray file; with
    --check it writes nothing.

    \b
    Examples:
      appliance dev generate          # after editing appliance/observability or a profile
      appliance dev generate --check  # CI: fails on drift or hand edits
    """
    if check:
        gen.require_current(repo)
        click.echo("generated files are up to date")
        return
    result = gen.generate(repo)
    for rel in result.written:
        click.echo(f"wrote {rel}")
    if result.problems:
        raise gen.StaleError("; ".join(result.problems), fix="fix the files named, then re-run")
    if not result.written:
        click.echo("nothing to write: up to date")
