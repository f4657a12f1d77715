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
from typing import Annotated

import pydantic

from .. import records
from ..errors import UsageError
from . import ModelSpec, cache

NAME = "manifest.json"
FORMAT = 1
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


# The checks that keep a manifest read from a copy from writing outside the cache: pydantic runs
# them after its strict type check when :func:`parse` reads one (they cost nothing otherwise).
def _check(ok, what: str):
    def check(value: str) -> str:
        if not ok(value):
            raise ValueError(f"bad {what} {value!r}")
        return value

    return pydantic.AfterValidator(check)


def _safe_path(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return bool(parts) and not path.startswith("/") and not any(p in ("..", ".", "") for p in parts)


RepoId = Annotated[str, _check(lambda v: _REPO.fullmatch(v) and ".." not in v, "repo id")]
Revision = Annotated[str, _check(lambda v: _REF.fullmatch(v) and ".." not in v, "revision")]
Commit = Annotated[str, _check(cache.COMMIT.fullmatch, "commit")]
FilePath = Annotated[str, _check(_safe_path, "file path")]
Sha256 = Annotated[str, _check(cache.SHA256.fullmatch, "sha256")]
Blob = Annotated[
    str, _check(lambda v: cache.SHA256.fullmatch(v) or cache.COMMIT.fullmatch(v), "blob name")
]
Size = Annotated[int, pydantic.Field(ge=0)]


@dataclass(frozen=True)
class FileEntry:
    """One file of one model."""

    path: FilePath  # inside the repo
    size: Size
    sha256: Sha256
    blob: Blob  # the blob's name in a hub cache (its hub etag)
    tree: Annotated[cache.TreeEntry, pydantic.Field(alias="hub")]  # "hub" in the JSON

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
    repo_id: RepoId
    revision: Revision  # what was asked for (main, or the profile's pin)
    commit: Commit
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
                # A commit pin must be the copy's commit: "revision" is only what the exporter
                # asked for, and the commit is what is laid and what refs/main will name.
                pinned = m.commit if cache.COMMIT.fullmatch(spec.revision or "") else m.revision
                if spec.revision and spec.revision != pinned:
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
    """Read a manifest: every field of its type (pydantic's strict check) and nothing that could
    write outside the cache; anything else is one UsageError naming ``where`` and the field."""
    fix = "make the copy with appliance models export"
    where = f"{where} is not a model copy manifest"
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}", fix=fix) from None
    records.require(data, "format", FORMAT, where, fix)
    # "profile" was optional to the reader before: a copy without one still loads.
    return records.from_dict(Manifest, {"profile": "", **data}, where)
