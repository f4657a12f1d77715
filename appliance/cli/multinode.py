"""``appliance multinode``: one model across nodes (vLLM's own multi-node), head and worker units.

Thin: every command calls :mod:`appliance.multinode` or :mod:`appliance.multinode.cutover`.
``cutover``/``rollback`` drive the nodes this host reaches: the head, and the worker where it
runs on the same host (``--role both`` at install). Workers on other hosts: run ``install`` on
each (``--role worker --rank N``); moving them is the fleet's job (deploy/ansible), each host's
env file naming the same image (``appliance multinode cutover`` refuses a split group).
"""

from __future__ import annotations

from pathlib import Path

import click

from .. import multinode, units
from ..cutover.context import Context
from ..host.layout import Layout
from ..host.systemd import Systemd
from .options import gate_options, root_option


@click.group("multinode")
def multinode_group() -> None:
    """One model across nodes: head and worker units, cutover and rollback of the group."""


@multinode_group.command("install")
@click.option("--profile", "-p", required=True, help="A profile with a [multinode] table.")
@click.option("--group", "-g", required=True, help="The group's name (the units' instance).")
@click.option(
    "--role",
    type=click.Choice(["head", "worker", "both"]),
    default="head",
    show_default=True,
    help="What this host runs (both: head and its worker on this one host).",
)
@click.option("--rank", type=int, default=1, show_default=True, help="This worker's node rank.")
@click.option("--image", help="VLLM_IMAGE of the group (default: kept, else gemma4-vllm:latest).")
@click.option("--port", type=int, help="VLLM_PORT of the head's API.")
@click.option("--model-dir", help="CPU profiles: the tiny model pair.")
@root_option
def install_cmd(profile, group, role, rank, image, port, model_dir, root: Path) -> None:
    """Install this host's units and files of GROUP (idempotent; no systemctl)."""
    roles = ("head", "worker") if role == "both" else (role,)
    opts = units.Options(image=image, port=port, model_dir=model_dir)
    result = multinode.install(
        profile, group, multinode.Node(roles=roles, rank=rank), root=root, options=opts
    )
    for path in result.written:
        click.echo(f"wrote {path}")
    if not result.changed:
        click.echo("unchanged")
    first = multinode.unit_name(group, "worker" if role == "worker" else "head")
    timer = f"{units.STATE_UNIT}.timer"
    click.echo(f"next: systemctl daemon-reload && systemctl enable --now {first} {timer}")


def _hosts(root: Path, group: str) -> list:
    from ..multinode import cutover as mcut

    colocated = (Path(root) / multinode.dropin_path(group)).exists()
    roles = ("head", "worker") if colocated else ("head",)
    return [mcut.Host("this host", multinode.Node(roles=roles), Path(root), Systemd.from_env())]


def _context(root: Path) -> Context:
    return Context(layout=Layout(Path(root)), progress=lambda m: click.echo(m, err=True))


@multinode_group.command("cutover")
@click.argument("group")
@click.argument("image")
@click.option("--timeout", type=float, default=900.0, show_default=True)
@click.option("--allow-no-mtp", is_flag=True, help="Accept an image without Gemma 4 MTP.")
@gate_options
@root_option
def cutover_cmd(
    group,
    image,
    timeout,
    allow_no_mtp,
    canary,
    canary_timeout,
    canary_file,
    allow_unit_overrides,
    root: Path,
) -> None:
    """Move every node of GROUP to IMAGE; gates on the head; all back on failure.

    The instance cutover's state machine: Ctrl-C, SIGTERM or a hang-up during the gates rolls
    every node back; if the cutover is killed outright, `appliance status GROUP` prints the
    recovery command."""
    from ..multinode import cutover as mcut

    entry = mcut.cutover(
        _context(root),
        group,
        image,
        _hosts(root, group),
        timeout=timeout,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_file,
        canary_timeout=canary_timeout,
        allow_unit_overrides=allow_unit_overrides,
    )
    click.echo(f"{group}: {entry.from_image} -> {entry.to_image}: {entry.outcome}")
    if entry.canary:
        click.echo(f"{group}: {entry.canary['summary']}")


@multinode_group.command("rollback")
@click.argument("group")
@click.option("--timeout", type=float, default=900.0, show_default=True)
@root_option
def rollback_cmd(group, timeout, root: Path) -> None:
    """Every node of GROUP back to its previous image, same gates.

    After a cutover that was killed (SIGKILL, power loss), back to where it started instead
    (every node's env file saved before it) and close its history entry."""
    from ..multinode import cutover as mcut
    from .cutover import rollback_line

    entry = mcut.rollback(_context(root), group, _hosts(root, group), timeout=timeout)
    click.echo(rollback_line(group, entry))
