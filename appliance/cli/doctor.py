"""``appliance doctor``: check a live appliance; exit 0 only when nothing fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import doctor as lib
from ..errors import UsageError
from ..profiles import get
from .options import root_option


def api_key_options(f):
    """``--api-key`` (or ``VLLM_API_KEY``) and ``--api-key-file``: shared with bench."""
    f = click.option("--api-key-file", type=click.Path(path_type=Path, dir_okay=False),
                     default=None, help="File holding the API key vLLM requires on /v1 "
                     "(an installed instance's is /etc/gemma4-vllm/<instance>.api-key).")(f)
    # The key itself: never echoed, never shown as a default in --help.
    return click.option("--api-key", default=None, envvar="VLLM_API_KEY", show_envvar=True,
                        show_default=False, metavar="KEY",
                        help="The API key itself (prefer --api-key-file: a command line is "
                        "visible to other users).")(f)


def resolve_key(api_key: str | None, api_key_file: Path | None, instance: str | None,
                root: Path) -> lib.ApiKey | None:
    """The key the options name; a key from the environment gives way to --api-key-file."""
    ctx = click.get_current_context()
    if api_key and api_key_file and \
            ctx.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE:
        raise UsageError("give --api-key or --api-key-file, not both")
    return lib.resolve_api_key(api_key, api_key_file, instance, root)


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="APPLIANCE_URL",
              help="Base URL of the vLLM server.")
@click.option("--instance", default=None,
              help="Also check this installed unit instance (and use its API key file).")
@click.option("--profile", "profile_name", default=None,
              help="Check the server against this profile (version, model, MTP, GPUs).")
@root_option
@api_key_options
@click.option("--no-generate", is_flag=True,
              help="Do not send the one short test generation (counters then cannot move).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(url: str, instance: str | None, profile_name: str | None, root: Path,
           api_key: str | None, api_key_file: Path | None, no_generate: bool,
           as_json: bool) -> None:
    """Check that the engine is reachable, is the right vLLM, and that MTP is really working.

    \b
    Example:
      appliance doctor --url http://127.0.0.1:8050 --profile l4x4-31b-mtp --instance 31b
    """
    profile = get(profile_name) if profile_name else None
    key = resolve_key(api_key, api_key_file, instance, root)
    report = lib.run(url, profile=profile, instance=instance, root=root,
                     generate=not no_generate, api_key=key)
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.text())
    sys.exit(0 if report.ok else 1)
