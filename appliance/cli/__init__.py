"""The ``appliance`` command. Commands parse options and call library functions; nothing else.

User-facing errors are :class:`appliance.errors.ApplianceError`; they print as one line and exit
with the error's code. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..errors import ApplianceError
from .bench import bench
from .canary import canary
from .cutover import cutover, history_, rollback, status
from .demo import demo
from .devmodel import devmodel
from .doctor import doctor
from .fleet import fleet
from .generate import generate
from .images import image
from .local import local
from .models import models
from .multinode import multinode_group
from .profiles import profiles
from .units import install, render, uninstall

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class ApplianceGroup(click.Group):
    """Turns an ApplianceError anywhere below into ``Error: ...`` and its exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ApplianceError as exc:
            click.echo(f"Error: {exc}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=ApplianceGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="appliance")
def cli() -> None:
    """Serve Gemma 4 on vLLM with Gemma 4 MTP speculative decoding."""


cli.add_command(devmodel)
cli.add_command(local)
cli.add_command(profiles)
cli.add_command(demo)
cli.add_command(doctor)
cli.add_command(bench)
cli.add_command(canary)
cli.add_command(cutover)
cli.add_command(rollback)
cli.add_command(status)
cli.add_command(history_)
cli.add_command(generate)
cli.add_command(multinode_group)
cli.add_command(render)
cli.add_command(install)
cli.add_command(uninstall)
cli.add_command(image)
cli.add_command(models)
cli.add_command(fleet)


def main() -> None:
    cli()
