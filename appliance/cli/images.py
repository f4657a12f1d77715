"""``appliance image``: build, tag, list and prune the appliance's vLLM images."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from .. import images
from ..images import archive, inventory, lock, prune, scheme, targets
from ..images import build as image_build
from ..tables import table
from .options import OutputPath, root_option
from .output import echo_json

REPO_OPTION = click.option(
    "--repository", default=scheme.REPOSITORY, show_default=True, help="Image repository."
)


@click.group(name="image")
def image() -> None:
    """The appliance's vLLM images (Docker)."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


@image.command(name="build")
@click.argument("target", type=click.Choice(list(targets.TARGETS)))
@click.option("--vllm-version", help="vLLM version (the cuda target only).")
@REPO_OPTION
@click.option("--no-tag", is_flag=True, help="Build without applying the tag scheme.")
@click.option("json_", "--json", is_flag=True, help="Print the result as JSON.")
def image_build_cmd(
    target: str, vllm_version: str | None, repository: str, no_tag: bool, json_: bool
) -> None:
    """Build TARGET and tag it per the scheme (skipped when an identical image exists).

    \b
    Targets: cpu-mtp (vLLM 0.32, Gemma 4 MTP), cpu-pre-mtp (vLLM 0.19),
             cpu-broken (engine exits at start), cuda (official vllm/vllm-openai base).
    """
    progress = None if json_ else (lambda msg: click.echo(msg, err=True))
    r = image_build.build(
        images.client(),
        target,
        repository=repository,
        vllm_version=vllm_version,
        tag=not no_tag,
        progress=progress,
    )
    if json_:
        echo_json(dict(r.__dict__))
        return
    state = "cached" if r.cached else f"built in {r.seconds:.0f}s"
    click.echo(f"{r.target}: {r.image_id[7:19]} {_gb(r.size_bytes)} {state}")
    for t in r.tags:
        click.echo(f"  {t}")


@image.command(name="tag")
@click.argument("source")
@REPO_OPTION
@click.option("json_", "--json", is_flag=True, help='One JSON object: {"source", "tags"}.')
def image_tag(source: str, repository: str, json_: bool) -> None:
    """Tag the local image SOURCE per the scheme, from its labels."""
    tags = scheme.apply_tags(images.client(), source, repository)
    if json_:
        echo_json({"source": source, "tags": tags})
        return
    for t in tags:
        click.echo(t)


@image.command(name="list")
@root_option
@REPO_OPTION
@click.option("json_", "--json", is_flag=True, help="Print JSON.")
def image_list(root: Path, repository: str, json_: bool) -> None:
    """Appliance images: tags, labels, and which instance uses which image."""
    found, missing = inventory.list_images(images.client(root=root), root, repository)
    if json_:
        rows = [
            {
                "id": i.id,
                "tags": i.tags,
                "labels": i.labels,
                "size_bytes": i.size_bytes,
                "created": i.created,
                "vllm_version": i.vllm_version,
                "mtp": i.mtp,
                "variant": i.variant,
                "used_by": i.used_by,
                "rollback_for": i.rollback_for,
                "protected": prune.protection(i, repository),
            }
            for i in found
        ]
        miss = [{"instance": r.instance, "source": r.source, "ref": r.ref} for r in missing]
        echo_json({"images": rows, "missing": miss})
        return
    rows = []
    for i in found:
        used = ",".join(i.used_by) or "-"
        if i.rollback_for:
            used += f" (rollback: {','.join(i.rollback_for)})"
        mtp = "yes" if i.mtp else "no"
        tags = " ".join(i.tags) or "<none>"
        build = i.variant or "?"
        rows.append((i.short_id, i.vllm_version or "?", mtp, build, _gb(i.size_bytes), used, tags))
    headers = ("IMAGE ID", "VLLM", "MTP", "BUILD", "SIZE", "USED BY", "TAGS")
    click.echo(table(headers, rows, "<<<<><<"))
    for r in missing:
        click.echo(
            f"missing: instance {r.instance} ({r.source}) refers to {r.ref}, not in the engine"
        )


@image.command(name="prune")
@click.option(
    "--mode",
    type=click.Choice(prune.MODES),
    default="dangling",
    show_default=True,
    help="dangling: untagged; superseded: also version-only tags; all: every appliance image.",
)
@click.option("--dry-run", is_flag=True, help="Say what would go, remove nothing.")
@root_option
@REPO_OPTION
@click.option(
    "json_",
    "--json",
    is_flag=True,
    help='One JSON object: {"removed": [...], "kept": [...], "dry_run": ...}, each image '
    'with its tags, labels and references (a kept one with "why").',
)
def image_prune(mode: str, dry_run: bool, root: Path, repository: str, json_: bool) -> None:
    """Remove appliance images; never one an instance or a rollback slot refers to."""
    r = prune.prune(images.client(root=root), root, mode, repository, dry_run)
    if json_:
        echo_json(
            {
                "removed": [dataclasses.asdict(i) for i in r.removed],
                "kept": [{**dataclasses.asdict(i), "why": why} for i, why in r.kept],
                "dry_run": r.dry_run,
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    for i in r.removed:
        click.echo(f"{verb} {i.short_id} {' '.join(i.tags) or '<none>'}")
    for i, why in r.kept:
        click.echo(f"kept {i.short_id} {' '.join(i.tags) or '<none>'}: {why}")


@image.command(name="rm")
@click.argument("ref")
@root_option
@REPO_OPTION
@click.option("json_", "--json", is_flag=True, help='One JSON object: {"ref", "image_id"}.')
def image_rm(ref: str, root: Path, repository: str, json_: bool) -> None:
    """Remove image REF unless an instance or a rollback slot refers to it."""
    image_id = prune.remove(images.client(root=root), ref, root, repository)
    if json_:
        echo_json({"ref": ref, "image_id": image_id})
        return
    click.echo(f"removed {ref} ({image_id[7:19]})")


@image.command(name="save")
@click.argument("ref")
@click.option(
    "--out",
    required=True,
    type=OutputPath(),
    help="The archive to write (its directory must exist).",
)
@click.option("json_", "--json", is_flag=True, help="Print the record as JSON.")
def image_save(ref: str, out: Path, json_: bool) -> None:
    """Write image REF as a `docker save` archive, for a host without a registry.

    \b
    The archive carries REF's tag (only that one); the printed image ID is what
    `appliance image load FILE --expect-id ID` verifies on the host.
    """
    r = archive.save(images.client(), ref, out)
    _print_archive(r, f"saved {ref} to {r.path}", json_)


@image.command(name="load")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--expect-id", help="The image ID the archive must hold (sha256:...).")
@click.option("json_", "--json", is_flag=True, help="Print the result as JSON.")
def image_load(file: Path, expect_id: str | None, json_: bool) -> None:
    """Load a `docker save` archive, then verify the image ID and its tags in the engine.

    An incomplete or corrupt archive, or one holding another image than --expect-id (default:
    the image its manifest names), is refused before the engine loads anything.
    """
    r = archive.load(images.client, file, expect_id)
    _print_archive(r, f"loaded {r.image_id} from {r.path}", json_)


def _print_archive(r: archive.LoadResult, done: str, json_: bool) -> None:
    if json_:
        echo_json(dataclasses.asdict(r))
        return
    click.echo(f"{done} ({_gb(r.size_bytes)}, {r.seconds:.0f}s)")
    click.echo(f"  image id:       {r.image_id}")
    click.echo(f"  tags:           {' '.join(r.tags) or '<none>'}")
    click.echo(f"  archive sha256: {r.archive_sha256}")


@image.command(name="lock")
@click.argument("vllm_version", type=click.Choice(sorted(lock.RECIPES)))
@click.option(
    "--constraints-from",
    type=click.Path(file_okay=False, path_type=Path),
    help="Pin to the versions installed in this venv (e.g. .venv for 0.32.0).",
)
def image_lock(vllm_version: str, constraints_from: Path | None) -> None:
    """Re-resolve docker/cpu/vllm-VERSION.lock with pip (needs the package index)."""
    path = lock.write_lock(vllm_version, image_build.docker_folder(), constraints_from)
    click.echo(str(path))
