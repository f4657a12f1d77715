"""``appliance instance doctor``: check a live appliance; exit 0 only when nothing fails."""

from __future__ import annotations

import sys

import click

from .. import doctor as lib
from .. import progress
from ..instance.endpoint import Endpoint
from .options import endpoint_options
from .output import echo_json


@click.command()
@endpoint_options(
    profile_help="Check the server against this profile (version, model, MTP, GPUs).",
    reports_not_asked=True,
)
@click.option(
    "--no-generate",
    is_flag=True,
    help="Do not send the one short test generation (counters then cannot move).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(endpoint: Endpoint, no_generate: bool, as_json: bool) -> None:
    """Check that the engine is reachable, is the right vLLM, and that MTP is really working.

    NAME: an installed instance; its unit, env file and container are checked too, and its URL,
    profile and API key are used unless given.

    \b
    Examples:
      appliance instance doctor 31b
      appliance instance doctor --url http://127.0.0.1:8000 --profile cpu-tiny-mtp
    """
    report = lib.run(
        endpoint.url,
        profile=endpoint.profile,
        instance=endpoint.instance,
        root=endpoint.root,
        generate=not no_generate,
        api_key=endpoint.api_key,
        ask_engine=endpoint.reachable,
    )
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(report.text(evidence=progress.verbosity() >= progress.VERBOSE))
    sys.exit(0 if report.ok else 1)
