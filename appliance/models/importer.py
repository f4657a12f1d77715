"""Import a model copy made by :mod:`.export` into the instance's cache, for offline serving.

Every file is received into a staging directory inside the cache (same filesystem), hashed on
the way and compared with the manifest; only when all of them match are they moved into the
hub layout (blobs, then the snapshot's links renamed into place, then the listing, then
``refs/main`` last). A failure at any point removes what this import added: the cache holds the
old state or the new one, never half a model.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import UsageError
from . import ModelSpec, TransferError, cache
from . import manifest as mf
from .export import is_tarball
from .where import Location

_CHUNK = 8 * 1024 * 1024
_SPARE = 1 << 30  # keep a GiB free beyond the copy


@dataclass(frozen=True)
class Imported:
    """One model laid into the cache."""

    spec: ModelSpec
    commit: str
    files: int
    bytes: int


def check_sha256_arg(value: str | None) -> str | None:
    """``--expect-sha256`` as given: 64 hex digits (what export and ``sha256sum`` print)."""
    if value is not None and not cache.SHA256.fullmatch(value.lower()):
        raise UsageError(
            f"--expect-sha256 {value!r} is not a sha256 (64 hex digits)",
            fix="give the sha256 appliance models export printed",
        )
    return value.lower() if value else None


def import_copy(loc: Location, source: Path, expect_sha256: str | None = None) -> list[Imported]:
    """Lay ``loc``'s models from ``source`` (a directory or a tar archive) into its cache; with
    ``expect_sha256``, only if the copy is the one export named (the archive's sha256, or a
    directory's manifest's), else nothing is laid."""
    source = Path(source)
    expect_sha256 = check_sha256_arg(expect_sha256)
    if not source.exists():
        raise UsageError(f"no model copy at {source}", fix="give the directory or tar file")
    with cache.locked(loc.hub):
        staging = Path(tempfile.mkdtemp(prefix=".appliance-import-", dir=loc.hub))
        try:
            if source.is_dir():
                models = _receive_dir(loc, source, staging, expect_sha256)
            else:
                models = _receive_tar(loc, source, staging, expect_sha256)
            return [_lay(loc.hub, spec, m, staging) for spec, m in models]
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _wanted(loc: Location, manifest: mf.Manifest, where: str):
    models = [(spec, manifest.find(spec, where)) for spec in loc.specs]
    need = sum(f.size for _, m in models for f in m.files)
    free = shutil.disk_usage(loc.hub).free
    if need + _SPARE > free:
        raise TransferError(
            f"the copy needs {need / 1e9:.1f} GB in {loc.hub}, {free / 1e9:.1f} GB is free",
            fix="free space there, or point HF_CACHE_DIR at a larger disk",
        )
    return models


def _check_sha256(what: Path, got: str, expected: str | None) -> None:
    if expected is not None and got != expected:
        raise TransferError(
            f"{what} has sha256 {got}, expected {expected}: not the copy that was exported",
            fix=_COPY_AGAIN,
        )


def _receive_dir(loc: Location, source: Path, staging: Path, expect_sha256: str | None):
    where = str(source / mf.NAME)
    try:
        text = (source / mf.NAME).read_bytes()
    except OSError:
        raise UsageError(f"{where} missing", fix="make the copy with appliance models export")
    # The manifest holds every file's sha256, so its own names the whole copy.
    _check_sha256(source / mf.NAME, hashlib.sha256(text).hexdigest(), expect_sha256)
    models = _wanted(loc, mf.parse(text, where), str(source))
    for _, m in models:
        for f in m.files:
            src = source / m.member(f)
            try:
                fh = open(src, "rb")  # noqa: SIM115 - closed right below
            except OSError:
                raise TransferError(f"{src} missing from the copy", fix=_COPY_AGAIN) from None
            with fh:
                _receive(fh, staging / m.member(f), f, str(src))
    return models


class _HashingReader:
    """A read-only file that hashes what is read through it (the archive, hashed as read)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.hash = raw, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hash.update(data)
        return data

    def drain(self) -> str:
        """Hash the rest (the archive's end padding the tar reader leaves unread)."""
        while self.read(_CHUNK):
            pass
        return self.hash.hexdigest()


def _receive_tar(loc: Location, source: Path, staging: Path, expect_sha256: str | None):
    if not is_tarball(source):
        raise UsageError(f"{source} is neither a directory nor a .tar/.tar.gz file")
    try:
        with (
            open(source, "rb") as raw,
            tarfile.open(fileobj=(reader := _HashingReader(raw)), mode="r|*") as tar,
        ):
            members = _members(tar)
            first = next(members, None)
            if first is None or first[0].name != mf.NAME:
                raise UsageError(
                    f"{source} does not start with {mf.NAME}",
                    fix="make the copy with appliance models export",
                )
            models = _wanted(loc, mf.parse(first[1].read(), f"{source}:{mf.NAME}"), str(source))
            todo = {m.member(f): f for _, m in models for f in m.files}
            for info, fh in members:
                f = todo.pop(info.name, None)
                if f is not None:
                    _receive(fh, staging / info.name, f, f"{source}:{info.name}")
            digest = reader.drain()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TransferError(f"cannot read {source}: {exc}", fix=_COPY_AGAIN) from None
    _check_sha256(source, digest, expect_sha256)
    if todo:
        raise TransferError(
            f"{source} lacks {len(todo)} file(s) its manifest lists, e.g. {min(todo)}",
            fix=_COPY_AGAIN,
        )
    return models


def _members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, BinaryIO]]:
    """Regular files of a streamed archive (nothing is extracted by name: no path tricks)."""
    for info in tar:
        if info.isfile():
            fh = tar.extractfile(info)
            if fh is not None:
                yield info, fh


_COPY_AGAIN = "copy it again from the exporting host (appliance models export)"


def _receive(fh: BinaryIO, out: Path, f: mf.FileEntry, where: str) -> None:
    """Copy one file into staging, checking size, sha256 and the blob name it will take."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    git = hashlib.sha1(f"blob {f.size}\0".encode())
    n = 0
    with open(out, "wb") as dst:
        while chunk := fh.read(_CHUNK):
            n += len(chunk)
            if n > f.size:
                break
            sha.update(chunk)
            git.update(chunk)
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    if n != f.size:
        raise TransferError(f"{where} has {n} bytes, the manifest says {f.size}", fix=_COPY_AGAIN)
    if sha.hexdigest() != f.sha256:
        raise TransferError(
            f"{where} is corrupt (sha256 {sha.hexdigest()[:12]}, manifest {f.sha256[:12]})",
            fix=_COPY_AGAIN,
        )
    if f.blob not in (f.sha256, git.hexdigest()):
        raise TransferError(f"{where}: the manifest names a blob that is not its content")


def _lay(hub: Path, spec: ModelSpec, m: mf.ModelEntry, staging: Path) -> Imported:
    """Move one verified model from staging into the hub layout; undo it all on failure."""
    repo = cache.repo_dir(hub, m.repo_id)
    blobs, snapshots = repo / "blobs", repo / "snapshots"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshots.mkdir(exist_ok=True)
    added: list[Path] = []
    tmp = Path(tempfile.mkdtemp(prefix=f".{m.commit}.", dir=snapshots))
    final, old, placed = snapshots / m.commit, None, False
    try:
        for f in m.files:
            # Always lay the verified staged file, even over a blob of the right size: the
            # blob already there is unhashed and may be corrupt (a re-import is the repair).
            blob = blobs / f.blob
            existed = blob.exists()
            staged = staging / m.member(f)
            staged.chmod(0o644)
            os.replace(staged, blob)
            if not existed:
                added.append(blob)
            link = tmp / f.path
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(cache.blob_link(f.path, f.blob), link)
        tmp.chmod(0o755)
        if final.exists() or final.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{m.commit}.old.", dir=snapshots))
            os.replace(final, old / "snapshot")
        os.replace(tmp, final)
        placed = True
        cache.write_tree(repo, m.commit, {f.path: f.tree for f in m.files})
        cache.write_ref(repo, m.commit)
        if m.revision != "main" and not cache.COMMIT.fullmatch(m.revision):
            cache.write_ref(repo, m.commit, m.revision)
    except BaseException:
        for blob in added:
            with contextlib.suppress(OSError):
                blob.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        if placed:
            shutil.rmtree(final, ignore_errors=True)
        if old is not None and not final.exists():
            with contextlib.suppress(OSError):
                os.replace(old / "snapshot", final)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return Imported(spec, m.commit, len(m.files), m.size)
