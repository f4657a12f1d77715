"""``appliance dev devmodel``: the tiny Gemma 4 models the CPU engine serves."""

from __future__ import annotations

from pathlib import Path

import click

from ..engine import devmodel as dm


@click.command(name="devmodel")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--drafter",
    type=click.Choice(dm.DRAFTER_KINDS),
    default="copy",
    show_default=True,
    help="copy: accepted almost always; random: accepted almost never.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same weights.")
def devmodel(directory: Path, drafter: str, seed: int) -> None:
    """Write a tiny Gemma 4 target and MTP drafter, generated offline, into DIRECTORY (new or
    empty).

    \b
    Example:
      appliance dev devmodel ./tiny --drafter copy --seed 0
      vllm serve ./tiny/target --speculative-config \\
        '{"method":"mtp","model":"./tiny/drafter","num_speculative_tokens":2}'
    """
    model = dm.build(directory, drafter=drafter, seed=seed)
    click.echo(f"target:  {model.target}")
    click.echo(f"drafter: {model.drafter} ({drafter}, seed {seed})")
