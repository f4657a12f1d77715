"""``appliance canary record|compare``: the cutover's output canary, by hand.

For a change made without ``appliance cutover`` (a raw ``systemctl restart``, a label or flag
edit): record before, change, record after, compare. The same library code as the cutover gate.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from .. import canary as lib
from ..canary import cases as canary_cases
from ..canary import record as records
from ..host import envfile
from ..host.layout import Layout
from ..instance.endpoint import Endpoint
from ..profiles import lookup
from .options import OutputPath, endpoint_options
from .output import echo_json


@click.group()
def canary() -> None:
    """Record what an endpoint answers to the canary set; compare two records."""


def _instance_image(instance: str | None, root: Path) -> str | None:
    """The image the instance's env file names (None without an instance or env file)."""
    if instance is None:
        return None
    path = Layout(root).env_file(instance)
    return envfile.read(path).get(envfile.IMAGE_KEY) if path.is_file() else None


@canary.command("record")
@endpoint_options(
    profile_help="Take max_tokens, seed and the operator's set from this profile's [canary] table."
)
@click.option(
    "--out",
    type=OutputPath(),
    required=True,
    help="Write the record (JSON) here, atomically.",
)
@click.option("--model", default=None, help="Served model name (default: the one it serves).")
@click.option(
    "--canary-file",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Your JSONL cases; they extend the shipped set (repeatable).",
)
@click.option("--replace-set", is_flag=True, help="Run only the --canary-file cases.")
@click.option("--max-tokens", type=int, default=None, help="Output length per case [64].")
@click.option("--seed", type=int, default=None, help="Sampling seed [0] (greedy either way).")
@click.option(
    "--image",
    default=None,
    help="Image reference to record (default: the instance's VLLM_IMAGE).",
)
@click.option(
    "--batched",
    is_flag=True,
    help="Then run every case at once and judge those answers against the ones alone (exit 1 "
    "when they differ): answers mixed across a batch (vLLM #46088) show only there "
    "[default: the profile's [canary] batched].",
)
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help="One JSON object: the run's figures without its answers (those are --out's), \"out\" "
    'and "batched" (the batched pass\'s verdict, null without one).',
)
def canary_record(
    endpoint: Endpoint,
    out: Path,
    model: str | None,
    canary_file: tuple[Path, ...],
    replace_set: bool,
    max_tokens: int | None,
    seed: int | None,
    image: str | None,
    batched: bool,
    json_: bool,
) -> None:
    """Run the canary set greedily against one endpoint and save the answers with token ids.

    NAME: an installed instance: its URL, profile, API key and image are used unless given.

    \b
    Example (around a raw restart):
      appliance canary record 31b --out before.json
      systemctl restart gemma4-vllm@31b
      appliance canary record 31b --out after.json
      appliance canary compare before.json after.json --profile l4x4-31b-mtp

    \b
    Answers under batching against the same engine's answers alone (vLLM #46088):
      appliance canary record 31b --out batched.json --batched
    """
    # Every input is validated before a request is sent or a file written.
    url, instance, root = endpoint.url, endpoint.instance, endpoint.root
    profile = endpoint.profile
    if profile:
        plan = lib.plan(
            profile,
            root=root,
            enabled=True,
            files=canary_file,
            replace=replace_set or None,
        )
        cset, settings = plan.cases, plan.settings
        model = model or profile.served_model_name
        batched = batched or plan.batched
        at_once, policy = plan.at_once, plan.policy
    else:
        cset, settings = canary_cases.resolve(canary_file, replace=replace_set), lib.Settings()
        at_once, policy = None, lib.Policy()
    settings = lib.Settings(
        max_tokens=settings.max_tokens if max_tokens is None else max_tokens,
        seed=settings.seed if seed is None else seed,
    )
    secret = endpoint.secret
    image = image or _instance_image(instance, root)
    model = model or records.served_model(url, secret)
    click.echo(
        f"canary: {len(cset.cases)} cases ({cset.tasks} checked) from {', '.join(cset.sources)}, "
        f"max_tokens {settings.max_tokens}",
        err=True,
    )
    rec = lib.run(
        cset,
        url,
        model,
        api_key=secret,
        settings=settings,
        image=image,
        profile=profile.name if profile else None,
        progress=lambda m: click.echo(m, err=True),
        batched=batched,
        at_once=at_once,
    )
    lib.save(rec, out)
    check = lib.batched(rec, policy.min_parity)
    if json_:
        echo_json({**rec.figures(), "out": out, "batched": check.figures() if check else None})
    else:
        rate = f", tasks {rec.passed}/{rec.tasks} passed" if rec.tasks else ""
        click.echo(f"{rec.cost()}{rate}; wrote {out}")
        if check is not None:
            click.echo(check.summary())
    if check is not None and not check.ok:
        sys.exit(1)


@canary.command("compare")
@click.argument("before", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("after", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--profile",
    "profile_name",
    default=None,
    help="Judge by this profile's [canary] thresholds, a shipped name or a TOML file of yours "
    "(default: 100% parity, no task drop, acceptance down by at most 0.1).",
)
@click.option("--min-parity", type=float, default=None, help="Least share of identical outputs.")
@click.option(
    "--max-pass-rate-drop", type=float, default=None, help="Largest task pass-rate drop allowed."
)
@click.option(
    "--max-acceptance-drop",
    type=float,
    default=None,
    help="Largest drop of draft acceptance allowed (the median per prompt; default 0.1).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def canary_compare(
    before: Path,
    after: Path,
    profile_name: str | None,
    min_parity: float | None,
    max_pass_rate_drop: float | None,
    max_acceptance_drop: float | None,
    as_json: bool,
) -> None:
    """Compare two records; exit 0 when the canary passes (warnings included), 1 when it fails.

    \b
    Example:
      appliance canary compare before.json after.json --profile l4x4-31b-mtp
    """
    base = lib.Policy.of(lookup(profile_name).canary) if profile_name else lib.Policy()
    given = {
        "min_parity": min_parity,
        "max_pass_rate_drop": max_pass_rate_drop,
        "max_acceptance_drop": max_acceptance_drop,
    }
    policy = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    b, a = lib.load(before), lib.load(after)
    result = lib.compare(b, a, policy)
    if as_json:
        echo_json(result.figures())
    else:
        click.echo(result.summary())
        for cid in result.differing:
            click.echo(f"  differs: {cid}")
    if not result.ok:
        sys.exit(1)
