"""The Hugging Face hub cache layout, as the hub client writes it and vLLM reads it offline.

``hub/models--ORG--NAME/``: ``blobs/ETAG`` (the content; the etag is the file's sha256 for
LFS files, its git blob id otherwise), ``snapshots/COMMIT/PATH`` (relative symlinks to the
blobs), ``refs/main`` (the commit vLLM loads when started without ``--revision``) and
``trees/COMMIT.json`` (the hub's file listing at that commit: sizes and hashes, format 1).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import fsutil

COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")
TREE_FORMAT = 1
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class TreeEntry:
    """One file of the hub's listing: size, git blob id and, for LFS files, sha256."""

    size: int
    blob_id: str
    lfs_sha256: str | None = None

    def to_json(self) -> dict:
        out: dict = {"size": self.size, "blob_id": self.blob_id}
        if self.lfs_sha256:
            out.update(lfs_sha256=self.lfs_sha256, lfs_size=self.size)
        return out

    @classmethod
    def from_json(cls, data: dict) -> TreeEntry:
        return cls(int(data["size"]), str(data["blob_id"]), data.get("lfs_sha256"))

    def expected_hash(self) -> tuple[str, str]:
        """``(kind, hex)``: sha256 for LFS files, the git blob id otherwise."""
        return ("sha256", self.lfs_sha256) if self.lfs_sha256 else ("git-sha1", self.blob_id)


def repo_dir(hub: Path, repo_id: str) -> Path:
    return hub / ("models--" + repo_id.replace("/", "--"))


def read_ref(repo: Path, name: str = "main") -> str | None:
    try:
        value = (repo / "refs" / name).read_text().strip()
    except OSError:
        return None
    return value if COMMIT.fullmatch(value) else None


def write_ref(repo: Path, commit: str, name: str = "main") -> None:
    """Point ``refs/NAME`` at ``commit`` atomically (no newline, as the hub client writes it)."""
    if read_ref(repo, name) != commit:
        fsutil.write_atomic(repo / "refs" / name, commit)


def resolve(repo: Path, revision: str | None) -> str | None:
    """The commit ``revision`` names in the cache (a commit hash names itself)."""
    if revision and COMMIT.fullmatch(revision):
        return revision
    return read_ref(repo, revision or "main")


def read_tree(repo: Path, commit: str) -> dict[str, TreeEntry] | None:
    """The hub's listing of ``commit`` kept in the cache, None when there is none."""
    try:
        data = json.loads((repo / "trees" / f"{commit}.json").read_text())
        if data.get("format_version") != TREE_FORMAT:
            return None
        return {path: TreeEntry.from_json(info) for path, info in data["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_tree(repo: Path, commit: str, entries: dict[str, TreeEntry]) -> None:
    body = {
        "format_version": TREE_FORMAT,
        "files": {p: e.to_json() for p, e in sorted(entries.items())},
    }
    fsutil.write_atomic(repo / "trees" / f"{commit}.json", json.dumps(body, indent=2) + "\n")


def snapshot_files(snapshot: Path) -> dict[str, Path]:
    """Every file of a snapshot by its path in the repo (dangling links included)."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(snapshot):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = Path(dirpath, name)
            out[full.relative_to(snapshot).as_posix()] = full
    return out


def blob_link(rel_path: str, blob: str) -> str:
    """The relative symlink target from ``snapshots/COMMIT/REL_PATH`` to ``blobs/BLOB``."""
    depth = rel_path.count("/")
    return "../" * (depth + 2) + f"blobs/{blob}"


def hash_from_blob_name(path: Path) -> tuple[str, str] | None:
    """The hash a blob's name states (its hub etag), when ``path`` links to a named blob."""
    name = Path(os.path.realpath(path)).name
    if SHA256.fullmatch(name):
        return ("sha256", name)
    if COMMIT.fullmatch(name):
        return ("git-sha1", name)
    return None


def file_hashes(path: Path, on_read: Callable[[int], None] | None = None) -> tuple[str, str]:
    """``(sha256, git blob id)`` of a file, read once; ``on_read(n)`` after each chunk (a
    progress meter)."""
    size = os.path.getsize(path)
    sha = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            git.update(chunk)
            if on_read is not None:
                on_read(len(chunk))
    return sha.hexdigest(), git.hexdigest()


def lfs_pointer_oid(sha256: str, size: int) -> str:
    """The git blob id of the LFS pointer file the hub lists for an LFS file."""
    text = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
    return hashlib.sha1(f"blob {len(text)}\0{text}".encode()).hexdigest()


LOCK_NAME = ".appliance-models.lock"


@contextlib.contextmanager
def locked(hub: Path) -> Iterator[None]:
    """Hold the cache's exclusive lock: one pull or import at a time writes into it.

    Owner only (0600, like the cutover lock): any user who can open the file can hold a shared
    flock on it, and every pull and import is then refused for as long as that user likes."""
    from ..errors import ApplianceError

    try:
        hub.mkdir(parents=True, exist_ok=True)
        fd = os.open(hub / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # a lock file made by an older appliance was 0644
    except OSError as exc:
        raise ApplianceError(
            f"cannot write to the model cache {hub}: {exc.strerror}",
            fix="run as a user that may write it (root, for an installed instance)",
        ) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ApplianceError(
                f"another appliance models pull or import is writing into {hub}",
                fix="wait for it to finish, then run this again",
            ) from None
        yield
    finally:
        os.close(fd)
