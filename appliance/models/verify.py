"""Are a profile's target and drafter in the cache, complete, intact and the right ones?

Checked per model: the cache holds the repo, ``refs/main`` (what vLLM loads offline) names the
commit the profile pins, the snapshot holds every file of the hub's listing at that commit with
its size (and, unless ``quick``, its hash), ``config.json`` reads, the target has a tokenizer,
every shard a weight index lists is there, each safetensors file is as long as its header says.
Then the pair: the drafter is a Gemma 4 MTP drafter (``gemma4_assistant`` and friends) built for
a backbone of the target's width. ``quick`` reads no weight data (sizes and headers only), so it
can run at every unit start. A tiny dev model pair in ``MODEL_DIR`` (``target/``, ``drafter/``,
no hub listing) gets the same structure and pair checks (:func:`verify_model_dir`).

The unit's serve program runs ``quick`` at every start (:mod:`appliance.serve`), so this module
uses the standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import progress
from . import DRAFTER_TYPES, ModelSpec, cache

if TYPE_CHECKING:
    from .where import Location

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one model."""

    role: str
    repo_id: str
    what: str

    def line(self, fix: str | None = None) -> str:
        text = f"{self.role} {self.repo_id}: {self.what}"
        return f"{text} ({fix})" if fix else text


@dataclass
class ModelState:
    """What was found for one model."""

    spec: ModelSpec
    commit: str | None = None
    snapshot: Path | None = None
    files: int = 0
    bytes: int = 0
    hashed: int = 0
    config: dict | None = None
    problems: list[Problem] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.problems.append(Problem(self.spec.role, self.spec.repo_id, what))


@dataclass(frozen=True)
class Report:
    """The outcome of :func:`verify` for every model of a profile."""

    models: tuple[ModelState, ...]
    problems: tuple[Problem, ...]
    quick: bool

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self, fix: str) -> list[str]:
        """One line per problem, each naming the model and the command that fixes it."""
        return [p.line(fix) for p in self.problems]

    def summary(self) -> str:
        """One line saying what is there (for a passing check)."""
        parts = []
        for m in self.models:
            checked = "sizes" if self.quick else f"{m.hashed} hashes"
            at = f"@{m.commit[:12]}" if m.commit else ""
            parts.append(
                f"{m.spec.role} {m.spec.repo_id}{at} "
                f"({m.files} files, {_gb(m.bytes)}, {checked} checked)"
            )
        return "models ok: " + "; ".join(parts)

    def to_dict(self, fix: str) -> dict:
        """The outcome as data (``models verify --json``): what was found per model, and each
        problem with the command that fixes it."""
        return {
            "ok": self.ok,
            "quick": self.quick,
            "models": [
                {
                    "role": m.spec.role,
                    "repo_id": m.spec.repo_id,
                    "commit": m.commit,
                    "files": m.files,
                    "bytes": m.bytes,
                    "hashed": m.hashed,
                }
                for m in self.models
            ],
            "problems": [dataclasses.asdict(p) for p in self.problems],
            "fix": None if self.ok else fix,
        }

    def one_line(self, fix: str) -> str:
        """The whole outcome as one line (the unit's start-time check logs exactly this)."""
        if self.ok:
            return self.summary()
        shown = [p.line() for p in self.problems[:3]]
        more = len(self.problems) - len(shown)
        tail = f"; and {more} more" if more else ""
        return f"models not ready: {'; '.join(shown)}{tail} ({fix})"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def verify(loc: Location, *, quick: bool = False) -> Report:
    """Check the profile's models in ``loc``'s cache (nothing is written)."""
    return verify_hub(loc.hub, loc.specs, quick=quick)


def verify_hub(hub: Path, specs: Sequence[ModelSpec], *, quick: bool = False) -> Report:
    """Check the models ``specs`` in the hub cache ``hub`` (nothing is written)."""
    states = [check_cached(hub, spec, quick=quick) for spec in specs]
    check_pair(states)
    problems = tuple(p for s in states for p in s.problems)
    return Report(tuple(states), problems, quick)


def verify_model_dir(model_dir: Path, specs: Sequence[ModelSpec], *, quick: bool = False) -> Report:
    """Check a tiny dev model pair in ``model_dir`` (``MODEL_DIR``; ``specs`` name directories
    in it: no hub listing, so sizes come from the safetensors headers; hashes only where a blob
    name states one)."""
    states = []
    for spec in specs:
        path = Path(model_dir) / spec.repo_id
        state = ModelState(ModelSpec(spec.role, str(path)))
        if not path.is_dir():
            state.fail("directory missing")
        else:
            state.snapshot = path
            check_files(state, path, None, quick=quick)
        states.append(state)
    check_pair(states)
    return Report(tuple(states), tuple(p for s in states for p in s.problems), quick)


def check_cached(hub: Path, spec: ModelSpec, *, quick: bool) -> ModelState:
    """Check one model in the hub cache ``hub``."""
    state = ModelState(spec)
    repo = cache.repo_dir(hub, spec.repo_id)
    if not repo.is_dir():
        state.fail(f"not in the model cache {hub}")
        return state
    commit = cache.resolve(repo, spec.revision)
    if commit is None:
        state.fail(f"no refs/{spec.ref} in {repo}: the download never finished")
        return state
    main = cache.read_ref(repo, "main")
    if main != commit:
        # vLLM, offline and without --revision, loads whatever refs/main names.
        state.fail(f"refs/main names {main or 'nothing'}, the profile pins {commit}")
        return state
    state.commit = commit
    # The hub client downloads into blobs/ETAG.incomplete and renames when done: one left over
    # is a download that was killed (the next pull removes it).
    partial = sorted(p.name for p in (repo / "blobs").glob("*.incomplete"))
    if partial:
        state.fail(f"a download was interrupted (blobs/{partial[0]} left)")
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        state.fail(f"snapshot {commit[:12]} missing from {repo}")
        return state
    state.snapshot = snapshot
    check_files(state, snapshot, cache.read_tree(repo, commit), quick=quick)
    return state


def check_files(
    state: ModelState, snapshot: Path, tree: dict[str, cache.TreeEntry] | None, *, quick: bool
) -> None:
    """Check the files of one model's snapshot against the listing (when known) and the
    model's own structure."""
    files = cache.snapshot_files(snapshot)
    present = {rel: p for rel, p in files.items() if p.exists()}
    state.files = len(present)
    state.bytes = sum(p.stat().st_size for p in present.values())
    reported: set[str] = set()  # already failed: no second line for the same file
    hashed: set[str] = set()
    # Hashing 62 GB takes a minute or more: say so (stderr; a bar on a terminal).
    what = f"hashing {state.spec.role} {state.spec.repo_id}"
    meter = None if quick or not present else progress.Meter(what, state.bytes)
    try:
        _check_listed(state, tree, present, reported, hashed, meter)
        if meter is not None:
            for rel, path in sorted(present.items()):
                if rel not in hashed | reported and (known := cache.hash_from_blob_name(path)):
                    _check_hash(state, rel, path, known, meter)
    finally:
        if meter is not None:
            meter.close()
    _check_structure(state, present, skip=reported)


def _check_listed(
    state: ModelState,
    tree: dict[str, cache.TreeEntry] | None,
    present: dict[str, Path],
    reported: set[str],
    hashed: set[str],
    meter: progress.Meter | None,
) -> None:
    """The files the hub's listing names: there, of their size, and (with ``meter``: not
    quick) of their hash."""
    for rel, entry in sorted((tree or {}).items()):
        path = present.get(rel)
        if path is None:
            state.fail(f"file {rel} missing")
            reported.add(rel)
        elif (size := path.stat().st_size) != entry.size:
            state.fail(f"file {rel} has {size} of {entry.size} bytes (truncated or replaced)")
            reported.add(rel)
        elif meter is not None:
            _check_hash(state, rel, path, entry.expected_hash(), meter)
            hashed.add(rel)


def _check_hash(
    state: ModelState, rel: str, path: Path, expected: tuple[str, str], meter: progress.Meter
) -> None:
    sha256, git = cache.file_hashes(path, meter.update)
    kind, want = expected
    got = sha256 if kind == "sha256" else git
    state.hashed += 1
    if got != want:
        state.fail(f"file {rel} is corrupt ({kind} {got[:12]}, expected {want[:12]})")


def _check_structure(state: ModelState, present: dict[str, Path], *, skip: set[str]) -> None:
    config = present.get("config.json")
    if config is None:
        if "config.json" not in skip:
            state.fail("config.json missing")
    else:
        try:
            state.config = json.loads(config.read_text())
        except (OSError, ValueError):
            state.fail("config.json is not valid JSON")
    tokenizer = any(t in present or t in skip for t in TOKENIZER_FILES)
    if state.spec.role == "target" and not tokenizer:
        state.fail("no tokenizer (tokenizer.json or tokenizer.model)")
    shards: set[str] = set()
    for index in WEIGHT_INDEXES:
        if index in present:
            try:
                weight_map = json.loads(present[index].read_text())["weight_map"]
                shards |= set(weight_map.values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                state.fail(f"{index} is not a valid weight index")
    for shard in sorted(shards - present.keys() - skip):
        state.fail(f"weight shard {shard} missing (listed in the weight index)")
    weights = [rel for rel in present if rel.endswith(WEIGHT_SUFFIXES)]
    if not weights and not shards and not any(r.endswith(WEIGHT_SUFFIXES) for r in skip):
        state.fail("no weight files (*.safetensors)")
    for rel in sorted(weights):
        why = _safetensors_problem(present[rel]) if rel.endswith(".safetensors") else None
        if why is not None and rel not in skip:
            state.fail(f"file {rel} {why}")


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (its header gives the exact length), or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                return f"is truncated or not safetensors ({size} bytes)"
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return "has an unreadable safetensors header"
    end = max(
        (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
        default=0,
    )
    want = 8 + n + end
    if size < want:
        return f"is truncated ({size} of {want} bytes)"
    return None


def _hidden(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("hidden_size")
    return value if isinstance(value, int) else None


def check_pair(states: list[ModelState]) -> None:
    """The drafter must be a Gemma 4 MTP drafter built for the target's hidden width."""
    by_role = {s.spec.role: s for s in states}
    drafter, target = by_role.get("drafter"), by_role.get("target")
    if drafter is None or drafter.config is None:
        return
    kind = drafter.config.get("model_type")
    if kind not in DRAFTER_TYPES:
        drafter.fail(
            f"is a {kind or 'untyped'} model, not a Gemma 4 MTP drafter "
            f"({' / '.join(DRAFTER_TYPES[:2])}): wrong drafter repo in the profile or the cache"
        )
        return
    backbone = drafter.config.get("backbone_hidden_size")
    width = _hidden(target.config) if target is not None and target.config else None
    if isinstance(backbone, int) and width is not None and backbone != width:
        drafter.fail(
            f"drafts for a backbone of width {backbone}, the target {target.spec.repo_id} "
            f"has {width}: the drafter belongs to another Gemma 4 size"
        )
