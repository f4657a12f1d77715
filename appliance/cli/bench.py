"""``appliance bench run|compare|sweep|load|tune``: TTFT, TPOT, ITL and MTP figures of one
endpoint, MTP against its baseline, several k, one endpoint under load, and k per batch size."""

from __future__ import annotations

import functools

import click

from .. import progress, reports
from ..bench import concurrency as concurrency_lib
from ..bench import prompts, report, runner, sweep
from ..engine.devmodel import DRAFTER_KINDS
from ..engine_api.vllm_client import engine_url
from ..errors import ApplianceError, UsageError
from ..instance import instance_facts
from ..instance.endpoint import Endpoint
from ..judge import acceptance
from ..profiles import get
from .addresses import ENGINE_URL
from .options import OutputPath, endpoint_options, progress_bar, prompt_options
from .output import echo_json
from .tune import tune

TABLE = """\b
Figures (vLLM's definitions; see gotchas/benchmarking-mtp.md):
  tok/step       1 + accepted / drafts: tokens one engine step yields (bonus included)
  per position   accepted at draft position i / drafts (prefix acceptance: falls with i)
  predicted      tok/step at every k' <= k from one run at k: 1 + the first k' positions
  TTFT           send -> first streamed chunk carrying a choice
  TPOT           (E2EL - TTFT) / (usage tokens - 1), E2EL: send -> last such chunk
  ITL            gap between chunks: one engine step (1 + accepted tokens) under MTP"""
CPU_NOTE = """On the CPU engine these say the arithmetic is right, not how a GPU scales:
a CPU step costs about k times a token, a GPU step is nearly free up to its compute bound."""


def figures(*rows: str) -> str:
    """The help's table of the figures bench prints (``rows``: a command's own, added)."""
    return "\n".join([TABLE, *rows, CPU_NOTE])


@click.group()
def bench() -> None:
    """Measure an engine: one endpoint, MTP against its baseline, several k, under load; tune k.

    \b
    Examples:
      appliance bench run 31b --runs 5
      appliance bench compare --mtp-url http://127.0.0.1:8001 --baseline-url http://127.0.0.1:8002
      appliance bench sweep --k 1,2,3,4 --limit 1 --max-tokens 64
      appliance bench load 31b --concurrency 1,4,16 --requests 64
      appliance bench tune 31b --baseline-url http://127.0.0.1:8002 --write 31b-tuned.toml
    """


def bench_options(*, report_page: bool = True):
    """What every bench subcommand sends and writes: the prompts, --max-tokens, --runs,
    --warmups, --temperature, --seed, --json, --out (and, where drawn, --report). The command
    receives them as one ``settings`` dict."""

    def decorate(f):
        options = [
            prompt_options,
            click.option(
                "--max-tokens",
                multiple=True,
                type=int,
                default=(64, 256),
                show_default=True,
                help="Output lengths (repeatable).",
            ),
            click.option("--runs", type=int, default=3, show_default=True),
            click.option("--warmups", type=int, default=1, show_default=True),
            click.option("--temperature", type=float, default=0.0, show_default=True),
            click.option("--seed", type=int, default=None),
            click.option(
                "--json", "as_json", is_flag=True, help="Print the JSON record instead of Markdown."
            ),
            click.option(
                "--out",
                type=OutputPath(),
                default=None,
                metavar="FILE",
                help="Write the JSON artifact here (only when the bench succeeds).",
            ),
            click.option("--json-output", "old_out", type=OutputPath(), hidden=True),
        ]
        if report_page:
            options.append(
                click.option(
                    "--report",
                    "report_html",
                    type=OutputPath(),
                    default=None,
                    help="Write a self-contained HTML report (charts inline) of the same record.",
                )
            )
        names = ("sets", "prompt_file", "limit", "max_tokens", "runs", "warmups", "temperature")
        names += ("seed", "as_json", "out", "old_out", "report_html")

        @functools.wraps(f)
        def wrapper(**kwargs):
            settings = {n: kwargs.pop(n, None) for n in names}
            return f(settings=_checked(settings), **kwargs)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


def _checked(s: dict) -> dict:
    """The settings with the config built: every input validated before a server is touched
    (bad input costs nothing and writes nothing; OutputPath checked the outputs already)."""
    if s["old_out"] is not None:
        progress.line(
            f"warning: --json-output is deprecated: write --out {s['old_out']}", "warning"
        )
        s["out"] = s["out"] or s["old_out"]
    sets = [x.strip() for x in s["sets"].split(",") if x.strip()]
    s["config"] = runner.BenchConfig(
        tuple(prompts.resolve(sets, tuple(s["prompt_file"]), s["limit"])),
        tuple(s["max_tokens"]),
        s["runs"],
        s["warmups"],
        s["temperature"],
        s["seed"],
    )
    return s


def _finish(kind: str, settings: dict, env: dict, result) -> None:
    """The artifact (--out), the page (--report) and stdout (JSON or Markdown) of one result."""
    body = report.artifact(kind, settings["config"], env, result)
    if settings["out"]:
        report.write_artifact(settings["out"], body)
    if settings["report_html"]:  # rendered from the artifact's record: one source for both
        reports.write(settings["report_html"], reports.render_bench(body))
    if settings["as_json"]:
        echo_json(body)
    else:
        click.echo(report.markdown(kind, result))


def _named(endpoint: Endpoint, command: str) -> dict:
    """The environment of a bench of NAME or --url (the instance's image labels recorded)."""
    if not endpoint.url:
        raise UsageError(f"bench {command} measures one engine: give NAME or --url")
    labels = (
        instance_facts.read(endpoint.instance, endpoint.root).image_labels
        if endpoint.instance
        else None
    )
    return report.environment(endpoint.profile, labels)


@bench.command("run", epilog=figures())
@endpoint_options(
    profile_help="Profile recorded in the artifact [default: the instance's].", default_url=None
)
@bench_options()
def bench_run(endpoint: Endpoint, settings: dict) -> None:
    """Measure one endpoint, a request at a time; Markdown on stdout.

    NAME: an installed instance, benched on its own URL with its key, its profile and its image's
    labels recorded.

    \b
    Examples:
      appliance bench run 31b --runs 5
      appliance bench run --url http://127.0.0.1:8050 --runs 5 --out bench.json
    """
    env = _named(endpoint, "run")
    config = settings["config"]
    ep = runner.open_endpoint(endpoint.url, "endpoint", endpoint.secret)
    with progress_bar(config.measured_requests + config.warmups, "bench") as tick:
        result = runner.run_endpoint(ep, config, tick)
    _finish("single", settings, env, result)


@bench.command("compare", epilog=figures())
@click.option("--mtp-url", type=ENGINE_URL, required=True, help="The MTP endpoint ...")
@click.option(
    "--baseline-url",
    type=ENGINE_URL,
    required=True,
    help="... and the same model without MTP.",
)
@click.option(
    "--max-acceptance-drop",
    type=float,
    default=None,
    help="When the baseline drafts too: the largest median drop in acceptance (default: the "
    "profile's [canary] figure, else 0.1); beyond it the bench exits 1.",
)
@endpoint_options(profile_help="Profile recorded in the artifact.", named=False)
@bench_options()
def bench_compare(
    mtp_url: str, baseline_url: str, max_acceptance_drop, endpoint: Endpoint, settings: dict
) -> None:
    """MTP against its baseline, request by request: speedup with its 95% CI, output parity.

    \b
    Examples:
      appliance bench compare --mtp-url http://127.0.0.1:8001 \\
          --baseline-url http://127.0.0.1:8002 --report bench.html
    """
    profile = endpoint.profile
    if max_acceptance_drop is None:
        max_acceptance_drop = profile.canary.max_acceptance_drop if profile else 0.1
    tolerance = acceptance.Tolerance(max_acceptance_drop)
    config = settings["config"]
    mtp = runner.open_endpoint(mtp_url, "mtp", endpoint.secret)
    base = runner.open_endpoint(baseline_url, "baseline", endpoint.secret)
    with progress_bar(2 * (config.measured_requests + config.warmups), "paired") as tick:
        result = runner.run_paired(mtp, base, config, tick, tolerance)
    _finish("paired", settings, report.environment(profile), result)
    if failed := result.acceptance_failures():
        raise ApplianceError(f"the MTP side drafts worse than the baseline: {'; '.join(failed)}")


def _k_urls(values: tuple[str, ...]) -> dict[int, str]:
    out = {}
    for v in values:
        k, sep, url = v.partition("=")
        if not sep or not k.strip().isdigit() or not url:
            raise UsageError(f"--k-url wants K=URL, not {v!r}")
        out[int(k)] = engine_url(url, f"--k-url (k={k.strip()})")
    return out


@bench.command("sweep", epilog=figures())
@click.option(
    "--k", "ks", required=True, metavar="K,K,...", help="The k values, e.g. 1,2,3,4 (1..16)."
)
@click.option(
    "--k-url", multiple=True, help="K=URL: an already running server for that k (a GPU host)."
)
@click.option(
    "--drafter",
    type=click.Choice(DRAFTER_KINDS),
    default="copy",
    show_default=True,
    help="Tiny drafter for the local k sweep.",
)
@endpoint_options(
    profile_help="The profile to sweep (default cpu-tiny-mtp), recorded in the artifact.",
    named=False,
)
@bench_options()
def bench_sweep(ks: str, k_url, drafter: str, endpoint: Endpoint, settings: dict) -> None:
    """The same bench at several k, and the k with the lowest median TPOT.

    Without --k-url it starts the local CPU engine once per k; on a GPU host start one server per
    k and give each with --k-url.

    \b
    Examples:
      appliance bench sweep --k 1,2,3,4 --limit 1 --max-tokens 64
      appliance bench sweep --k 1,2 --k-url 1=http://127.0.0.1:8001 --k-url 2=http://127.0.0.1:8002
    """
    values = sweep.parse_ks(ks)
    urls = _k_urls(k_url)
    if urls and sorted(urls) != sorted(values):
        raise UsageError("--k-url must name exactly the k values of --k")
    config = settings["config"]
    profile = endpoint.profile
    with progress_bar((config.measured_requests + config.warmups) * len(values), "sweep") as tick:
        if urls:
            result = sweep.sweep_urls(urls, config, tick, api_key=endpoint.secret)
        else:
            prof = profile or get("cpu-tiny-mtp")
            result = sweep.sweep_local(
                prof,
                values,
                config,
                drafter=drafter,
                progress=tick,
                on_start=lambda k: click.echo(f"\nstarting {prof.name} with k={k}", err=True),
            )
    _finish("sweep", settings, report.environment(profile), result)


@bench.command(
    "load",
    epilog=figures(
        "  out tok/s      usage tokens of the level over its duration (first request queued ->",
        "                 last done, as vllm bench serve times it)",
    ),
)
@endpoint_options(
    profile_help="Profile recorded in the artifact [default: the instance's].", default_url=None
)
@click.option(
    "--concurrency",
    required=True,
    metavar="N,N,...",
    help="Per level N (e.g. 1,4,16) keep N requests in flight (paced like vllm bench serve "
    "--max-concurrency N).",
)
@click.option(
    "--requests",
    type=int,
    default=None,
    help="Measured requests per level (default: 4 per slot, at least every prompt once); each "
    "level starts with N warm-up requests.",
)
@bench_options(report_page=False)
def bench_load(endpoint: Endpoint, concurrency: str, requests, settings: dict) -> None:
    """One endpoint under load: per level output tok/s, TTFT/TPOT/ITL median and p99,
    acceptance, tok/step, per position.

    \b
    Examples:
      appliance bench load 31b --concurrency 1,4,16 --requests 64
      appliance bench load --url http://127.0.0.1:8050 --concurrency 1,8 --json
    """
    levels = concurrency_lib.parse_levels(concurrency)
    if requests is not None and requests < 1:
        raise UsageError("--requests must be at least 1")
    env = _named(endpoint, "load")
    config = settings["config"]
    ep = runner.open_endpoint(endpoint.url, "endpoint", endpoint.secret)
    total = sum(requests or max(4 * n, config.measured_requests) for n in levels)
    with progress_bar(total, "concurrency") as tick:
        result = concurrency_lib.run_concurrency(ep, config, levels, requests, tick)
    _finish("concurrency", settings, env, result)


bench.add_command(tune)
