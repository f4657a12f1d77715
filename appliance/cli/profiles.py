"""``appliance profiles``: the shipped serving profiles, their validation, and the ones that fit
this host."""

from __future__ import annotations

import dataclasses
import shlex

import click

from .. import profiles as prof
from ..errors import ApplianceError, UsageError
from ..profiles import validate as pv
from ..tables import table
from .output import echo_json


@click.group()
def profiles() -> None:
    """Serving profiles per host."""


def _status(findings: list[pv.Finding], shared: list[pv.Finding] = ()) -> str:
    """``ok``, ``N error(s)`` or ``N warning(s)``, counting the warnings not in ``shared`` (said
    once for the run); a ``*`` when the profile has one of those."""
    n_err, n_warn = len(pv.errors(findings)), len(set(pv.warnings(findings)) - set(shared))
    mark = "*" if set(findings) & set(shared) else ""
    if n_err:
        return f"{n_err} error(s){mark}"
    return f"{n_warn} warning(s){mark}" if n_warn else f"ok{mark}"


def _shared_lines(shared: list[pv.Finding], checked: list[list[pv.Finding]]) -> list[str]:
    """One line per warning several profiles share, with how many."""
    return [
        f"* {sum(f in found for found in checked)} of {len(checked)} profiles: {f}" for f in shared
    ]


@profiles.command(name="list")
@click.option("--json", "json_", is_flag=True, help='One JSON object: {"profiles": [...]}.')
def profiles_list(json_: bool) -> None:
    """List the shipped profiles with their validation status."""
    shipped = sorted(prof.all_profiles().items())
    if json_:
        rows = []
        for name, p in shipped:
            findings = pv.check(p)
            errors = len(pv.errors(findings))
            rows.append(
                {
                    "name": name,
                    "mtp": p.mtp,
                    "num_speculative_tokens": (
                        p.speculative.num_speculative_tokens if p.mtp else None
                    ),
                    "errors": errors,
                    "warnings": len(findings) - errors,
                    "description": p.description,
                }
            )
        echo_json({"profiles": rows})
        return
    checked = [pv.check(p) for _, p in shipped]
    shared = pv.shared(checked)
    rows = [
        (
            name,
            f"mtp k={p.speculative.num_speculative_tokens}" if p.mtp else "no-spec",
            _status(found, shared),
            p.description,
        )
        for (name, p), found in zip(shipped, checked, strict=True)
    ]
    click.echo(table(("PROFILE", "SPEC", "STATUS", "DESCRIPTION"), rows))
    for line in _shared_lines(shared, checked):
        click.echo(line)


@profiles.command(name="show")
@click.argument("profile", metavar="PROFILE")
@click.option("--json", "json_", is_flag=True, help="The command's argv and the findings as JSON.")
def profiles_show(profile: str, json_: bool) -> None:
    """Print the exact `vllm serve` command of PROFILE, a shipped one or a TOML file of
    yours (a path: ./mine.toml); its memory fit per GPU, where its values come from (measured,
    or a seed's unverified shape) and the findings on stderr."""
    p = prof.lookup(profile)
    model_dir = "$DEVMODEL" if p.uses_devmodel else None
    argv = ["vllm", "serve", *p.serve_args(devmodel=model_dir), *p.queue_args()]
    fit = pv.estimated_fit(p)
    seqs = pv.sequences(p)
    if json_:
        findings = [dataclasses.asdict(f) for f in pv.check(p)]
        shown = {"fit": fit.line() if fit else None, "provenance": p.provenance or "computed"}
        shown["sequences"] = [{"max_model_len": n, "fit": k} for n, k in seqs]
        echo_json({"name": p.name, "argv": argv, **shown, "findings": findings})
        return
    click.echo(shlex.join(argv))
    # Beside the command, not in it: stdout stays the one line a script runs.
    if fit is not None:
        click.echo(f"fit per GPU (appliance/profiles/fit.py): {fit.line()}", err=True)
    if seqs:
        # The trade of context for concurrent callers (a rank's, for a data-parallel one).
        stated = p.max_num_seqs if p.max_num_seqs is not None else "vLLM's"
        bound = p.queue_bound if p.queue_bound is not None else "none"
        fits = ", ".join(f"{k} of {n} tokens" for n, k in seqs)
        click.echo(
            f"sequences: max_num_seqs {stated}, queue bound {bound}; the fit holds at once "
            f"{fits} (full-length sequences)",
            err=True,
        )
    if p.provenance:
        click.echo(f"values {p.provenance}", err=True)
    for finding in pv.check(p):
        click.echo(str(finding), err=True)


@profiles.command(name="validate")
@click.argument("names", nargs=-1, metavar="[PROFILE]...")
@click.option(
    "files",
    "--file",
    "-f",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="A profile TOML file to validate (repeatable).",
)
@click.option("--vllm-version", help="Also check against this vLLM version (e.g. an image's).")
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help='One JSON object: {"profiles": [{"name", "ok", "findings"}...], "shared": [...]} '
    "(shared: the warnings several of them hold, said once in the text).",
)
def profiles_validate(
    names: tuple[str, ...], files: tuple[str, ...], vllm_version: str | None, json_: bool
) -> None:
    """Validate each PROFILE and --file TOMLs (default: every shipped one); exit 1 on errors."""
    selected = [prof.lookup(n) for n in names] + [prof.load_file(f) for f in files]
    if not selected:
        selected = list(prof.all_profiles().values())
    checked = [pv.check(p, vllm_version=vllm_version) for p in selected]
    shared = pv.shared(checked)
    if json_:
        rows = [
            {
                "name": p.name,
                "ok": not pv.errors(findings),
                "findings": [dataclasses.asdict(f) for f in findings],
            }
            for p, findings in zip(selected, checked, strict=True)
        ]
        echo_json({"profiles": rows, "shared": [dataclasses.asdict(f) for f in shared]})
        if not all(row["ok"] for row in rows):
            raise click.exceptions.Exit(1)
        return
    failed = 0
    for p, findings in zip(selected, checked, strict=True):
        failed += bool(pv.errors(findings))
        click.echo(f"{p.name}: {_status(findings, shared)}")
        for finding in findings:
            if finding not in shared:
                click.echo(f"  {finding}")
    for line in _shared_lines(shared, checked):
        click.echo(line)
    if failed:
        raise click.exceptions.Exit(1)


@profiles.command(name="suggest")
@click.option("--json", "json_", is_flag=True, help="The GPUs, the best and every profile's why.")
def profiles_suggest(json_: bool) -> None:
    """The shipped profiles that fit this host's GPUs (nvidia-smi), best first, one line of
    why each; then why the others do not. Exit 1 when none fits, a host without a GPU
    nvidia-smi lists included.

    \b
    Example:
      appliance profiles suggest
      appliance instance install 31b --profile "$(appliance profiles suggest --json | jq -r .best)"
    """
    from ..hostcheck import suggest

    try:
        found = suggest.suggest()
    except UsageError as exc:  # no GPU to judge: nothing fits this host, a refusal (exit 1)
        raise ApplianceError(exc.message, fix=exc.fix) from None
    if json_:
        echo_json(found.to_dict())
    else:
        click.echo(found.text())
    if found.best is None:
        raise click.exceptions.Exit(1)
