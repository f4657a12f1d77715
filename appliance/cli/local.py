"""``appliance dev serve``: the real vLLM engine, natively, in the foreground."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from ..engine import local as engine
from ..engine.devmodel import DRAFTER_KINDS
from .addresses import PORT


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop()


def progress_printer(label: str):
    """A progress callback that rewrites one line on a terminal and stays quiet otherwise."""
    tty = sys.stderr.isatty()
    last = [-10.0]

    def show(elapsed: float, state: str) -> None:
        if state == "healthy":
            click.echo(f"\r{label}: healthy after {elapsed:.0f} s", err=True)
        elif tty:
            click.echo(f"\r{label}: waiting for /health ... {elapsed:.0f} s", err=True, nl=False)
        elif elapsed - last[0] >= 10:
            last[0] = elapsed
            click.echo(f"{label}: waiting for /health ... {elapsed:.0f} s", err=True)

    return show


@click.command(name="serve")
@click.option(
    "--profile",
    "profile_name",
    default="cpu-tiny-mtp",
    show_default=True,
    help="A CPU profile: a shipped name or a TOML file of yours.",
)
@click.option("--port", type=PORT, default=None, help="Default: a free port on 127.0.0.1.")
@click.option("--drafter", type=click.Choice(DRAFTER_KINDS), default="copy", show_default=True)
@click.option(
    "--model-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="A directory from `appliance dev devmodel` (default: cached per user).",
)
def local_serve(profile_name: str, port: int | None, drafter: str, model_dir: Path | None) -> None:
    """Serve PROFILE in the foreground until Ctrl-C or SIGTERM; then stop every process."""
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        with engine.serve(
            profile_name,
            port=port,
            drafter=drafter,
            model_dir=model_dir,
            progress=progress_printer(profile_name),
        ) as eng:
            click.echo(
                f"serving {eng.profile.served_model_name} at {eng.url}/v1 (log: {eng.log_path})",
                err=False,
            )
            sys.stdout.flush()
            signal.pause()
    except (KeyboardInterrupt, _Stop):
        click.echo("stopped", err=True)
