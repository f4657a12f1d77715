"""``appliance fleet``: what the fleet playbooks (deploy/ansible) run on each host. Thin."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click

from ..errors import ApplianceError, UsageError
from ..fleet import hosts, soak
from ..fsutil import write_atomic
from ..host import reach
from ..observability import scrape
from ..units.instance import read as read_instance
from .options import OutputPath, root_option
from .output import echo_json


@click.group(name="fleet")
def fleet() -> None:
    """Per-host steps of a fleet rollout: counters before a cutover, the canary's soak, status."""


def _instance(root: Path, name: str, inst=None):
    """NAME's record (``inst`` when already read) and key; refused under a tree whose port is
    not its instance's on this host."""
    inst = read_instance(root, name) if inst is None else inst
    if not reach.ports(root):  # a tree's port on this host is not its instance's
        raise reach.port_refusal(root, url=False)
    return inst, inst.api_key()


@fleet.command(name="snapshot")
@click.argument("name", metavar="NAME")
@click.option(
    "--out",
    type=OutputPath(),
    required=True,
    help="Where to write the reading (JSON): the soak's pre-cutover figures.",
)
@root_option
def snapshot(name: str, out: Path, root: Path) -> None:
    """Save NAME's vLLM counters now (before a cutover), for `fleet soak --before`."""
    inst, key = _instance(root, name)
    reading = soak.read(inst.base_url, key)
    write_atomic(out, soak.dumps(reading))
    w = soak.window(None, reading)
    click.echo(
        f"{name}: {w.requests} answers, {w.spec.drafts or 0} drafts, acceptance "
        f"{soak._pct(w.spec.acceptance)} since the server started -> {out}"
    )


@fleet.command(name="soak")
@click.argument("name", metavar="NAME")
@click.option(
    "--before",
    "before_file",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    required=True,
    help="The reading `fleet snapshot` saved before the cutover.",
)
@click.option("--seconds", type=click.FloatRange(min=0), default=60.0, show_default=True)
@click.option(
    "--probe-requests",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Requests the soak sends itself, spread over the window (for a canary without "
    "traffic of its own).",
)
@click.option("--max-acceptance-drop", type=float, default=0.10, show_default=True)
@click.option("--max-tokens-per-step-drop", type=float, default=0.10, show_default=True)
@click.option("--max-error-rate-rise", type=float, default=0.01, show_default=True)
@click.option("--min-drafts", type=int, default=10, show_default=True)
@click.option("--min-requests", type=int, default=3, show_default=True)
@click.option("--json", "json_", is_flag=True, help="Print the verdict as JSON.")
@root_option
def soak_(
    name: str,
    before_file: Path,
    seconds: float,
    probe_requests: int,
    max_acceptance_drop: float,
    max_tokens_per_step_drop: float,
    max_error_rate_rise: float,
    min_drafts: int,
    min_requests: int,
    json_: bool,
    root: Path,
) -> None:
    """Soak NAME after its cutover; exit 1 when it regressed against --before."""
    thresholds = soak.Thresholds(
        max_acceptance_drop, max_tokens_per_step_drop, max_error_rate_rise, min_drafts, min_requests
    )
    inst = read_instance(root, name)
    # Bad input first: a reading that cannot be used is refused before the host is asked.
    before = soak.loads(before_file.read_text(), str(before_file))
    inst, key = _instance(root, name, inst)
    run = soak.Soak(inst.base_url, inst.served_model, key, seconds, probe_requests)
    run.thresholds = thresholds
    verdict = soak.run(run, before, progress=lambda m: click.echo(m, err=True))
    if json_:
        echo_json(verdict.to_dict())
    else:
        b, s = verdict.before, verdict.soak
        for label, w in (("before", b), ("soak", s)):
            click.echo(
                f"{label:>6}: {w.requests} answers, error rate {soak._pct(w.error_rate)}, "
                f"{w.spec.drafts or 0} drafts, acceptance {soak._pct(w.spec.acceptance)}, "
                f"tokens per step {soak._pct(w.spec.tokens_per_step)}"
            )
        for note in verdict.notes:
            click.echo(f"  note: {note}")
    if not verdict.ok:
        raise ApplianceError(
            f"{name}: the soak found a regression: " + "; ".join(verdict.regressions),
            fix="the rollout stops; the playbook rolls back every host it cut over",
        )
    click.echo(f"{name}: soak passed")


@fleet.command(name="status")
@click.argument("name", metavar="NAME")
@click.option("--json", "json_", is_flag=True, help="One JSON object.")
@root_option
def status(name: str, json_: bool, root: Path) -> None:
    """NAME on this host: env file's image, running container's image, MTP, acceptance."""
    st = hosts.host_status(name, root)
    if json_:
        echo_json(st.to_dict())
        return
    for key, value in st.to_dict().items():
        click.echo(f"{key:>16}: {'-' if value is None else value}")


@fleet.command(name="targets")
@click.argument(
    "inventory",
    type=click.Path(path_type=Path, exists=True, dir_okay=False, allow_dash=True),
)
@click.option("--group", default=hosts.DEFAULT_GROUP, show_default=True)
@click.option(
    "--out",
    type=OutputPath(),
    default=None,
    help="The file_sd JSON to write (default: stdout).",
)
@click.option(
    "--state-out",
    type=OutputPath(),
    default=None,
    help="Also write each host's appliance-state target (labelled host) to this file_sd JSON.",
)
def targets(inventory: Path, group: str, out: Path | None, state_out: Path | None) -> None:
    """Prometheus file_sd targets for INVENTORY (`ansible-inventory --list` JSON; - = stdin)."""
    raw = sys.stdin.buffer.read() if str(inventory) == "-" else inventory.read_bytes()
    try:
        data = json.loads(raw.decode())  # UnicodeDecodeError is a ValueError
    except ValueError as exc:
        raise UsageError(f"{inventory}: not JSON: {exc}") from None
    rendered = hosts.render_targets(hosts.targets_from_inventory(data, group))
    if state_out is not None:
        state = hosts.render_targets(hosts.state_targets_from_inventory(data, group))
        write_atomic(state_out, state)
        click.echo(f"{state_out}: {len(json.loads(state))} hosts' state", err=out is None)
    if out is None:
        click.echo(rendered, nl=False)
    else:
        write_atomic(out, rendered)
        click.echo(f"{out}: {len(json.loads(rendered))} hosts")


_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")  # Prometheus' duration syntax


@fleet.command(name="scrape-config")
@click.option("--host", "host", required=True, help="This host's inventory name: label `host`.")
@click.option(
    "--remote-write",
    required=True,
    help="The central Prometheus' remote-write URL (http://HOST:9090/api/v1/write; it runs "
    "with --web.enable-remote-write-receiver).",
)
@click.option(
    "--state-port",
    type=click.IntRange(1, 65535),
    default=9100,
    show_default=True,
    help="node_exporter's port on 127.0.0.1 (the appliance state's textfile collector).",
)
@click.option("--scrape-interval", default="15s", show_default=True)
@click.option("--remote-write-user", "username", help="Basic auth: the user name.")
@click.option(
    "--remote-write-password-file",
    "password_file",
    metavar="FILE",
    help="Basic auth: the file holding the password (never the password itself).",
)
@click.option(
    "--remote-write-bearer-token-file",
    "bearer_token_file",
    metavar="FILE",
    help="The file holding a bearer token (Authorization: Bearer).",
)
@click.option("--remote-write-ca-file", "ca_file", metavar="FILE", help="TLS: the CA to trust.")
@click.option(
    "--remote-write-cert-file", "cert_file", metavar="FILE", help="TLS: a client certificate."
)
@click.option("--remote-write-key-file", "key_file", metavar="FILE", help="TLS: its key.")
@click.option(
    "--remote-write-server-name", "server_name", help="TLS: the name the server's certificate has."
)
@click.option(
    "--out",
    type=OutputPath(),
    default=None,
    help="The config to write (default: stdout), 0600; says `wrote` or `unchanged`.",
)
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help='With --out: one JSON object, {"written": [...], "unchanged": [...], "changed": ...} '
    "(what the fleet role reads).",
)
def scrape_config(
    host: str,
    remote_write: str,
    state_port: int,
    scrape_interval: str,
    out: Path | None,
    json_: bool,
    **auth: str | None,
) -> None:
    """This host's Prometheus agent config: its loopback engines and state, labelled --host,
    written to the central server (engines never listen beyond loopback).

    Credentials come from files only, never from the URL or the command line. A relative FILE
    is the agent's: Prometheus resolves it against the config's folder (--out's), where it
    must be; the Ansible role lays them there (0600) and hands them to the agent's unit."""
    if not _DURATION.match(scrape_interval):
        raise UsageError(f"--scrape-interval {scrape_interval!r} is not a Prometheus duration")
    if json_ and out is None:  # stdout is the config itself
        raise UsageError("--json goes with --out", fix="add --out FILE")
    targets = scrape.ScrapeTargets(
        engine_files=scrape.AGENT_TARGETS.engine_files,
        state=(f"127.0.0.1:{state_port}",),
        scrape_interval=scrape_interval,
    )
    creds = scrape.RemoteWriteAuth(**auth)
    folder = out.parent if out is not None else Path.cwd()
    for option, name in creds.files().items():
        if not (folder / name).is_file():
            raise UsageError(
                f"--remote-write-{option.replace('_', '-')} {name}: no such file in {folder}",
                fix="a relative FILE is read from the config's folder (--out's)",
            )
    text = scrape.render_agent(scrape.AgentConfig(host, remote_write, targets, creds))
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        same = out.read_text() == text
    except FileNotFoundError:
        same = False
    same = same and (out.stat().st_mode & 0o777) == 0o600
    if not same:
        # Root's alone: it names the credential files; the agent's unit gets it through
        # LoadCredential= (deploy/ansible's gemma4-prometheus-agent.service).
        write_atomic(out, text, mode=0o600)
    if json_:  # the shape of instance install's --json
        done = {"written": [], "unchanged": [out]} if same else {"written": [out], "unchanged": []}
        echo_json({**done, "changed": not same})
        return
    click.echo(f"{'unchanged' if same else 'wrote'} {out}")
