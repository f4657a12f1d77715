"""``appliance bench tune``: k per batch size from one concurrency run, as vLLM's k schedule."""

from __future__ import annotations

from pathlib import Path

import click

from .. import profiles
from ..bench import concurrency, prompts, runner
from ..bench import tune as tune_lib
from ..errors import ApplianceError, UsageError
from ..host.layout import Layout
from ..instance.endpoint import Endpoint
from ..tables import table
from .addresses import ENGINE_URL
from .options import OutputPath, endpoint_options, progress_bar, prompt_options
from .output import echo_json


def _source_text(endpoint: Endpoint, profile_name: str | None, profile: profiles.Profile) -> str:
    """The TOML text the measured profile came from: the operator's file, the instance's
    installed copy, else the shipped profile."""
    if profile_name and profiles.is_file_ref(profile_name):
        return Path(profile_name).read_text()
    if endpoint.instance and not profile_name:
        copy = Layout(endpoint.root).profile_copy(endpoint.instance)
        if copy.exists():
            return copy.read_text()
    return profiles.shipped_text(profile.name)


@click.command()
@endpoint_options(
    profile_help="The profile the MTP endpoint serves (a shipped name or a FILE) [default: the "
    "instance's].",
    default_url=None,
)
@click.option(
    "--baseline-url",
    type=ENGINE_URL,
    default=None,
    help="The same model served without MTP (not with --verify).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Read the profile's schedule back instead: bench the endpoint serving it at each level "
    "and check from the draft counters that it drafts fewer tokens per step where the schedule "
    "says so (exit 1 where it does not).",
)
@click.option(
    "--concurrency",
    "levels",
    default="1,4,16",
    show_default=True,
    metavar="N,N,...",
    help="Concurrency levels to measure; each level's k covers the batch sizes nearest it.",
)
@click.option(
    "--requests",
    type=int,
    default=None,
    help="Measured requests per level and endpoint (default: 4 per slot, at least every "
    "prompt once), after N warm-up requests.",
)
@click.option(
    "--write",
    "dest",
    type=OutputPath(),
    default=None,
    metavar="FILE",
    help="Write the profile with the schedule here (validated; atomic: a failure keeps the "
    "file that was there). Without it, tune only prints.",
)
@click.option(
    "--name",
    "new_name",
    default=None,
    help="The written profile's name [default: a shipped profile's NAME-tuned, an operator's "
    "own name].",
)
@prompt_options
@click.option("--max-tokens", multiple=True, type=int, default=(128,), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON record instead of a table.")
def tune(
    endpoint: Endpoint,
    baseline_url,
    verify,
    levels,
    requests,
    dest,
    new_name,
    sets,
    prompt_file,
    limit,
    max_tokens,
    as_json,
) -> None:
    """Choose k per batch size from one run at the profile's k, and write vLLM's schedule.

    Benches NAME (or --url), the MTP endpoint, and --baseline-url at each concurrency level,
    predicts tokens per step and TPOT for every k' <= k from that one run (prefix acceptance;
    the step cost from the baseline and the run at k), and picks the fastest k' per level: no
    server restart per k. The schedule goes into [speculative]
    num_speculative_tokens_per_batch_size of a copy of the profile (--write).

    \b
    Examples:
      appliance bench tune 31b --baseline-url http://127.0.0.1:8002 --write 31b-tuned.toml
      appliance instance install 31b --profile 31b-tuned.toml    # then restart to apply
      appliance bench tune --url http://127.0.0.1:8001 --profile l4x4-31b-mtp \\
          --baseline-url http://127.0.0.1:8002 --concurrency 1,8,32 --json
      appliance bench tune 31b --verify --concurrency 1,8,32   # after the restart

    A prediction, not a measurement of the schedule: once the tuned profile serves, --verify
    reads each level's drafts back from the engine's counters and says plainly whether the
    drafter drafts fewer tokens per step where the schedule says so. On
    the CPU engine a step costs about k times a token; on a GPU the prediction is what counts.
    """
    ctx = click.get_current_context()
    profile_name = ctx.params.get("profile_name") or None
    sets_list = [s.strip() for s in sets.split(",") if s.strip()]
    config = runner.BenchConfig(
        tuple(prompts.resolve(sets_list, prompt_file, limit)),
        tuple(max_tokens),
        runs=1,
        warmups=1,
    )
    level_list = concurrency.parse_levels(levels)
    if requests is not None and requests < 1:
        raise UsageError("--requests must be at least 1")
    if verify:
        _verify(endpoint, config, level_list, requests, as_json)
        return
    if baseline_url is None:
        raise UsageError("--baseline-url is required", fix="or read a schedule back: --verify")
    profile = tune_lib.check_profile(endpoint.profile)
    source = _source_text(endpoint, profile_name, profile) if dest else None
    name = new_name or (
        f"{profile.name}-tuned" if profile.name in profiles.all_profiles() else profile.name
    )
    if dest and source:
        tune_lib.check_writable(dest, source, profile, name)  # before minutes of measurement

    mtp = runner.open_endpoint(endpoint.url, "mtp", endpoint.secret)
    base = runner.open_endpoint(baseline_url, "baseline", endpoint.secret)
    total = 2 * sum(requests or max(4 * n, config.measured_requests) for n in level_list)
    with progress_bar(total, "tune") as tick:
        result = tune_lib.run(profile, mtp, base, config, level_list, requests, tick)
    if as_json:
        warnings = tune_lib.write(dest, source, result.tuned(name)) if dest and source else []
        out = result.to_dict() | {"written": str(dest) if dest else None, "name": name}
        echo_json(out)
    else:
        rows = [
            [
                str(c.concurrency),
                f"{c.baseline_tpot_s * 1000:.1f}",
                f"{c.mtp_tpot_s * 1000:.1f}",
                f"{c.tokens_per_step:.2f}",
                " ".join(f"{t * 1000:.1f}" for t in c.predicted_tpot_s),
                str(c.chosen_k),
                "yes" if c.mtp_pays else "no",
            ]
            for c in result.choices
        ]
        k = result.choices[0].k
        headers = [
            "concurrency",
            "baseline TPOT ms",
            f"MTP TPOT ms (k={k})",
            "tok/step",
            f"predicted TPOT ms k'=1..{k}",
            "k",
            "MTP pays",
        ]
        click.echo(table(headers, rows, ">>>>>><"))
        entries = [list(e) for e in result.schedule]
        click.echo(f"\n{tune_lib.SCHEDULE_KEY} = {entries}  ({result.wall_s:.0f} s)")
        # The table is out before the write: a failing write loses no measurement.
        warnings = tune_lib.write(dest, source, result.tuned(name)) if dest and source else []
        if dest:
            click.echo(f"wrote profile {name} to {dest}")
    for w in warnings:
        click.echo(f"  {w}", err=True)


def _verify(
    endpoint: Endpoint,
    config: runner.BenchConfig,
    levels: list[int],
    requests: int | None,
    as_json: bool,
) -> None:
    """``tune --verify``: the endpoint's drafts per level against its profile's schedule."""
    if endpoint.profile is None:
        raise UsageError(
            "--verify needs the profile the endpoint serves",
            fix="give NAME (an installed instance) or --profile NAME|FILE",
        )
    profile = endpoint.profile
    tune_lib.verify(profile, [])  # a profile without a schedule: refused before any request
    ep = runner.open_endpoint(endpoint.url, "endpoint", endpoint.secret)
    total = sum(requests or max(4 * n, config.measured_requests) for n in levels)
    with progress_bar(total, "verify") as tick:
        result = concurrency.run_concurrency(ep, config, levels, requests, tick)
    checks = tune_lib.verify(profile, result.levels)
    if as_json:
        out = {"profile": profile.name, "levels": [c.to_dict() for c in checks]}
        echo_json(out)
    else:
        for c in checks:
            click.echo(c.summary())
    ignored = [c.concurrency for c in checks if c.verdict == "ignored"]
    if ignored:
        raise ApplianceError(
            f"the drafter does not follow profile {profile.name}'s schedule at concurrency "
            f"{', '.join(map(str, ignored))}",
            fix="serve it where vLLM applies the per-batch-size k to the drafter (vLLM #57053: "
            "not the V2 model runner), or drop the schedule",
        )
