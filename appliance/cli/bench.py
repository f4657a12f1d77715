"""``appliance bench``: TTFT, TPOT, ITL and MTP figures; paired MTP vs baseline; k sweep."""

from __future__ import annotations

import json

import click

from .. import acceptance, instance_facts, reports
from ..bench import concurrency as concurrency_lib
from ..bench import prompts, report, runner, sweep
from ..devmodel import DRAFTER_KINDS
from ..endpoint import Endpoint
from ..errors import ApplianceError, UsageError
from ..profiles import get
from .options import OutputPath, endpoint_options, progress_bar, prompt_options


def _k_urls(values: tuple[str, ...]) -> dict[int, str]:
    out = {}
    for v in values:
        k, sep, url = v.partition("=")
        if not sep or not k.strip().isdigit() or not url:
            raise UsageError(f"--k-url wants K=URL, not {v!r}")
        out[int(k)] = url
    return out


@click.command()
@endpoint_options(
    profile_help="Profile recorded in the artifact; the sweep's profile (default cpu-tiny-mtp).",
    default_url=None,
)
@click.option("--mtp-url", default=None, help="Paired: the MTP endpoint ...")
@click.option("--baseline-url", default=None, help="... and the same model without MTP.")
@click.option(
    "--sweep-k",
    default=None,
    help="k sweep, e.g. 1,2,3,4 (local CPU engine, or --k-url per k on a GPU host).",
)
@click.option(
    "--max-acceptance-drop",
    type=float,
    default=None,
    help="Paired, when the baseline drafts too: the largest median drop in acceptance "
    "(default: the profile's [canary] figure, else 0.1); beyond it the bench exits 1.",
)
@click.option(
    "--concurrency",
    default=None,
    metavar="N,N,...",
    help="Bench NAME/--url under load: per level N (e.g. 1,4,16) keep N requests in flight "
    "(paced like vllm bench serve --max-concurrency N); per level output tok/s, TTFT/TPOT/ITL "
    "median and p99, acceptance, tok/step, per position.",
)
@click.option(
    "--requests",
    type=int,
    default=None,
    help="Measured requests per concurrency level (default: 4 per slot, at least every prompt "
    "once); each level starts with N warm-up requests.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON record instead of Markdown.")
@click.option("--k-url", multiple=True, help="K=URL: an already running server for that k.")
@click.option(
    "--drafter",
    type=click.Choice(DRAFTER_KINDS),
    default="copy",
    show_default=True,
    help="Tiny drafter for the local k sweep.",
)
@prompt_options
@click.option(
    "--max-tokens",
    multiple=True,
    type=int,
    default=(64, 256),
    show_default=True,
    help="Output lengths (repeatable).",
)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--warmups", type=int, default=1, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option(
    "--out",
    type=OutputPath(),
    default=None,
    metavar="FILE",
    help="Write the JSON artifact here (only when the bench succeeds).",
)
@click.option("--json-output", "old_out", type=OutputPath(), hidden=True)
@click.option(
    "--report",
    "report_html",
    type=OutputPath(),
    default=None,
    help="Write a self-contained HTML report (charts inline) of the same record.",
)
def bench(
    endpoint: Endpoint,
    mtp_url,
    baseline_url,
    max_acceptance_drop,
    sweep_k,
    concurrency,
    requests,
    as_json,
    k_url,
    drafter,
    sets,
    prompt_file,
    limit,
    max_tokens,
    runs,
    warmups,
    temperature,
    seed,
    out,
    old_out,
    report_html,
) -> None:
    """Measure an endpoint, MTP against its baseline, or several k; Markdown on stdout.

    NAME: an installed instance, benched on its own URL with its key, its profile and its image's
    labels recorded.

    \b
    Examples:
      appliance bench 31b --runs 5
      appliance bench --url http://127.0.0.1:8050 --runs 5
      appliance bench --mtp-url http://127.0.0.1:8001 --baseline-url http://127.0.0.1:8002
      appliance bench --sweep-k 1,2,3,4 --limit 1 --max-tokens 64
      appliance bench --url http://127.0.0.1:8050 --concurrency 1,4,16 --requests 64

    \b
    Figures (vLLM's definitions; see gotchas/benchmarking-mtp.md):
      tok/step       1 + accepted / drafts: tokens one engine step yields (bonus included)
      per position   accepted at draft position i / drafts (prefix acceptance: falls with i)
      predicted      tok/step at every k' <= k from one run at k: 1 + the first k' positions
      TTFT           send -> first streamed chunk carrying a choice
      TPOT           (E2EL - TTFT) / (usage tokens - 1), E2EL: send -> last such chunk
      ITL            gap between chunks: one engine step (1 + accepted tokens) under MTP
      out tok/s      under --concurrency: usage tokens of the level over its duration (first
                     request queued -> last done, as vllm bench serve times it)
    On the CPU engine these say the arithmetic is right, not how a GPU scales: a CPU step costs
    about k times a token, a GPU step is nearly free up to its compute bound.
    """
    if old_out is not None:
        click.echo(f"warning: --json-output is deprecated: write --out {old_out}", err=True)
        out = out or old_out
    url, instance = endpoint.url, endpoint.instance
    modes = [bool(url), bool(mtp_url or baseline_url), bool(sweep_k)]
    if sum(modes) != 1:
        raise UsageError(
            "give exactly one of NAME (or --url), --mtp-url with --baseline-url, --sweep-k"
        )
    if bool(mtp_url) != bool(baseline_url):
        raise UsageError("paired bench needs both --mtp-url and --baseline-url")
    # Validate every input before touching a server: bad input costs nothing and writes nothing.
    sets_list = [s.strip() for s in sets.split(",") if s.strip()]
    config = runner.BenchConfig(
        tuple(prompts.resolve(sets_list, tuple(prompt_file), limit)),
        tuple(max_tokens),
        runs,
        warmups,
        temperature,
        seed,
    )
    profile = endpoint.profile
    if max_acceptance_drop is None:
        max_acceptance_drop = profile.canary.max_acceptance_drop if profile else 0.1
    tolerance = acceptance.Tolerance(max_acceptance_drop)
    levels = concurrency_lib.parse_levels(concurrency) if concurrency else None
    if levels and not url:
        raise UsageError("--concurrency benches one endpoint: give NAME or --url")
    if levels and report_html:
        raise UsageError("--report does not draw --concurrency yet: use --out or --json")
    if requests is not None and requests < 1:
        raise UsageError("--requests must be at least 1")
    # One key for every endpoint given by URL (the local sweep's engines have none).
    secret = endpoint.secret
    labels = instance_facts.read(instance, endpoint.root).image_labels if instance else None
    env = report.environment(profile, labels)

    if sweep_k:
        ks = sweep.parse_ks(sweep_k)
        urls = _k_urls(k_url)
        if urls and sorted(urls) != sorted(ks):
            raise UsageError("--k-url must name exactly the k values of --sweep-k")
        per_k = config.measured_requests + config.warmups
        with progress_bar(per_k * len(ks), "sweep") as tick:
            if urls:
                result = sweep.sweep_urls(urls, config, tick, api_key=secret)
            else:
                prof = profile or get("cpu-tiny-mtp")
                result = sweep.sweep_local(
                    prof,
                    ks,
                    config,
                    drafter=drafter,
                    progress=tick,
                    on_start=lambda k: click.echo(f"\nstarting {prof.name} with k={k}", err=True),
                )
        kind = "sweep"
    elif url and levels:
        ep = runner.open_endpoint(url, "endpoint", secret)
        count = requests or 0
        total = sum(count or max(4 * n, config.measured_requests) for n in levels)
        with progress_bar(total, "concurrency") as tick:
            result = concurrency_lib.run_concurrency(ep, config, levels, requests, tick)
        kind = "concurrency"
    elif url:
        ep = runner.open_endpoint(url, "endpoint", secret)
        with progress_bar(config.measured_requests + config.warmups, "bench") as tick:
            result = runner.run_endpoint(ep, config, tick)
        kind = "single"
    else:
        mtp = runner.open_endpoint(mtp_url, "mtp", secret)
        base = runner.open_endpoint(baseline_url, "baseline", secret)
        with progress_bar(2 * (config.measured_requests + config.warmups), "paired") as tick:
            result = runner.run_paired(mtp, base, config, tick, tolerance)
        kind = "paired"
    if out:
        report.write_artifact(out, report.artifact(kind, config, env, result))
    if report_html:  # rendered from the artifact's record: one source for the page and the JSON
        reports.write(report_html, reports.render_bench(report.artifact(kind, config, env, result)))
    if as_json:
        click.echo(json.dumps(report.artifact(kind, config, env, result), indent=2, sort_keys=True))
    else:
        click.echo(report.markdown(kind, result))
    if kind == "paired" and (failed := result.acceptance_failures()):
        raise ApplianceError(f"the MTP side drafts worse than the baseline: {'; '.join(failed)}")
