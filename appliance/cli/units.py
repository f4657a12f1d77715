"""``appliance render``, ``install`` and ``uninstall``: an instance's unit,
env file, args file and the shared serve program, from a profile."""

from __future__ import annotations

from pathlib import Path

import click

from .. import hostcheck, units
from ..cutover import metrics as cutover_metrics
from ..host.layout import Layout
from ..host.systemd import Systemd
from .options import OutputPath, instance_name, root_option


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
                    "--image", help="VLLM_IMAGE (default: kept, else gemma4-vllm:latest)."
                ),
                click.option("--gpus", help="docker --gpus value (MIG profiles: device=GPU:MIG)."),
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


def _report(result: units.WriteResult) -> None:
    for path in result.written:
        click.echo(f"wrote     {path} ({path.stat().st_mode & 0o777:o})")
    for path in result.unchanged:
        click.echo(f"unchanged {path}")
    for path in result.removed:
        click.echo(f"removed   {path}")
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)


@click.command()
@instance_name
@instance_options(profile_required=True)
@click.option("--out", "-o", required=True, type=OutputPath(directory=True), help="Output dir.")
def render(profile: str, instance: str, out: Path, **kw) -> None:
    """Render instance NAME's unit, env and args files and the serve program into --out."""
    _report(units.render_to(profile, instance, out, _options(kw)))


@click.command()
@instance_name
@instance_options(profile_required=False)
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
def install(
    profile: str | None, instance: str, root: Path, host_check: bool, force: str | None, **kw
) -> None:
    """Install instance NAME: the shared unit and serve program, its env file (values kept),
    args file and API key (0600). Upgrades an instance installed by the old layout in place.
    Refuses, writing nothing, when `appliance host check` finds a blocker (unless --force).

    \b
    Example:
      appliance install 31b --profile l4x4-31b-mtp --image gemma4-vllm:0.32.0-mtp
      systemctl daemon-reload && systemctl enable --now gemma4-vllm@31b
    """
    checked: list[hostcheck.Report] = []

    def preflight(plan: units.Planned) -> None:
        command = f"appliance host check {instance} --profile {plan.profile.name}"
        if root != Path("/"):
            command += f" --root {root}"
        checked.append(hostcheck.gate(plan, force=force, command=command))

    check = host_check or root == Path("/")
    result = units.install(
        profile, instance, root=root, options=_options(kw), preflight=preflight if check else None
    )
    for blocker in checked[0].blockers if checked else ():
        click.echo(f"warning: installed despite {blocker.line()} (--force: {force})", err=True)
    _report(result)
    if result.first_install:
        # Never enabled yet: restart would start it once and leave it off at the next boot.
        click.echo(
            "next: systemctl daemon-reload && systemctl enable --now "
            f"{units.unit_name(instance)} {units.STATE_UNIT}.timer"
        )
    elif result.changed:
        # Until the reload, systemd runs the unit as it last read it (after an upgrade: with
        # the per-instance script that is gone now).
        click.echo(
            f"next: systemctl daemon-reload && systemctl restart {units.unit_name(instance)}"
        )


@click.command()
@instance_name
@click.option("--purge", is_flag=True, help="Also remove its cutover history and rollback slot.")
@root_option
def uninstall(instance: str, purge: bool, root: Path) -> None:
    """Stop and disable instance NAME and remove what install wrote for it (the shared unit and
    serve program with the last instance). systemctl is called only when --root is /."""
    systemd = Systemd.from_env() if root == Path("/") else None
    _report(units.uninstall(instance, root=root, purge=purge, systemd=systemd))
    written = cutover_metrics.refresh(Layout(root), systemd)
    if written is not None:
        click.echo(f"wrote     {written}")
