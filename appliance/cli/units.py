"""``appliance instance render|install|uninstall NAME``: an instance's units, env file, args
file and the shared serve program, from a profile; a multi-node profile's group node by node."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from .. import hostcheck, progress, units
from ..cutover import metrics as cutover_metrics
from ..errors import UsageError
from ..host.layout import Layout, Node
from ..host.systemd import Systemd
from ..instance import installer
from .options import OutputPath, root_option
from .output import echo_json


def instance_options(profile_required: bool):
    """The options shared by render and install (install may take the profile from the env)."""
    profile_help = (
        "Serving profile."
        if profile_required
        else ("Serving profile (default: the one the instance's env file names).")
    )

    def decorate(f):
        for decorator in reversed(
            [
                click.option(
                    "--profile", "-p", "profile", required=profile_required, help=profile_help
                ),
                click.option(
                    "--image",
                    help="VLLM_IMAGE (default: kept, else the version tag of the newest image "
                    "of the profile's build here, else gemma4-vllm:latest or :latest-cpu).",
                ),
                click.option(
                    "--gpus",
                    help="docker --gpus value (default: the next free of the profile's kind).",
                ),
                click.option(
                    "--host",
                    help="VLLM_HOST: the address vLLM binds (default: kept, else the profile's).",
                ),
                click.option(
                    "--port", type=int, help="VLLM_PORT (default: kept, else the profile's)."
                ),
                click.option("--model-dir", help="CPU profiles: the tiny model pair on the host."),
                click.option("--hf-cache-dir", help="GPU profiles: the Hugging Face cache."),
                click.option("--vllm-cache-dir", help="vLLM's compile cache on the host."),
            ]
        ):
            f = decorator(f)
        return f

    return decorate


def _options(kw: dict) -> units.Options:
    return units.Options(
        image=kw["image"],
        gpus=kw["gpus"],
        host=kw["host"],
        port=kw["port"],
        model_dir=kw["model_dir"],
        hf_cache_dir=kw["hf_cache_dir"],
        vllm_cache_dir=kw["vllm_cache_dir"],
    )


def _report(result: units.WriteResult, json_: bool = False, **more) -> None:
    """What a write did, a line per file; with ``json_`` one object: the record, whether it
    changed anything, and ``more`` (install's ``next_step``). Warnings go to stderr either
    way."""
    if json_:
        for warning in result.warnings:
            progress.line(f"warning: {warning}", "warning")
        echo_json({**dataclasses.asdict(result), "changed": result.changed, **more})
        return
    for path in result.written:
        click.echo(f"wrote     {path} ({path.stat().st_mode & 0o777:o})")
    for path in result.unchanged:
        click.echo(f"unchanged {path}")
    for path in result.removed:
        click.echo(f"removed   {path}")
    for warning in result.warnings:
        progress.line(f"warning: {warning}", "warning")


def _node(kw: dict) -> Node | None:
    """The group node ``--role``/``--rank`` name, None when neither is given."""
    role, rank = kw.pop("role"), kw.pop("rank")
    if role is None:
        if rank is not None:
            raise UsageError("--rank goes with --role worker or both")
        return None
    return Node(roles=("head", "worker") if role == "both" else (role,), rank=rank or 1)


def node_options(f):
    """``--role`` and ``--rank``: which node of a multi-node group this host runs."""
    f = click.option("--rank", type=click.IntRange(min=1), help="A worker's node rank [1].")(f)
    return click.option(
        "--role",
        type=click.Choice(["head", "worker", "both"]),
        help="A multi-node profile: the node(s) of the group NAME this host runs (both: the "
        "head and its worker on this one host) [head].",
    )(f)


@click.command()
@click.argument("name", metavar="NAME")
@instance_options(profile_required=True)
@node_options
@click.option("--out", "-o", required=True, type=OutputPath(directory=True), help="Output dir.")
def render(profile: str, name: str, out: Path, **kw) -> None:
    """Render NAME's units, env and args files and the serve program into --out, as install
    would lay them out under --root."""
    node = _node(kw)
    _report(installer.render_to(profile, name, out, _options(kw), node=node))


@click.command()
@click.argument("name", metavar="NAME")
@instance_options(profile_required=False)
@node_options
@root_option
@click.option(
    "--host-check",
    "host_check",
    is_flag=True,
    help="Check the host first under another --root too (it always runs when --root is /).",
)
@click.option(
    "--force",
    metavar="REASON",
    help="Install despite the host check's blockers; REASON is printed with each of them.",
)
@click.option(
    "--share-gpus",
    "share_gpus",
    metavar="REASON",
    help="Let --gpus overlap another instance's GPUs; REASON is printed.",
)
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help='One JSON object: {"written": [...], "unchanged": [...], "removed": [...], '
    '"changed": ..., "next_step": ...} (what the fleet role reads).',
)
def install(
    profile: str | None,
    name: str,
    root: Path,
    host_check: bool,
    force: str | None,
    share_gpus: str | None,
    json_: bool,
    **kw,
) -> None:
    """Install NAME: the shared unit and serve program, its env file (values kept), args file,
    mounts drop-in and API key (0600), and a copy of a --profile FILE beside it. A multi-node
    profile installs this host's node(s) of the group NAME (--role, --rank; default: the ones
    this host runs, else the head), the same way. The port is the profile's, or the next one
    no other NAME here serves on. Refuses, writing nothing, when `appliance host check` finds a
    blocker (unless --force), and while a cutover of NAME holds its lock (exit 3). Without
    --profile: the one the env file names (its kept copy), or for a new instance on a GPU host
    the one `appliance profiles suggest` puts first (said on stderr). A new GPU instance (or
    group node) gets the next free GPUs (or MIG slice) of its profile's kind, by UUID in its
    env file (said on stderr); a --gpus that overlaps another's is refused unless --share-gpus
    REASON. The `next:` line names what is still to do: enable what was never enabled,
    restart what changed, pull a changed model first.

    \b
    Example:
      appliance instance install 31b --profile l4x4-31b-mtp --image gemma4-vllm:0.32.0-mtp
      systemctl daemon-reload && systemctl enable --now gemma4-vllm@31b
    """
    node = _node(kw)
    checked: list[hostcheck.Report] = []
    check = host_check or root == Path("/")
    if profile is None and node is None and check and units.named_profile(root, name) is None:
        # This host's GPUs choose (under another --root only with --host-check: its GPUs are
        # this host's then too).
        profile, said = hostcheck.suggested(
            f"instance {name} names no profile", "say which: --profile NAME"
        )
        click.echo(said, err=True)

    def preflight(plan: units.Planned) -> None:
        command = f"appliance host check {name} --profile {plan.profile.name}"
        if root != Path("/"):
            command += f" --root {root}"
        checked.append(hostcheck.gate(plan, force=force, command=command))

    done = installer.install(
        profile,
        name,
        root=root,
        options=_options(kw),
        node=node,
        preflight=preflight if check else None,
        share_gpus=share_gpus,
    )
    if done.devices:
        click.echo(done.devices, err=True)
    for blocker in checked[0].blockers if checked else ():
        progress.line(f"warning: installed despite {blocker.line()} (--force: {force})", "warning")
    if json_:
        _report(done.result, json_, next_step=done.next_step, devices=done.devices)
        return
    _report(done.result)
    if done.next_step:
        click.echo(f"next: {done.next_step}")


@click.command()
@click.argument("name", metavar="NAME")
@click.option("--purge", is_flag=True, help="Also remove its cutover history and rollback slot.")
@root_option
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help='One JSON object: {"removed": [...], "written": [...], "changed": ...}.',
)
def uninstall(name: str, purge: bool, root: Path, json_: bool) -> None:
    """Stop and disable NAME (an instance, or this host's nodes of a group) and remove what
    install wrote for it (a shared unit and the serve program with the last instance that uses
    them), then rewrite the state-metrics textfile without it. systemctl is called for / (or
    the tree's own systemd, APPLIANCE_SYSTEMD_PREFIX)."""
    systemd = Systemd.for_root(root)
    result = units.uninstall(name, root=root, purge=purge, systemd=systemd)
    written = cutover_metrics.refresh(Layout(root), systemd)
    if written is not None:
        result.written.append(written)
    _report(result, json_)
