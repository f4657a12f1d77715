"""The old spellings, kept hidden for one release: each runs the new command and first says,
on stderr, how it is written now (scripts keep working while their authors move)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import click

from .. import installer, units
from ..host.layout import Node
from .options import root_option
from .units import _report


def deprecated(command: click.Command, old: str, new: str) -> click.Command:
    """``command`` under its old spelling ``appliance OLD``: hidden from help, same options,
    one warning line naming ``appliance NEW``."""
    alias = copy.copy(command)
    alias.hidden = True
    alias.name = old.split()[-1]
    callback = command.callback

    @functools.wraps(callback)
    def warned(*args, **kwargs):
        click.echo(f"warning: `appliance {old}` is now `appliance {new}`", err=True)
        return callback(*args, **kwargs)

    alias.callback = warned
    return alias


@click.command("install", hidden=True)
@click.option("--profile", "-p", required=True)
@click.option("--group", "-g", required=True)
@click.option("--role", type=click.Choice(["head", "worker", "both"]), default="head")
@click.option("--rank", type=int, default=1)
@click.option("--image")
@click.option("--port", type=int)
@click.option("--model-dir")
@root_option
def _multinode_install(profile, group, role, rank, image, port, model_dir, root: Path) -> None:
    """The old `multinode install --group G`: `instance install G --role ROLE --rank N`."""
    click.echo(
        f"warning: `appliance multinode install --group {group}` is now "
        f"`appliance instance install {group} --profile {profile} --role {role}"
        + (f" --rank {rank}`" if role != "head" else "`"),
        err=True,
    )
    roles = ("head", "worker") if role == "both" else (role,)
    done = installer.install(
        profile,
        group,
        root=root,
        options=units.Options(image=image, port=port, model_dir=model_dir),
        node=Node(roles=roles, rank=rank),
    )
    _report(done.result)
    if done.next_step:
        click.echo(f"next: {done.next_step}")


def multinode_group() -> click.Group:
    """The old ``appliance multinode`` verbs, each the instance verb it became."""
    from .canary import canary_record
    from .cutover import cutover, rollback

    group = click.Group("multinode", hidden=True, help="Old spellings: see `appliance instance`.")
    group.add_command(_multinode_install)
    group.add_command(deprecated(cutover, "multinode cutover", "cutover"))
    group.add_command(deprecated(rollback, "multinode rollback", "rollback"))
    group.add_command(deprecated(canary_record, "multinode canary", "canary record"))
    return group
