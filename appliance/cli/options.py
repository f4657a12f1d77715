"""Options shared by several command groups."""

from __future__ import annotations

from pathlib import Path

import click

from .. import apikey
from ..errors import UsageError

# One meaning everywhere: where the host's /etc and /var/lib are (an image being built, a test
# tree, or an nspawn machine's root seen from the host).
root_option = click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    envvar="APPLIANCE_ROOT",
    help="Prefix of the host's /etc and /var/lib (an image being built, a test tree).",
)


def api_key_options(f):
    """``--api-key`` (or ``VLLM_API_KEY``) and ``--api-key-file``: doctor's and bench's."""
    f = click.option(
        "--api-key-file",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="File holding the API key vLLM requires on /v1 "
        "(an installed instance's is /etc/gemma4-vllm/<instance>.api-key).",
    )(f)
    # The key itself: never echoed, never shown as a default in --help.
    return click.option(
        "--api-key",
        default=None,
        envvar="VLLM_API_KEY",
        show_envvar=True,
        show_default=False,
        metavar="KEY",
        help="The API key itself (prefer --api-key-file: a command line is "
        "visible to other users).",
    )(f)


def resolve_key(
    api_key: str | None, api_key_file: Path | None, instance: str | None, root: Path
) -> apikey.ApiKey | None:
    """The key the options name; a key from the environment gives way to --api-key-file."""
    ctx = click.get_current_context()
    if (
        api_key
        and api_key_file
        and ctx.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE
    ):
        raise UsageError("give --api-key or --api-key-file, not both")
    return apikey.resolve(api_key, api_key_file, instance, root)


# The engine to talk to: doctor's, canary's.
url_option = click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    envvar="APPLIANCE_URL",
    help="Base URL of the vLLM server.",
)
