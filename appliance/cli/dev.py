"""``appliance dev demo|devmodel|serve|generate``: the developer's tools, beside the operator's
commands: the demo on the embedded CPU engine, the tiny models it serves, the engine in the
foreground, and the repository's generated files."""

from __future__ import annotations

import click

from .demo import demo
from .devmodel import devmodel
from .generate import generate
from .local import local_serve


@click.group()
def dev() -> None:
    """Developer tools: the CPU demo, tiny models, the engine in the foreground, generated files."""


for command in (demo, devmodel, local_serve, generate):
    dev.add_command(command)
