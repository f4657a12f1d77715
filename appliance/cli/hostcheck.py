"""``appliance host check``: is this host ready for an instance? (appliance/hostcheck)"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import hostcheck
from . import CONTEXT
from .options import root_option
from .output import echo_json
from .units import _options, instance_options


@click.group(context_settings=CONTEXT)
def host() -> None:
    """The host an instance runs on."""


@host.command("check")
@click.argument("name", required=False, metavar="[NAME]")
@instance_options(profile_required=False)
@root_option
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def host_check(name: str | None, profile: str | None, root: Path, as_json: bool, **kw) -> None:
    """Check this host for instance NAME as `appliance instance install` would install it
    (installed or not), or for --profile P alone, or with neither for the profile `appliance
    profiles suggest` puts first for this host's GPUs (where none can be, the host alone: its
    driver, GPUs and Docker): NVIDIA driver and GPUs, Docker and its GPU access, disk for the
    weights, the port, systemd, the user, Python with venv, node_exporter, the API key file.
    Read-only; one line per finding with its fix; exit 1 on any blocker.

    \b
    Examples:
      appliance host check 31b --profile l4x4-31b-mtp
      appliance host check --profile cpu-tiny-mtp --json
      appliance host check
    """
    if name is None and profile is None:
        report, said = hostcheck.check_suggested(root=root, options=_options(kw))
        if said:
            click.echo(said, err=True)
    else:
        report = hostcheck.check(profile, name, root=root, options=_options(kw))
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(report.text())
    sys.exit(0 if report.ok else 1)
