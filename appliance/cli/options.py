"""Options shared by several command groups."""

from __future__ import annotations

from pathlib import Path

import click

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
