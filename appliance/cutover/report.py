"""What ``appliance status`` and ``history`` print: an instance's status and its history
entries as lines an operator reads (the records themselves are :mod:`.status` and
:mod:`.history`)."""

from __future__ import annotations

import datetime as dt

from ..host import reach
from ..oci import labels
from . import history
from .status import Status, describe_running


def when(ts: float | None) -> str:
    """A history timestamp in UTC, ISO 8601 (``-`` when unset)."""
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def entry_line(e: history.Entry) -> str:
    """One history entry: when, what, outcome, the move and its duration; its error below."""
    took = f"{e.finished - e.started:.0f}s" if e.finished else "-"
    move = f"{e.from_image or '-'} -> {e.to_image}"
    line = f"{when(e.started)}  {e.kind:<8} {e.outcome:<11} {move}  ({took})"
    if e.error:
        line += f"\n    {e.error}"
    return line


def entry_lines(e: history.Entry) -> list[str]:
    """``entry_line`` with the gates' timings and the canary, as ``history`` prints them."""
    out = [entry_line(e)]
    for label, gs in (("gates", e.gates), ("rollback gates", e.rollback_gates)):
        if gs:
            timings = ", ".join(
                f"{g.name} {'ok' if g.ok else 'FAILED'} {g.seconds:.1f}s" for g in gs
            )
            out.append(f"    {label}: {timings}")
    if e.canary:
        out.append(f"    canary: {canary_line([e])}")
    return out


def canary_line(entries: list[history.Entry]) -> str:
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


def baseline_line(st: Status) -> str:
    """The instance's acceptance baseline: its figures, image and when, or "none"."""
    if st.baseline_error:
        return st.baseline_error
    b = st.baseline
    if not b:
        return "none"
    return (
        f"acceptance {b['acceptance']:.0%}, tokens per step {b['tokens_per_step']:.2f} "
        f"({b['image'] or '-'}, vLLM {b['vllm_version']}, recorded {when(b['recorded'])})"
    )


def status_lines(st: Status) -> list[str]:
    """``appliance status NAME``'s block: units, image, what runs, labels, health, MTP, the
    rollback target, a cutover in progress or interrupted (with the one recovery command),
    the canary, the acceptance baseline and the recent history."""
    units = ", ".join(f"{u}: {state}" for u, state in st.units.items())
    out = [f"{st.instance}  ({units})", f"  image:      {st.image or '-'}"]
    if st.gpus:
        out.append(f"  gpus:       {st.gpus}")
    if st.running_id is not None:
        flag = ""
        if st.mismatch:
            flag = (
                "  MISMATCH: not the env file's image (a drop-in or a second "
                "EnvironmentFile sets VLLM_IMAGE?)"
            )
        out.append(f"  running:    {describe_running(st)}{flag}")
    elif st.running_error:
        out.append(f"  running:    {st.running_error}")
    else:
        out.append("  running:    - (no container)")
    if st.image_info:
        i = st.image_info
        build = labels.variant(i.labels) or "?"
        out.append(
            f"  labels:     vLLM {i.vllm_version or '?'}, mtp={'yes' if i.mtp else 'no'}, "
            f"build={build}"
        )
        if st.wrong_build:
            out.append(f"  WRONG BUILD: {st.wrong_build}")
        elif st.build_warning:
            out.append(f"  build:      {st.build_warning}")
    elif st.image_error:
        out.append(f"  labels:     {st.image_error}")
        why = "Docker was not asked" if reach.unasked(st.image_error) else "no labels"
        out.append(f"  build:      image build not checked: {why}")
    if st.instance_error:
        out.append(f"  instance:   {st.instance_error}")
    health = {True: "200", False: "not answering", None: "-"}[st.healthy]
    if st.health_note:
        health = st.health_note
    out.append(f"  health:     {health}" + (f" ({st.url})" if st.url else ""))
    spec = {True: "on", False: "off", None: "-"}[st.speculative]
    out.append(f"  MTP:        {spec}")
    out.append(f"  rollback:   {st.rollback_image or '-'}")
    if st.in_progress:
        out.append(f"  busy:       pid {st.in_progress.pid}: {st.in_progress.action}")
    if st.interrupted:
        last = st.entries[-1]
        out.append(
            f"  INTERRUPTED {last.kind} {last.from_image or '-'} -> {last.to_image} "
            f"(pid {last.pid} was killed); env file is the {st.interrupted}"
        )
        out.append(f"  recover:    {st.recovery}")
        out.append(f"              ({st.recovery_note})")
    out.append(f"  canary:     {canary_line(st.entries)}")
    out.append(f"  baseline:   {baseline_line(st)}")
    for e in st.entries:
        out.append("  " + entry_line(e).replace("\n", "\n  "))
    return out
