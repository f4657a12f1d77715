"""``appliance profiles``: the shipped serving profiles."""

from __future__ import annotations

import shlex

import click

from .. import profiles as prof


@click.group()
def profiles() -> None:
    """Serving profiles per host."""


@profiles.command(name="list")
def profiles_list() -> None:
    """List the shipped profiles."""
    for name, p in sorted(prof.all_profiles().items()):
        mtp = f"mtp k={p.speculative.num_speculative_tokens}" if p.mtp else "no-spec"
        click.echo(f"{name:<20} {mtp:<10} {p.description}")


@profiles.command(name="show")
@click.argument("name")
def profiles_show(name: str) -> None:
    """Print the exact `vllm serve` command of profile NAME."""
    p = prof.get(name)
    model_dir = "$DEVMODEL" if p.uses_devmodel else None
    click.echo(shlex.join(["vllm", "serve", *p.serve_args(devmodel=model_dir)]))
