"""``appliance cutover|rollback|status|history``: move an instance (of either shape) between
images, safely; the same commands as ``appliance instance cutover|rollback|status|history``.

Thin: each command builds a :class:`appliance.cutover.context.Context` and calls the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import click

from .. import progress
from ..cutover import flow, gates, history, live, recovery, report
from ..cutover import metrics as cutover_metrics
from ..cutover.context import Context
from ..cutover.status import status as get_status
from ..host import lock as locks
from ..host.layout import Layout
from ..host.systemd import Systemd
from ..observability import state_metrics
from ..units import timing
from .options import SECONDS, gate_options, quiet_option, root_option
from .output import echo_json


def echo_progress(msg: str) -> None:
    # After an SSH hang-up the terminal is gone (EIO): the cutover's way back must go on.
    with contextlib.suppress(OSError):
        click.echo(msg, err=True)


def _context(root: Path, progress: bool = True) -> Context:
    # The tree's own systemd and Docker only: never the host's for a tree (host/reach.py).
    return Context(
        layout=Layout(root),
        systemd=Systemd.of_tree(root),
        progress=echo_progress if progress else (lambda _m: None),
    )


def timeout_option(which: str):
    """``--timeout``: the gates' deadline, by default as long as the unit lets a restart take."""
    return click.option(
        "--timeout",
        type=SECONDS,
        default=round(flow.DEFAULT_TIMEOUT),  # shown as 2010, not 2010.0
        show_default=True,
        help=f"Seconds for {which} to pass every gate, from the restart. The default covers "
        f"the unit's stop ({timing.STOP_TIMEOUT_S} s) and start ({timing.START_TIMEOUT_S} s) "
        f"budgets, and {gates.AFTER_START_S} s for the gates after them.",
    )


@click.command(name="cutover")
@click.argument("name", metavar="NAME")
@click.argument("image")
@timeout_option("the new image")
@click.option("--no-rollback", is_flag=True, help="On failure, leave the new image in place.")
@click.option(
    "--allow-no-mtp",
    is_flag=True,
    help="Accept an image without Gemma 4 MTP for a profile that requests it.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Preflight only, touching nothing; print one JSON object (what the fleet's play "
    "compares across a group's hosts).",
)
@click.option(
    "--canary-before",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Judge IMAGE against these answers of the old image (`appliance canary record NAME "
    "--out FILE`) instead of recording them now: a group's head whose workers moved first.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Cut over to a floating tag (latest, mtp, pre-mtp, their -cpu forms) all the same: "
    "the next `appliance image build` moves it, and the next restart runs what it names then.",
)
@click.option(
    "--live-acceptance/--no-live-acceptance",
    default=True,
    show_default=True,
    help="Judge the new image's draft acceptance on the traffic the instance serves against "
    "the old image's (recorded before the move; a bootstrap non-inferiority bound, 95%). "
    "Without traffic there is nothing to judge and the canary decides.",
)
@click.option(
    "--live-acceptance-margin",
    type=float,
    default=None,
    metavar="DROP",
    help=f"The drop in mean acceptance (absolute, 0..1) the live rule tolerates "
    f"[default: {live.DEFAULT.rule.margin}].",
)
@click.option(
    "--live-acceptance-window",
    type=float,
    default=None,
    metavar="SECONDS",
    help=f"How long each window of the live traffic lasts at least; the rule wants "
    f"{live.DEFAULT.rule.min_samples} a side, so shorter windows decide sooner on busy traffic "
    f"[default: {live.DEFAULT.sampling.window_s}].",
)
@gate_options
@root_option
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help="Print the history entry of the cutover that passed as one JSON object (--check "
    "prints its object either way).",
)
def cutover(
    name: str,
    image: str,
    timeout: float,
    no_rollback: bool,
    allow_no_mtp: bool,
    check: bool,
    canary_before: Path | None,
    canary: bool | None,
    canary_file: tuple[Path, ...],
    canary_timeout: float,
    allow_unit_overrides: bool,
    force: bool,
    live_acceptance: bool,
    live_acceptance_margin: float | None,
    live_acceptance_window: float | None,
    root: Path,
    json_: bool,
) -> None:
    """Move NAME to IMAGE: restart, gate, and roll back automatically on failure.

    NAME is an instance, or a multi-node group: the group's nodes this host runs move together
    (the worker first, gates on the head). Ctrl-C, SIGTERM or a hang-up during the gates rolls
    back too. The way back is not interrupted by further signals and takes at most --timeout
    seconds more. If the cutover is killed outright, `appliance status NAME` prints the
    recovery command. IMAGE is a version tag (or an image ID): a floating tag (latest, mtp,
    pre-mtp, their -cpu forms) is refused without --force, since the next `appliance image
    build` moves it.

    \b
    Example:
      appliance cutover 31b gemma4-vllm:0.32.0-mtp
      appliance cutover 31b gemma4-vllm:0.32.0-mtp --check
    """
    # Before anything else: a bad value is refused with or without --check.
    live_settings = live.settings(live_acceptance, live_acceptance_margin, live_acceptance_window)
    if check:
        found = flow.check(
            _context(root, progress=False),
            name,
            image,
            allow_no_mtp=allow_no_mtp,
            allow_unit_overrides=allow_unit_overrides,
            force=force,
        )
        echo_json(found)
        return
    entry = flow.cutover(
        _context(root),
        name,
        image,
        timeout=timeout,
        rollback=not no_rollback,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_file,
        canary_timeout=canary_timeout,
        canary_before=canary_before,
        allow_unit_overrides=allow_unit_overrides,
        force=force,
        live_acceptance=live_settings,
    )
    if json_:
        echo_json(dataclasses.asdict(entry))
        return
    click.echo(f"{name}: now on {entry.to_image} (was {entry.from_image}); gates passed")
    if entry.canary:
        click.echo(f"{name}: {entry.canary['summary']}")


@click.command(name="rollback")
@click.argument("name", metavar="NAME")
@timeout_option("the previous image")
@click.option(
    "--to",
    "to",
    metavar="IMAGE",
    help="Back to IMAGE (e.g. the image a group's other hosts returned to) instead of the "
    "rollback slot's.",
)
@root_option
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help="Print the history entry of the rollback that passed as one JSON object.",
)
def rollback(name: str, timeout: float, to: str | None, root: Path, json_: bool) -> None:
    """Return NAME to its previous image, through the same gates.

    After a cutover that was killed (SIGKILL, power loss), return to where it started instead
    (the env file saved before it) and close its history entry."""
    entry = recovery.rollback(_context(root), name, timeout=timeout, to=to)
    if json_:
        echo_json(dataclasses.asdict(entry))
        return
    click.echo(rollback_line(name, entry))


def rollback_line(name: str, entry: history.Entry) -> str:
    """What a passed rollback (or the recovery of a killed cutover) of ``name`` says."""
    if entry.interrupted == "killed":
        back = recovery.recovery_image(entry)
        return (
            f"{name}: recovered the interrupted {entry.kind} "
            f"({entry.from_image} -> {entry.to_image}): on {back}; gates passed"
        )
    return f"{name}: rolled back to {entry.to_image} (was {entry.from_image}); gates passed"


@click.command(name="status")
@click.argument("name", metavar="[NAME]", required=False)
@click.option(
    "--write-metrics",
    is_flag=True,
    help="Also rewrite the state-metrics textfile (units' states included); for a timer.",
)
@quiet_option
@click.option("--json", "json_", is_flag=True, help='One JSON object: {"instances": [...]}.')
@root_option
def status(name: str | None, write_metrics: bool, json_: bool, root: Path) -> None:
    """Image, labels, unit state, health, MTP and recent history of NAME (or of all).

    Exits 1 when an instance shown is not serving (a unit not active, /health not answering,
    its files unreadable). With --write-metrics and -q (what gemma4-appliance-state.timer runs
    every minute): the textfile alone, and nothing printed unless something is wrong."""
    quiet = progress.verbosity() <= progress.QUIET
    layout = Layout(root)
    if name:
        layout.require_known(name)
    names = [name] if name else layout.installed()
    if not names and not json_:
        click.echo(f"no instances under {layout.env_dir}")
    ctx = _context(root, progress=False)
    if write_metrics:
        # Cutovers write it too; between them only this refresh shows a unit that gave up.
        found = cutover_metrics.states(layout, cutover_metrics.local_docker(root), ctx.systemd)
        written = cutover_metrics.write_states(layout, found)
        if not quiet:  # the timer's run: a line a minute would fill the journal (E10)
            click.echo(f"wrote {written}", err=json_)  # with --json, stdout is the one object
        for st in found:
            if st.env_error:
                progress.line(
                    f"warning: {st.instance}: marked {state_metrics.ENV_FILE_READABLE} 0: "
                    f"{st.env_error}",
                    "warning",
                )
        if quiet:
            return
    found = [get_status(ctx, n) for n in names]
    if json_:
        instances = [dataclasses.asdict(st) for st in found]
        echo_json({"instances": instances})
    else:
        for st in found:
            click.echo("\n".join(report.status_lines(st)))
    if any(not st.serving for st in found):
        sys.exit(1)


@click.command(name="history")
@click.argument("name", metavar="NAME")
@click.option("--json", "json_", is_flag=True, help='One JSON object: {"entries": [...]}.')
@root_option
def history_(name: str, json_: bool, root: Path) -> None:
    """Every cutover and rollback of NAME, oldest first, with gate timings."""
    layout = Layout(root)
    layout.require_known(name)
    holder = locks.current_holder(layout.lock_file(name))
    live = frozenset({holder.entry_id} if holder and holder.entry_id else ())
    entries = history.entries(layout.history_file(name), live_ids=live)
    if json_:
        found = [dataclasses.asdict(e) for e in entries]
        echo_json({"entries": found})
        return
    if not entries:
        click.echo(f"{name}: no cutover or rollback yet")
    for e in entries:
        click.echo("\n".join(report.entry_lines(e)))
