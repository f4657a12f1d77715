"""``appliance doctor``: check a live appliance; exit 0 only when nothing fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import doctor as lib
from ..profiles import get


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="APPLIANCE_URL",
              help="Base URL of the vLLM server.")
@click.option("--instance", default=None, help="Also check this installed unit instance.")
@click.option("--profile", "profile_name", default=None,
              help="Check the server against this profile (version, model, MTP, GPUs).")
@click.option("--root", type=click.Path(path_type=Path), default=Path("/"), show_default=True,
              help="Prefix for the instance's files (/etc/gemma4-vllm/<instance>.env, units).")
@click.option("--no-generate", is_flag=True,
              help="Do not send the one short test generation (counters then cannot move).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(url: str, instance: str | None, profile_name: str | None, root: Path,
           no_generate: bool, as_json: bool) -> None:
    """Check that the engine is reachable, is the right vLLM, and that MTP is really working.

    \b
    Example:
      appliance doctor --url http://127.0.0.1:8050 --profile l4x4-31b-mtp --instance 31b
    """
    profile = get(profile_name) if profile_name else None
    report = lib.run(url, profile=profile, instance=instance, root=root,
                     generate=not no_generate)
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.text())
    sys.exit(0 if report.ok else 1)
