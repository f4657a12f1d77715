"""``appliance dev demo``: the main job on a fresh machine."""

from __future__ import annotations

from pathlib import Path

import click

from .. import reports
from ..dev import demo as demo_lib
from ..engine import local as engine
from .local import progress_printer
from .options import OutputPath
from .output import echo_json


@click.command()
@click.option("--calls", type=click.IntRange(1, 100), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1, 400), default=64, show_default=True)
@click.option("--role", default="demo", show_default=True, help="The agent role of the calls.")
@click.option("json_", "--json", is_flag=True, help="Print the records as JSON.")
@click.option(
    "--report",
    "report_html",
    type=OutputPath(),
    default=None,
    help="Also write a self-contained HTML page of the calls (charts inline).",
)
def demo(calls: int, max_tokens: int, role: str, json_: bool, report_html: Path | None) -> None:
    """Start the real CPU engine (cpu-tiny-mtp, copy drafter), send CALLS chat completions
    through the telemetry agent, print per-call MTP figures, stop the engine.

    Spans go over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    with engine.serve("cpu-tiny-mtp", progress=progress_printer("cpu-tiny-mtp")) as eng:
        report = demo_lib.run(eng.url, calls=calls, max_tokens=max_tokens, role=role)
    if report_html:  # the same record --json prints
        reports.write(report_html, reports.render_demo(report.to_dict()))
    if json_:
        echo_json(report.to_dict())
    else:
        click.echo(demo_lib.format_table(report))
