"""The manifest of an exported model copy: which models, which commit, every file's size and
sha256, and the hub listing needed to lay the copy out as a hub cache.

A copy is a directory or a tar archive holding ``manifest.json`` first, then each file under
``models/ORG--NAME/PATH``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..errors import UsageError
from . import ModelSpec, cache

NAME = "manifest.json"
FORMAT = 1
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class FileEntry:
    """One file of one model."""

    path: str  # inside the repo
    size: int
    sha256: str
    blob: str  # the blob's name in a hub cache (its hub etag)
    tree: cache.TreeEntry

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "blob": self.blob,
            "hub": self.tree.to_json(),
        }


@dataclass(frozen=True)
class ModelEntry:
    """One model of the copy, at one commit."""

    role: str
    repo_id: str
    revision: str  # what was asked for (main, or the profile's pin)
    commit: str
    files: tuple[FileEntry, ...]

    def member(self, f: FileEntry) -> str:
        """Where ``f`` lies inside the copy."""
        return f"models/{self.repo_id.replace('/', '--')}/{f.path}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Manifest:
    profile: str
    models: tuple[ModelEntry, ...]

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "profile": self.profile,
            "models": [
                {
                    "role": m.role,
                    "repo_id": m.repo_id,
                    "revision": m.revision,
                    "commit": m.commit,
                    "files": [f.to_json() for f in m.files],
                }
                for m in self.models
            ],
        }
        return json.dumps(body, indent=2) + "\n"

    def find(self, spec: ModelSpec, where: str) -> ModelEntry:
        """The entry for ``spec``; a UsageError when the copy lacks it or holds another pin."""
        for m in self.models:
            if m.repo_id == spec.repo_id:
                if spec.revision and spec.revision not in (m.commit, m.revision):
                    raise UsageError(
                        f"{where} holds {spec.role} {spec.repo_id} at {m.commit[:12]}, "
                        f"the profile pins {spec.revision}",
                        fix="export the pinned revision on the connected host",
                    )
                return m
        have = ", ".join(m.repo_id for m in self.models) or "no models"
        raise UsageError(
            f"{where} does not hold {spec.role} {spec.repo_id} (it holds {have})",
            fix="export this profile's models on the connected host",
        )


def parse(text: str | bytes, where: str) -> Manifest:
    """Read a manifest, refusing anything that could write outside the cache."""
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        models = tuple(_model(m) for m in data["models"])
        return Manifest(str(data.get("profile", "")), models)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"{where} is not a model copy manifest: {exc}",
            fix="make the copy with appliance models export",
        ) from None


def _model(m: dict) -> ModelEntry:
    repo_id, commit = str(m["repo_id"]), str(m["commit"])
    if not _REPO.fullmatch(repo_id) or ".." in repo_id:
        raise ValueError(f"bad repo id {repo_id!r}")
    if not cache.COMMIT.fullmatch(commit):
        raise ValueError(f"bad commit {commit!r}")
    revision = str(m["revision"])
    if not _REF.fullmatch(revision) or ".." in revision:
        raise ValueError(f"bad revision {revision!r}")
    files = tuple(_file(f) for f in m["files"])
    return ModelEntry(str(m["role"]), repo_id, revision, commit, files)


def _file(f: dict) -> FileEntry:
    path = str(f["path"])
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or any(p in ("..", ".", "") for p in parts):
        raise ValueError(f"bad file path {path!r}")
    blob, sha = str(f["blob"]), str(f["sha256"])
    if not (cache.SHA256.fullmatch(blob) or cache.COMMIT.fullmatch(blob)):
        raise ValueError(f"bad blob name {blob!r}")
    if not cache.SHA256.fullmatch(sha):
        raise ValueError(f"bad sha256 for {path}")
    size = int(f["size"])
    if size < 0:
        raise ValueError(f"bad size for {path}")
    return FileEntry(path, size, sha, blob, cache.TreeEntry.from_json(f["hub"]))
