"""``appliance doctor``: check a live appliance; exit 0 only when nothing fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import doctor as lib
from ..profiles import get
from .options import api_key_options, resolve_key, root_option, url_option


@click.command()
@url_option
@click.option(
    "--instance",
    default=None,
    help="Also check this installed unit instance (and use its API key file).",
)
@click.option(
    "--profile",
    "profile_name",
    default=None,
    help="Check the server against this profile (version, model, MTP, GPUs).",
)
@root_option
@api_key_options
@click.option(
    "--no-generate",
    is_flag=True,
    help="Do not send the one short test generation (counters then cannot move).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(
    url: str,
    instance: str | None,
    profile_name: str | None,
    root: Path,
    api_key: str | None,
    api_key_file: Path | None,
    no_generate: bool,
    as_json: bool,
) -> None:
    """Check that the engine is reachable, is the right vLLM, and that MTP is really working.

    \b
    Example:
      appliance doctor --url http://127.0.0.1:8050 --profile l4x4-31b-mtp --instance 31b
    """
    profile = get(profile_name) if profile_name else None
    key = resolve_key(api_key, api_key_file, instance, root)
    report = lib.run(
        url, profile=profile, instance=instance, root=root, generate=not no_generate, api_key=key
    )
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.text())
    sys.exit(0 if report.ok else 1)
