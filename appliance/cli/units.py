"""``appliance render``, ``install`` and ``render-examples``: an instance's unit, env file and
serve script from a profile."""

from __future__ import annotations

from pathlib import Path

import click

from .. import units
from ..errors import ApplianceError
from ..units import examples
from .options import root_option


def instance_options(f):
    """The options shared by render and install."""
    for decorator in reversed(
        [
            click.option("--profile", "-p", "profile", required=True, help="Serving profile."),
            click.option("--instance", "-i", required=True, help="Unit instance name."),
            click.option("--image", help="VLLM_IMAGE (default: kept, else gemma4-vllm:latest)."),
            click.option("--gpus", help="docker --gpus value (MIG profiles: device=GPU:MIG)."),
            click.option("--port", type=int, help="vLLM port (default: the profile's)."),
            click.option("--model-dir", help="CPU profiles: the tiny model pair on the host."),
            click.option("--hf-cache-dir", help="GPU profiles: the Hugging Face cache."),
            click.option("--vllm-cache-dir", help="vLLM's compile cache on the host."),
        ]
    ):
        f = decorator(f)
    return f


def _options(kw: dict) -> units.Options:
    return units.Options(
        image=kw["image"],
        gpus=kw["gpus"],
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


@click.command()
@instance_options
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Output dir.")
def render(profile: str, instance: str, out: str, **kw) -> None:
    """Render an instance's unit, env file and serve script into --out (for review)."""
    _report(units.render_to(profile, instance, Path(out), _options(kw)))


@click.command()
@instance_options
@root_option
def install(profile: str, instance: str, root: Path, **kw) -> None:
    """Install an instance: unit, env file (VLLM_IMAGE kept), serve script, API key (0600).

    \b
    Then: systemctl daemon-reload && systemctl enable --now gemma4-vllm@INSTANCE
    """
    result = units.install(profile, instance, root=root, options=_options(kw))
    _report(result)
    if result.changed:
        click.echo(
            f"next: systemctl daemon-reload && systemctl restart {units.unit_name(instance)}"
        )


@click.command(name="render-examples")
@click.option("--check", is_flag=True, help="Fail if the committed examples are out of date.")
@click.option(
    "--repo",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False),
    help="The repository root.",
)
def render_examples(check: bool, repo: str) -> None:
    """Regenerate the examples under systemd/ and scripts/serve/ from the shipped profiles."""
    if check:
        problems = examples.check(Path(repo))
        for problem in problems:
            click.echo(problem, err=True)
        if problems:
            raise ApplianceError(
                f"{len(problems)} example(s) out of date", fix=f"run: {examples.REGENERATE}"
            )
        click.echo("examples up to date")
        return
    _report(examples.write(Path(repo)))
