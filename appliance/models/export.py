"""Export a profile's models from a cache into a hashed copy (a directory or a tar archive),
for a host that cannot reach the hub.

The source is checked first (a broken model is refused, not copied): every file is hashed and
compared with the hash the cache states (the hub's listing, or the blob's name). The copy is
written next to its destination and renamed into place: it is there whole or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..fsutil import check_target
from . import ModelsNotReady, cache
from . import manifest as mf
from .verify import verify
from .where import Location

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def is_tarball(path: Path) -> bool:
    return path.name.endswith(TAR_SUFFIXES)


@dataclass(frozen=True)
class Exported:
    """A copy written: its manifest and the sha256 that names it (of the file
    :func:`copy_sha256_of` gives)."""

    manifest: mf.Manifest
    sha256: str


def copy_sha256_of(path: Path) -> Path:
    """The file whose sha256 names a copy: the archive itself, or a directory's manifest (which
    holds every file's sha256). ``sha256sum`` of it gives the same hex an import expects."""
    return path if is_tarball(path) else path / mf.NAME


class HashingWriter:
    """A write-only file that hashes what passes through it (the archive, hashed as written)."""

    def __init__(self, raw) -> None:
        self.raw, self.hash, self.n = raw, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.n += len(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.raw.flush()


def export(loc: Location, dest: Path) -> Exported:
    """Write ``loc``'s models to ``dest`` (a new directory, or a ``.tar``/``.tar.gz`` file)."""
    dest = Path(dest)
    if is_tarball(dest):
        if dest.exists():
            raise UsageError(f"{dest} already exists", fix="give a new file name")
    elif dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} is not empty", fix="give a new or empty directory")
    check_target(dest, "--to", directory=not is_tarball(dest))  # before hashing every file
    manifest = build_manifest(loc)
    if is_tarball(dest):
        digest = _write_tar(loc, manifest, dest)
    else:
        _write_dir(loc, manifest, dest)
        digest = hashlib.sha256(manifest.to_json().encode()).hexdigest()
    return Exported(manifest, digest)


def build_manifest(loc: Location) -> mf.Manifest:
    """Hash every file of the profile's models, checking each against what the cache states."""
    report = verify(loc, quick=True)
    if not report.ok:
        fix = loc.fix().removeprefix("fix: ")  # one "fix:" in the line, not "fix: fix:"
        raise ModelsNotReady(report.one_line(f"fix the source first: {fix}"))
    models = []
    for state in report.models:
        repo = cache.repo_dir(loc.hub, state.spec.repo_id)
        tree = cache.read_tree(repo, state.commit) or {}
        files = []
        for rel, path in sorted(cache.snapshot_files(state.snapshot).items()):
            files.append(_entry(state.spec.role, state.spec.repo_id, rel, path, tree.get(rel)))
        models.append(
            mf.ModelEntry(
                state.spec.role, state.spec.repo_id, state.spec.ref, state.commit, tuple(files)
            )
        )
    return mf.Manifest(loc.profile.name, tuple(models))


def _entry(role: str, repo_id: str, rel: str, path: Path, tree: cache.TreeEntry | None):
    size = path.stat().st_size
    sha, git = cache.file_hashes(path)
    name = Path(os.path.realpath(path)).name
    stated = tree.expected_hash() if tree else cache.hash_from_blob_name(path)
    if stated is not None and stated[1] != (sha if stated[0] == "sha256" else git):
        raise ModelsNotReady(
            f"{role} {repo_id}: file {rel} is corrupt in the cache ({stated[0]} differs)",
            fix="pull it again before exporting",
        )
    lfs = tree.lfs_sha256 is not None if tree else cache.SHA256.fullmatch(name) is not None
    blob = sha if lfs else git
    if tree is None:
        tree = (
            cache.TreeEntry(size, cache.lfs_pointer_oid(sha, size), sha)
            if lfs
            else (cache.TreeEntry(size, git))
        )
    return mf.FileEntry(rel, size, sha, blob, tree)


def _sources(loc: Location, manifest: mf.Manifest):
    for m in manifest.models:
        snapshot = cache.repo_dir(loc.hub, m.repo_id) / "snapshots" / m.commit
        for f in m.files:
            yield m.member(f), snapshot / f.path, f


def _write_dir(loc: Location, manifest: mf.Manifest, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for member, src, _ in _sources(loc, manifest):
            out = staging / member
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
        (staging / mf.NAME).write_text(manifest.to_json())
        staging.chmod(0o755)
        if dest.exists():
            dest.rmdir()
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_tar(loc: Location, manifest: mf.Manifest, dest: Path) -> str:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    mode = "w:gz" if dest.name.endswith((".gz", ".tgz")) else "w"
    try:
        with os.fdopen(fd, "wb") as raw:
            out = HashingWriter(raw)
            with tarfile.open(fileobj=out, mode=mode, format=tarfile.PAX_FORMAT) as tar:
                # The manifest first: an import checks it before reading gigabytes.
                body = manifest.to_json().encode()
                tar.addfile(_info(mf.NAME, len(body)), io.BytesIO(body))
                for member, src, f in _sources(loc, manifest):
                    with open(src, "rb") as fh:
                        tar.addfile(_info(member, f.size), fh)
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return out.hash.hexdigest()


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    return info
