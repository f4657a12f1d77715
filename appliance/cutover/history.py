"""The append-only history of cutovers and rollbacks, one JSON object per line.

A cutover writes two lines with the same ``id``: one when it starts (``outcome: started``,
before anything is touched) and one when it ends. A ``started`` line without an end means the
process died in the middle; :func:`entries` reports it as ``interrupted``. Lines are appended
with ``O_APPEND`` and fsynced; a line cut short by a crash is skipped on reading, never fatal.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from .. import records
from ..errors import UsageError
from ..fsutil import fsync_dir, private_dir

Kind = Literal["cutover", "rollback"]
# ok: the new image passed the gates. rolled_back: it failed them and the previous image is
# serving again. failed: it failed and so did the way back (or --no-rollback was given).
# started: the begin line. interrupted: a begin line whose process never wrote the end.
Outcome = Literal["started", "ok", "rolled_back", "failed", "interrupted"]


@dataclass
class Gate:
    """One gate as it went: passed or not, seconds since the restart, what it saw."""

    name: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class Entry:
    """One cutover or rollback."""

    id: str
    instance: str
    kind: Kind
    from_image: str | None
    to_image: str
    outcome: Outcome
    started: float
    finished: float | None = None
    pid: int | None = None
    gates: list[Gate] = field(default_factory=list)
    rollback_gates: list[Gate] = field(default_factory=list)
    error: str | None = None
    # The output canary's figures (appliance.canary.Result.figures, plus its cost); None when
    # the canary did not run (off, or a rollback).
    canary: dict | None = None
    # What interrupted it: a signal's name (SIGINT, SIGTERM, SIGHUP), or "killed" when a later
    # `appliance rollback` finished an entry whose process died without an end line.
    interrupted: str | None = None
    # The image IDs the references named at the start: tags move (`appliance image build`), an
    # ID does not. None in a line written by an older appliance, or when it could not be seen.
    from_image_id: str | None = None
    to_image_id: str | None = None

    @classmethod
    def begin(
        cls,
        instance: str,
        kind: Kind,
        from_image: str | None,
        to_image: str,
        from_image_id: str | None = None,
        to_image_id: str | None = None,
    ) -> Entry:
        return cls(
            id=uuid.uuid4().hex[:12],
            instance=instance,
            kind=kind,
            from_image=from_image,
            to_image=to_image,
            outcome="started",
            started=time.time(),
            pid=os.getpid(),
            from_image_id=from_image_id,
            to_image_id=to_image_id,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict, where: str = "history entry") -> Entry:
        """An entry from its JSON object; a wrong type is one UsageError naming the field
        (keys an entry has no field for are ignored: a newer appliance's line stays readable)."""
        return records.from_dict(cls, data, where)


def append(path: Path, entry: Entry) -> None:
    """Append ``entry`` as one line, durably: the whole line or, on a write the disk refuses
    (full, a size limit), an OSError with the file as it was; then the file and its folder are
    synced (a new history file is only there after a power cut once its folder entry is)."""
    private_dir(path.parent)
    line = (entry.to_json() + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        # A line cut short by a crash has no newline; start ours on a fresh line.
        if size and _last_byte(path) != b"\n":
            line = b"\n" + line
        try:
            _write_all(fd, line)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # no half line left for the next append to follow
            raise
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written: a write may take only part of it."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:
            raise OSError(errno.EIO, "the history file took no more bytes")
        view = view[written:]


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def lines(path: Path, *, strict: bool = True) -> list[Entry]:
    """Every line of the history, in file order. A line cut short by a crash (not JSON) is
    skipped; a whole line with a wrong value is a UsageError naming the file, line and field
    (``strict=False``: skipped too, for the cutover and rollback, which a damaged history
    must never stop)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        try:
            data = json.loads(raw)
        except ValueError:
            continue  # a line a crash cut short
        try:
            out.append(Entry.from_dict(data, f"{path} line {number}"))
        except UsageError:
            if strict:
                raise
    return out


def entries(
    path: Path, *, live_ids: frozenset[str] = frozenset(), strict: bool = True
) -> list[Entry]:
    """One entry per cutover, oldest first: its end line, or its begin line marked interrupted.

    ``live_ids`` are cutovers known to be still running (their lock is held); those stay
    ``started``. ``strict``: as for :func:`lines`.
    """
    merged: dict[str, Entry] = {}
    for e in lines(path, strict=strict):
        if e.id in merged and e.outcome == "started":
            continue
        merged[e.id] = e
    out = list(merged.values())
    for e in out:
        if e.outcome == "started" and e.id not in live_ids:
            e.outcome = "interrupted"
    return out
