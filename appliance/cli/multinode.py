"""``appliance multinode``: one model across nodes (vLLM's own multi-node), head and worker units.

Thin: every command calls :mod:`appliance.multinode` or :mod:`appliance.multinode.cutover`.
``cutover``/``rollback`` move the nodes of the group this host runs (the head, its worker
where ``--role both`` installed it, or a worker alone). A group whose nodes run on several
hosts is moved by the fleet's play (deploy/ansible/playbooks/multinode-cutover.yml), which runs
these commands host by host: ``cutover --check`` everywhere, ``canary`` on the head, then each
worker host, then the head (``--no-rollback --canary-before``), and on failure ``rollback --to``
the image they left, workers first.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .. import multinode, units
from ..cutover.context import Context
from ..host.layout import Layout
from ..host.systemd import Systemd
from .cutover import echo_progress
from .options import OutputPath, gate_options, root_option


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

    node = multinode.host_node(root, group)
    return [mcut.Host("this host", node, Path(root), Systemd.from_env())]


def _context(root: Path) -> Context:
    # The instance's progress: after an SSH hang-up (a fleet play's host lost) the pipe is gone,
    # and the cutover must go on to its gates and its record.
    return Context(layout=Layout(Path(root)), progress=echo_progress)


@multinode_group.command("cutover")
@click.argument("group")
@click.argument("image")
@click.option("--timeout", type=float, default=900.0, show_default=True)
@click.option("--no-rollback", is_flag=True, help="On failure, leave the new image in place.")
@click.option("--allow-no-mtp", is_flag=True, help="Accept an image without Gemma 4 MTP.")
@click.option(
    "--check",
    is_flag=True,
    help="Preflight only (touch nothing); print one JSON line for the fleet's play.",
)
@click.option(
    "--canary-before",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Judge IMAGE against these answers of the old image (`appliance multinode canary`), "
    "recorded before the workers moved.",
)
@gate_options
@root_option
def cutover_cmd(
    group,
    image,
    timeout,
    no_rollback,
    allow_no_mtp,
    check,
    canary_before,
    canary,
    canary_timeout,
    canary_file,
    allow_unit_overrides,
    root: Path,
) -> None:
    """Move the nodes of GROUP this host runs to IMAGE; gates on the head; all back on failure.

    The instance cutover's state machine: Ctrl-C, SIGTERM or a hang-up during the gates rolls
    every node back; if the cutover is killed outright, `appliance status GROUP` prints the
    recovery command. A head whose workers run on other hosts moves only with --no-rollback:
    the group's play moves those workers, and every node back on failure."""
    from ..multinode import cutover as mcut

    if check:
        found = mcut.check(
            _context(root),
            group,
            image,
            _hosts(root, group),
            allow_no_mtp=allow_no_mtp,
            allow_unit_overrides=allow_unit_overrides,
        )
        click.echo(json.dumps(found, sort_keys=True))
        return
    entry = mcut.cutover(
        _context(root),
        group,
        image,
        _hosts(root, group),
        timeout=timeout,
        rollback=not no_rollback,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_file,
        canary_timeout=canary_timeout,
        canary_before=canary_before,
        allow_unit_overrides=allow_unit_overrides,
    )
    click.echo(f"{group}: {entry.from_image} -> {entry.to_image}: {entry.outcome}")
    if entry.canary:
        click.echo(f"{group}: {entry.canary['summary']}")


@multinode_group.command("canary")
@click.argument("group")
@click.option(
    "--out",
    type=OutputPath(),
    required=True,
    help="Write the record (JSON) here, atomically.",
)
@click.option(
    "--canary-file",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Your JSONL cases; they extend the shipped set (repeatable).",
)
@root_option
def canary_cmd(group, out: Path, canary_file, root: Path) -> None:
    """Record the head's answers to the output canary set, on the image GROUP runs.

    The group's play runs it on the head's host before any worker moves; the head's cutover then
    judges the new image against it (--canary-before)."""
    from ..multinode import cutover as mcut

    rec = mcut.record_canary(
        _context(root), group, _hosts(root, group), out, canary_files=canary_file
    )
    click.echo(f"{rec.cost()}; wrote {out}")


@multinode_group.command("rollback")
@click.argument("group")
@click.option("--timeout", type=float, default=900.0, show_default=True)
@click.option(
    "--to",
    "to",
    metavar="IMAGE",
    help="Back to IMAGE (the image the group left) instead of the rollback slot's.",
)
@root_option
def rollback_cmd(group, timeout, to, root: Path) -> None:
    """The nodes of GROUP this host runs back to their previous image, same gates.

    After a cutover that was killed (SIGKILL, power loss), back to where it started instead
    (every node's env file saved before it) and close its history entry."""
    from ..multinode import cutover as mcut
    from .cutover import rollback_line

    entry = mcut.rollback(_context(root), group, _hosts(root, group), timeout=timeout, to=to)
    click.echo(rollback_line(group, entry))
