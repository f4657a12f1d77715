"""The ``appliance`` command. Commands parse options and call library functions; nothing else.

User-facing errors are :class:`appliance.errors.ApplianceError`; they print as one line and exit
with the error's code. An OSError (a path that cannot be written, a full disk, a folder where a
file goes) is the host's answer, not a bug: one line naming the path, exit 1. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import importlib
import sys

import click

from .. import __version__, progress
from ..errors import ApplianceError, UsageError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# Each top-level command and the module that defines it, imported only when the command runs:
# importing every command's dependencies (the OpenAI SDK, pandas, jinja2, ...) made each
# `appliance status` take 3 s to start on a 2-core host, most of it for commands not run. The
# shown ones are the noun groups and the four verbs an operator types at 3 a.m.
COMMANDS = {
    "bench": ("bench", "bench"),
    "canary": ("canary", "canary"),
    "cutover": ("cutover", "cutover"),
    "dev": ("dev", "dev"),
    "fleet": ("fleet", "fleet"),
    "history": ("cutover", "history_"),
    "host": ("hostcheck", "host"),
    "image": ("images", "image"),
    "instance": ("instance", "instance"),
    "models": ("models", "models"),
    "observability": ("observability", "observability"),
    "profiles": ("profiles", "profiles"),
    "rollback": ("cutover", "rollback"),
    "status": ("cutover", "status"),
}


class ApplianceGroup(click.Group):
    """Turns an ApplianceError anywhere below into ``Error: ...`` and its exit code; loads each
    command's module on first use (:data:`COMMANDS`); runs an old spelling as its current form
    (cli/aliases.py)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # An old spelling runs as its current form, for the release cli/aliases.py names.
        from .aliases import current

        return super().parse_args(ctx, current(args, warn=not ctx.resilient_parsing))

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (KeyboardInterrupt, click.exceptions.Abort):
            # Ctrl-C is 130 (128 + SIGINT), as in the shell: not 1, which says refused or failed.
            click.echo(f"{progress.journal_prefix('error')}Error: interrupted", err=True)
            sys.exit(130)
        except ApplianceError as exc:
            click.echo(f"{progress.journal_prefix('error')}Error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:
            click.echo(f"{progress.journal_prefix('error')}Error: {os_error_line(exc)}", err=True)
            sys.exit(1)


def os_error_line(exc: OSError) -> str:
    """``PATH: reason`` (``PATH -> OTHER: reason`` for a rename or link)."""
    reason = exc.strerror or str(exc)
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


@click.group(cls=ApplianceGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="appliance")
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="Results and errors only: no progress bars or lines on long work (image save/load, "
    "models pull), nothing on success from a command run for its side effect (status "
    "--write-metrics).",
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also the evidence behind each verdict (instance doctor's passed checks) and the "
    "debug lines.",
)
@click.pass_context
def cli(ctx: click.Context, quiet: bool, verbose: bool) -> None:
    """Serve Gemma 4 on vLLM with Gemma 4 MTP speculative decoding."""
    if quiet and verbose:
        raise UsageError("-q and -v together", fix="give one of them")
    # The one store of the verbosity: the library's progress lines and the commands read it,
    # and a command's own -q (options.quiet_option) sets it the same way. Put back when the
    # command ends, so that a caller running several commands in one process (the tests'
    # CliRunner) starts each from its own flags.
    ctx.call_on_close(functools.partial(progress.set_verbosity, progress.verbosity()))
    progress.set_verbosity(
        progress.QUIET if quiet else progress.VERBOSE if verbose else progress.NORMAL
    )


def main() -> None:
    cli()
