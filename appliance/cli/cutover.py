"""``appliance cutover|rollback|status|history``: move an instance between images, safely.

Thin: each command builds a :class:`appliance.cutover.context.Context` and calls the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
from pathlib import Path

import click

from .. import state_metrics
from ..cutover import flow, history, recovery
from ..cutover import metrics as cutover_metrics
from ..cutover.context import Context
from ..cutover.status import describe_running
from ..cutover.status import status as get_status
from ..errors import UsageError
from ..host import lock as locks
from ..host.layout import Layout
from .options import gate_options, root_option


def echo_progress(msg: str) -> None:
    # After an SSH hang-up the terminal is gone (EIO): the cutover's way back must go on.
    with contextlib.suppress(OSError):
        click.echo(msg, err=True)


def _context(root: Path, progress: bool = True) -> Context:
    return Context(layout=Layout(root), progress=echo_progress if progress else (lambda _m: None))


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _entry_line(e: history.Entry) -> str:
    took = f"{e.finished - e.started:.0f}s" if e.finished else "-"
    move = f"{e.from_image or '-'} -> {e.to_image}"
    line = f"{_when(e.started)}  {e.kind:<8} {e.outcome:<11} {move}  ({took})"
    if e.error:
        line += f"\n    {e.error}"
    return line


def _canary_line(entries: list[history.Entry]) -> str:
    """The last entry's canary: its summary and cost, or why there is none."""
    if not entries:
        return "-"
    last = entries[-1]
    c = last.canary
    if not c:
        return f"not run by the last {last.kind}"
    if c.get("error"):
        return f"error: {c['error']}"
    cost = (
        f"cost {c['seconds_before']:.1f} s before, {c['seconds_after']:.1f} s after "
        f"({c['seconds_per_prompt_after']:.2f} s per prompt)"
    )
    return f"{c['summary']}; {cost}"


def _baseline_line(st) -> str:
    """The instance's acceptance baseline: its figures, image and when, or "none"."""
    if st.baseline_error:
        return st.baseline_error
    b = st.baseline
    if not b:
        return "none"
    return (
        f"acceptance {b['acceptance']:.0%}, tokens per step {b['tokens_per_step']:.2f} "
        f"({b['image'] or '-'}, vLLM {b['vllm_version']}, recorded {_when(b['recorded'])})"
    )


@click.command(name="cutover")
@click.argument("instance")
@click.argument("image")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=flow.DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds for the new image to pass every gate.",
)
@click.option("--no-rollback", is_flag=True, help="On failure, leave the new image in place.")
@click.option(
    "--allow-no-mtp",
    is_flag=True,
    help="Accept an image without Gemma 4 MTP for a profile that requests it.",
)
@gate_options
@root_option
def cutover(
    instance: str,
    image: str,
    timeout: float,
    no_rollback: bool,
    allow_no_mtp: bool,
    canary: bool | None,
    canary_file: tuple[Path, ...],
    canary_timeout: float,
    allow_unit_overrides: bool,
    root: Path,
) -> None:
    """Move INSTANCE to IMAGE: restart, gate, and roll back automatically on failure.

    Ctrl-C, SIGTERM or a hang-up during the gates rolls back too. The way back is not
    interrupted by further signals and takes at most --timeout seconds more. If the cutover is
    killed outright, `appliance status INSTANCE` prints the recovery command.

    \b
    Example:
      appliance cutover 31b gemma4-vllm:0.21.0-mtp
    """
    entry = flow.cutover(
        _context(root),
        instance,
        image,
        timeout=timeout,
        rollback=not no_rollback,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_file,
        canary_timeout=canary_timeout,
        allow_unit_overrides=allow_unit_overrides,
    )
    click.echo(f"{instance}: now on {entry.to_image} (was {entry.from_image}); gates passed")
    if entry.canary:
        click.echo(f"{instance}: {entry.canary['summary']}")


@click.command(name="rollback")
@click.argument("instance")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=flow.DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds for the previous image to pass every gate.",
)
@root_option
def rollback(instance: str, timeout: float, root: Path) -> None:
    """Return INSTANCE to its previous image, through the same gates.

    After a cutover that was killed (SIGKILL, power loss), return to where it started instead
    (the env file saved before it) and close its history entry."""
    entry = recovery.rollback(_context(root), instance, timeout=timeout)
    click.echo(rollback_line(instance, entry))


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
@click.argument("instance", required=False)
@click.option(
    "--write-metrics",
    is_flag=True,
    help="Also rewrite the state-metrics textfile (units' states included); for a timer.",
)
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="With --write-metrics: print only the file written (gemma4-appliance-state.service).",
)
@click.option("--json", "json_", is_flag=True, help="One JSON object per instance and line.")
@root_option
def status(instance: str | None, write_metrics: bool, quiet: bool, json_: bool, root: Path) -> None:
    """Image, labels, unit state, health, MTP and recent history of INSTANCE (or of all)."""
    if quiet and not write_metrics:
        raise UsageError("--quiet goes with --write-metrics", fix="drop --quiet")
    layout = Layout(root)
    if instance:
        layout.require_known(instance)
    names = [instance] if instance else sorted(p.stem for p in layout.env_dir.glob("*.env"))
    if not names and not json_:
        click.echo(f"no instances under {layout.env_dir}")
    ctx = _context(root, progress=False)
    if write_metrics:
        # Cutovers write it too; between them only this refresh shows a unit that gave up.
        found = cutover_metrics.states(layout, cutover_metrics.local_docker(), ctx.systemd)
        written = cutover_metrics.write_states(layout, found)
        click.echo(f"wrote {written}")
        for st in found:
            if st.env_error:
                click.echo(
                    f"warning: {st.instance}: marked {state_metrics.ENV_FILE_READABLE} 0: "
                    f"{st.env_error}",
                    err=True,
                )
        if quiet:
            return
    for name in names:
        st = get_status(ctx, name)
        if json_:
            click.echo(json.dumps(dataclasses.asdict(st), sort_keys=True, default=str))
            continue
        units = ", ".join(f"{u}: {state}" for u, state in st.units.items())
        click.echo(f"{st.instance}  ({units})")
        click.echo(f"  image:      {st.image or '-'}")
        if st.running_id is not None:
            flag = ""
            if st.mismatch:
                flag = (
                    "  MISMATCH: not the env file's image (a drop-in or a second "
                    "EnvironmentFile sets VLLM_IMAGE?)"
                )
            click.echo(f"  running:    {describe_running(st)}{flag}")
        elif st.running_error:
            click.echo(f"  running:    {st.running_error}")
        else:
            click.echo("  running:    - (no container)")
        if st.image_info:
            i = st.image_info
            click.echo(
                f"  labels:     vLLM {i.vllm_version or '?'}, mtp={'yes' if i.mtp else 'no'}"
            )
        elif st.image_error:
            click.echo(f"  labels:     {st.image_error}")
        if st.instance_error:
            click.echo(f"  instance:   {st.instance_error}")
        health = {True: "200", False: "not answering", None: "-"}[st.healthy]
        click.echo(f"  health:     {health}" + (f" ({st.url})" if st.url else ""))
        spec = {True: "on", False: "off", None: "-"}[st.speculative]
        click.echo(f"  MTP:        {spec}")
        click.echo(f"  rollback:   {st.rollback_image or '-'}")
        if st.in_progress:
            click.echo(f"  busy:       pid {st.in_progress.pid}: {st.in_progress.action}")
        if st.interrupted:
            last = st.entries[-1]
            click.echo(
                f"  INTERRUPTED {last.kind} {last.from_image or '-'} -> {last.to_image} "
                f"(pid {last.pid} was killed); env file is the {st.interrupted}"
            )
            click.echo(f"  recover:    {st.recovery}")
            click.echo(f"              ({st.recovery_note})")
        click.echo(f"  canary:     {_canary_line(st.entries)}")
        click.echo(f"  baseline:   {_baseline_line(st)}")
        for e in st.entries:
            click.echo("  " + _entry_line(e).replace("\n", "\n  "))


@click.command(name="history")
@click.argument("instance")
@click.option("--json", "json_", is_flag=True, help="One JSON object per line, as stored.")
@root_option
def history_(instance: str, json_: bool, root: Path) -> None:
    """Every cutover and rollback of INSTANCE, oldest first, with gate timings."""
    layout = Layout(root)
    layout.require_known(instance)
    holder = locks.current_holder(layout.lock_file(instance))
    live = frozenset({holder.entry_id} if holder and holder.entry_id else ())
    entries = history.entries(layout.history_file(instance), live_ids=live)
    if not entries and not json_:
        click.echo(f"{instance}: no cutover or rollback yet")
    for e in entries:
        if json_:
            click.echo(e.to_json())
            continue
        click.echo(_entry_line(e))
        for label, gs in (("gates", e.gates), ("rollback gates", e.rollback_gates)):
            if gs:
                click.echo(
                    f"    {label}: "
                    + ", ".join(
                        f"{g.name} {'ok' if g.ok else 'FAILED'} {g.seconds:.1f}s" for g in gs
                    )
                )
        if e.canary:
            click.echo(f"    canary: {_canary_line([e])}")
