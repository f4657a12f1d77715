"""Download a profile's target and drafter into the instance's cache with ``huggingface_hub``.

The hub client does the transfer (progress bars, retries that resume a dropped transfer with a
``Range`` request, files already in the cache skipped). Around it: one pull per cache at a time,
partial files a killed pull left behind removed, every blob hashed against the hash its name
states (the client would keep a corrupt blob of the right size as it is: one is deleted first, so
the client fetches it again, and a download is hashed before it is trusted), ``refs/main``
pointed at the commit fetched (vLLM, offline, loads what ``refs/main`` names), and every error
turned into one line that never carries the token.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from .. import progress
from . import ModelSpec, TransferError, cache
from . import token as tokens
from .where import Location


@dataclass(frozen=True)
class Pulled:
    """One model now in the cache."""

    spec: ModelSpec
    commit: str
    snapshot: Path
    partial_removed: int = 0  # partial files of an earlier, killed pull deleted first
    corrupt_removed: int = 0  # blobs whose content was not their name's hash, fetched again


def pull(loc: Location, *, token: str | None, max_workers: int = 8) -> list[Pulled]:
    """Download every model of ``loc``'s profile (already cached files are not transferred)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise TransferError(
            "HF_HUB_OFFLINE is set in this environment: a pull needs the hub",
            fix="unset HF_HUB_OFFLINE for this command, or use appliance models import",
        )
    endpoint = os.environ.get("HF_ENDPOINT") or None
    if name := tokens.unused_env():
        there = "" if token else ", which is not there"
        progress.line(
            f"warning: {name} is set but not used: the pull reads the hub token only from "
            f"{loc.token_file} (mode 0600){there}; {tokens.WHY_NOT_ENV}",
            "warning",
        )
    out = []
    with cache.locked(loc.hub):
        for spec in loc.specs:
            out.append(_pull_one(loc, spec, token, endpoint, max_workers))
    return out


def _pull_one(
    loc: Location, spec: ModelSpec, token: str | None, endpoint: str | None, max_workers: int
) -> Pulled:
    from huggingface_hub import snapshot_download

    label = f"{spec.role} {spec.repo_id}"
    repo = cache.repo_dir(loc.hub, spec.repo_id)
    removed = remove_partial(repo)
    corrupt = remove_corrupt(repo, label=f"hashing the cached files of {label}")
    kept = _blobs(repo)  # every one of them hashed just now
    progress.line(f"{label}@{spec.ref}: downloading into {loc.hub}")
    try:
        path = Path(
            snapshot_download(
                spec.repo_id,
                revision=spec.ref,
                cache_dir=loc.hub,
                # False, not None: never fall back to a token stored elsewhere on the host.
                token=token or False,
                endpoint=endpoint,
                max_workers=max_workers,
                tqdm_class=_hub_bars(label),
            )
        )
    except Exception as exc:  # noqa: BLE001 - the hub client's many error types, one line each
        raise _explain(exc, loc, spec, token, endpoint) from None
    bad = remove_corrupt(repo, skip=kept, label=f"hashing the downloaded files of {label}")
    if bad:
        raise TransferError(
            f"{spec.role} {spec.repo_id}: {bad} downloaded file(s) did not match their hash "
            "and were deleted",
            fix="run the pull again (check the network or the HF_ENDPOINT mirror if it repeats)",
        )
    commit = path.name
    cache.write_ref(repo, commit)
    return Pulled(spec, commit, path, removed, corrupt)


def _blobs(repo: Path) -> set[str]:
    blobs = repo / "blobs"
    return {p.name for p in blobs.iterdir()} if blobs.is_dir() else set()


def _hub_bars(label: str):
    """The hub client's bar class, each bar's text prefixed with ``label`` (the target's and the
    drafter's bars look alike otherwise), and off where :func:`progress.hub_bars_off` says."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    off = progress.hub_bars_off()

    class Labelled(hub_tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["desc"] = f"{label}: {kwargs.get('desc') or 'files'}"
            if off:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def set_description(self, desc=None, refresh=True) -> None:
            super().set_description(f"{label}: {desc}" if desc else label, refresh)

    return Labelled


def remove_corrupt(repo: Path, skip: set[str] = frozenset(), label: str | None = None) -> int:
    """Delete the blobs in ``repo`` whose content does not hash to their name (the hub etag:
    sha256 for LFS files, the git blob id otherwise); the snapshot links to them then dangle,
    which the hub client reads as not downloaded. Runs under the cache lock. With ``label``,
    the hashing's progress on stderr (:mod:`appliance.progress`)."""
    todo = []
    for name in sorted(_blobs(repo) - skip):
        path = repo / "blobs" / name
        stated = cache.hash_from_blob_name(path)
        if stated is not None and path.is_file():
            todo.append((path, stated))
    if not todo:
        return 0
    n = 0
    total = sum(path.stat().st_size for path, _ in todo)
    with contextlib.ExitStack() as stack:
        meter = stack.enter_context(progress.meter(label, total)) if label else None
        for path, stated in todo:
            sha256, git = cache.file_hashes(path, meter.update if meter else None)
            if stated[1] != (sha256 if stated[0] == "sha256" else git):
                path.unlink()
                n += 1
    return n


def remove_partial(repo: Path) -> int:
    """Delete the ``*.incomplete`` files a killed download left in ``repo``'s blobs (the hub
    client never reuses them: each download writes a fresh uniquely named one). Runs under the
    cache lock, so no pull of ours is writing them."""
    n = 0
    for path in (repo / "blobs").glob("*.incomplete"):
        path.unlink(missing_ok=True)
        n += 1
    return n


def _explain(
    exc: Exception, loc: Location, spec: ModelSpec, token: str | None, endpoint: str | None
) -> TransferError:
    from huggingface_hub import errors as hf

    where = endpoint or "https://huggingface.co"
    name = f"{spec.role} {spec.repo_id}"
    if isinstance(exc, hf.GatedRepoError):
        if token:
            have = f"the token in {loc.token_file} has no access to it"
        elif unused := tokens.unused_env():
            have = (
                f"no token was given ({unused} is set but not used: put it in "
                f"{loc.token_file}, chmod 600)"
            )
        else:
            have = "no token was given"
        return TransferError(
            f"{name} is gated and {have}",
            fix=f"accept its licence on the hub with your account, then put a read token in "
            f"{loc.token_file} (chmod 600)",
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return TransferError(f"{name} has no revision {spec.ref} on {where}")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return TransferError(
            f"{name} not found on {where} (or private, and the token cannot see it)",
            fix="check the repo id in the profile and the token's account",
        )
    if isinstance(exc, hf.HfHubHTTPError) and exc.response is not None:
        code = exc.response.status_code
        if code in (401, 403):
            return TransferError(
                f"{name}: the hub refused the token ({code})",
                fix=f"put a valid read token in {loc.token_file} (chmod 600)",
            )
    if (
        isinstance(exc, (hf.LocalEntryNotFoundError, OSError))
        or "connect" in type(exc).__name__.lower()
    ):
        return TransferError(
            f"{name}: cannot download from {where}: {tokens.scrub(_first_line(exc), token)}",
            fix="check the network (a proxy: HTTPS_PROXY); on an air-gapped host use "
            "appliance models export elsewhere and appliance models import here",
        )
    return TransferError(f"{name}: download failed: {tokens.scrub(_first_line(exc), token)}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
