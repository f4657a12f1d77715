"""``appliance models``: the profile's target and drafter into the instance's cache, checked."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import click

from ..instance import endpoint
from ..models import EX_CONFIG, ModelsNotReady, importer, pull, token, verify, where
from ..models import export as export_mod
from .options import root_option
from .output import echo_json


def _where(fn):
    """The options that say which models and which cache (shared by every subcommand)."""

    @click.option("--profile", help="A shipped profile name, or a TOML file of yours.")
    @click.option(
        "--profile-file",
        type=click.Path(dir_okay=False, path_type=Path),
        hidden=True,  # an old synonym of --profile FILE, kept working
        help="A profile TOML file of your own (the same as --profile FILE).",
    )
    @click.argument("name", required=False, metavar="[NAME]")
    @click.option(
        "--instance",
        metavar="NAME",
        hidden=True,  # an old synonym of NAME, kept working
        help="The installed instance (the same as NAME): its env file names the profile "
        "(APPLIANCE_PROFILE) and the cache (HF_CACHE_DIR).",
    )
    @click.option(
        "--hf-cache-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help=f"The Hugging Face cache (HF_CACHE_DIR; default {where.DEFAULT_HF_CACHE} under "
        "--root). Taken literally.",
    )
    @root_option
    @functools.wraps(fn)
    def wrapper(name, profile, profile_file, instance, hf_cache_dir, root, **kwargs):
        kwargs.setdefault("token_file", None)
        loc = where.locate(
            root=root,
            profile=profile,
            profile_file=profile_file,
            instance=endpoint.pick_instance(name, instance),
            hf_cache_dir=hf_cache_dir,
            token_file=kwargs.pop("token_file"),
        )
        return fn(loc, **kwargs)

    return wrapper


def _json_option(what: str):
    return click.option(
        "--json",
        "json_",
        is_flag=True,
        help=f"One JSON object: {what} and the check after it (exit 78 as without).",
    )


@click.group()
def models() -> None:
    """The target and drafter weights in an instance's cache (the engine runs offline)."""


@models.command(name="pull")
@_where
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"File holding the hub token, mode 0600 (default {token.DEFAULT_TOKEN_FILE} under "
    "--root, used when it exists). Never pass a token on the command line.",
)
@_json_option('{"pulled": [...], "verify": {...}}: each model pulled')
def models_pull(loc: where.Location, json_: bool) -> None:
    """Download the profile's target and drafter into the cache (resumable; files already
    there are not transferred again). Set HF_ENDPOINT for a hub mirror."""
    tok = token.read(loc.token_file, required=loc.token_file_explicit)
    got_all = pull.pull(loc, token=tok)
    if json_:
        _require_json(loc, {"pulled": [dataclasses.asdict(got) for got in got_all]})
        return
    for got in got_all:
        if got.partial_removed:
            click.echo(
                f"{got.spec.role} {got.spec.repo_id}: removed {got.partial_removed} "
                "partial file(s) of an earlier, interrupted pull"
            )
        if got.corrupt_removed:
            click.echo(
                f"{got.spec.role} {got.spec.repo_id}: removed {got.corrupt_removed} corrupt "
                "file(s) from the cache and downloaded them again"
            )
        click.echo(f"{got.spec.role} {got.spec.repo_id}@{got.commit[:12]}: {got.snapshot}")
    _require(loc, quick=True)


@models.command(name="export")
@_where
@click.option(
    "--to",
    "dest",
    required=True,
    type=click.Path(path_type=Path),
    help="A new directory, or a .tar / .tar.gz file.",
)
@click.option(
    "--json",
    "json_",
    is_flag=True,
    help='One JSON object: {"copy": ..., "sha256": ..., "sha256_of": ..., "models": [...]}.',
)
def models_export(loc: where.Location, dest: Path, json_: bool) -> None:
    """Copy the profile's models out of the cache, with a hashed manifest, for an
    air-gapped host (there: appliance models import --from COPY)."""
    exported = export_mod.export(loc, dest)
    if json_:
        echo_json(
            {
                "copy": dest,
                "sha256": exported.sha256,
                "sha256_of": export_mod.copy_sha256_of(dest),
                "profile": exported.manifest.profile,
                "models": [
                    {
                        "role": m.role,
                        "repo_id": m.repo_id,
                        "revision": m.revision,
                        "commit": m.commit,
                        "files": len(m.files),
                        "bytes": m.size,
                    }
                    for m in exported.manifest.models
                ],
            }
        )
        return
    for m in exported.manifest.models:
        click.echo(
            f"{m.role} {m.repo_id}@{m.commit[:12]}: {len(m.files)} files, {m.size / 1e6:.1f} MB"
        )
    click.echo(f"copy: {dest}")
    # Carry this line to the air-gapped host by another way than the copy itself.
    click.echo(
        f"sha256: {exported.sha256} ({export_mod.copy_sha256_of(dest)}; there: "
        f"appliance models import ... --from COPY --expect-sha256 {exported.sha256})"
    )


@models.command(name="import")
@_where
@click.option(
    "--from",
    "source",
    required=True,
    type=click.Path(path_type=Path),
    help="A copy made by appliance models export (directory or tar file).",
)
@click.option(
    "--expect-sha256",
    metavar="HEX",
    help="The sha256 models export printed for this copy (the archive's, or a directory "
    "copy's manifest.json's): nothing is laid unless the copy has it.",
)
@_json_option('{"imported": [...], "verify": {...}}: each model laid')
def models_import(
    loc: where.Location, source: Path, expect_sha256: str | None, json_: bool
) -> None:
    """Lay a copy into the cache in the layout vLLM reads offline; every file's hash is
    checked against the copy's manifest first, and nothing is laid on a mismatch."""
    got_all = importer.import_copy(loc, source, expect_sha256)
    if json_:
        _require_json(loc, {"imported": [dataclasses.asdict(got) for got in got_all]})
        return
    for got in got_all:
        click.echo(
            f"{got.spec.role} {got.spec.repo_id}@{got.commit[:12]}: {got.files} files, "
            f"{got.bytes / 1e6:.1f} MB"
        )
    _require(loc, quick=True)


@models.command(name="verify")
@_where
@click.option(
    "--quick",
    is_flag=True,
    help="Presence and sizes only, no hashing, one line of output (for every start).",
)
@click.option("--json", "json_", is_flag=True, help="Print the outcome as one JSON object.")
def models_verify(loc: where.Location, quick: bool, json_: bool) -> None:
    """Check both models are in the cache, complete and the right ones. Exit 78 (EX_CONFIG)
    with one line per problem, each naming the model and the command that fixes it."""
    if json_:
        report = verify.verify(loc, quick=quick)
        echo_json(report.to_dict(loc.fix()))
        if not report.ok:
            raise SystemExit(EX_CONFIG)
        return
    _require(loc, quick=quick, one_line=quick)


def _require_json(loc: where.Location, done: dict) -> None:
    """``done`` and the quick check after it as one object; exit 78 when the models are not
    ready, as :func:`_require` (the object printed first, as ``models verify --json``)."""
    report = verify.verify(loc, quick=True)
    echo_json({**done, "verify": report.to_dict(loc.fix())})
    if not report.ok:
        raise SystemExit(EX_CONFIG)


def _require(loc: where.Location, *, quick: bool, one_line: bool = True) -> None:
    report = verify.verify(loc, quick=quick)
    if report.ok:
        click.echo(report.summary())
        return
    if one_line:
        raise ModelsNotReady(report.one_line(loc.fix()))
    for line in report.lines(loc.fix()):
        click.echo(f"Error: {line}", err=True)
    raise SystemExit(EX_CONFIG)
