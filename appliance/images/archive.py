"""Images onto hosts without a registry: ``docker save`` archives, written and loaded whole.

:func:`save` streams one image out of the engine into an archive, written the way
:mod:`appliance.fsutil` writes a file (a temporary file in the same directory, renamed over the
target once complete; removed on any failure, Ctrl-C included), and reads the archive as it
streams so that what it records is what the file holds: the image ID, the tags, the sha256.

:func:`load` reads the archive once before the engine sees a byte of it: every member present,
every content-addressed file (the image config, ``blobs/sha256/*``) hashing to its name, the image
the manifest names being the one expected. Only then does the engine load it, and the image ID
and each tag are read back from the engine. A truncated or corrupt archive, or another image than
the expected one, is refused without loading anything.

The image ID is the config's digest (the classic image store, every engine this appliance
supports); an engine with the containerd image store names an image by its manifest's digest,
which the archive's ``index.json`` lists, so that digest is accepted as the same image too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import tarfile
import time
from pathlib import Path

from .. import fsutil, progress
from ..errors import ApplianceError, UsageError
from . import refused

CHUNK = 1 << 20
_HEX = re.compile(r"[0-9a-f]{64}")
# Content-addressed members: the legacy layout's config (<hex>.json) and the OCI layout's blobs.
_ADDRESSED = re.compile(r"^(?:blobs/sha256/([0-9a-f]{64})|([0-9a-f]{64})\.json)$")
_SMALL = 4 << 20  # the manifest, index and config are kept in memory; layers only hashed


class ArchiveError(ApplianceError):
    """An image archive that is incomplete, corrupt, or holds another image than expected."""


@dataclasses.dataclass(frozen=True)
class ArchiveInfo:
    """What an archive holds, as read from its own bytes."""

    image_id: str  # sha256:<config digest>
    tags: list[str]
    sha256: str  # of the archive file
    size_bytes: int
    # Every ID an engine may give the image: the config's digest, and the manifests' digests
    # (the containerd image store's image ID).
    ids: frozenset[str]


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """An archive and the image it holds, as the engine has it after the load."""

    path: str
    image_id: str
    tags: list[str]
    archive_sha256: str
    size_bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class SaveResult(LoadResult):
    """The same, for the archive written, and the reference it was saved from."""

    ref: str


def normalize_id(image_id: str) -> str:
    """``sha256:<64 hex>`` from that or the bare 64 hex digits; anything shorter is refused (an
    ID prefix names an image, it does not verify one)."""
    hexpart = image_id.removeprefix("sha256:").lower()
    if not _HEX.fullmatch(hexpart):
        raise UsageError(
            f"{image_id!r} is not a full image ID",
            fix="give sha256:<64 hex digits>, as `appliance image save` prints it",
        )
    return f"sha256:{hexpart}"


class _Reader:
    """A file-like view of a byte stream that hashes (and optionally copies) what is read."""

    def __init__(self, read, copy_to=None, meter: progress.Meter | None = None) -> None:
        self._read = read
        self._copy_to = copy_to
        self._meter = meter
        self.sha256 = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._read(n)
        self.sha256.update(data)
        self.size += len(data)
        if self._copy_to is not None:
            self._copy_to.write(data)
        if self._meter is not None:
            self._meter.update(len(data))
        return data

    def drain(self) -> None:
        """Read to the end (the zero blocks after the tar's last member)."""
        while self.read(CHUNK):
            pass


class _Chunks:
    """``read(n)`` over an iterator of byte chunks (the engine's ``docker save`` stream)."""

    def __init__(self, chunks) -> None:
        self._it = iter(chunks)
        self._buf = bytearray()  # deleting from its front is cheap (no copy of the rest)

    def __call__(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            chunk = next(self._it, None)
            if chunk is None:
                break
            self._buf += chunk
        if n < 0:
            n = len(self._buf)
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data


def _inspect(stream: _Reader, what: str) -> ArchiveInfo:
    """Read a whole ``docker save`` archive from ``stream``; refuse an incomplete or corrupt one."""
    names: set[str] = set()
    small: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tar:
            for member in tar:
                names.add(member.name.removeprefix("./"))
                if not member.isfile():
                    continue
                name = member.name.removeprefix("./")
                f = tar.extractfile(member)
                h, kept = hashlib.sha256(), []
                got = 0
                while data := f.read(CHUNK):
                    h.update(data)
                    got += len(data)
                    if member.size <= _SMALL:
                        kept.append(data)
                if got != member.size:
                    raise ArchiveError(f"{what} is truncated: {name} ends early")
                m = _ADDRESSED.match(name)
                if m and h.hexdigest() != (m.group(1) or m.group(2)):
                    raise ArchiveError(
                        f"{what} is corrupt: {name} does not hash to its name",
                        fix="copy the archive again, or save it again",
                    )
                if member.size <= _SMALL:
                    small[name] = b"".join(kept)
        stream.drain()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(
            f"{what} is not a complete image archive: {exc}",
            fix="copy the archive again, or save it again",
        ) from exc
    try:
        manifest = json.loads(small["manifest.json"])
    except (KeyError, ValueError) as exc:
        raise ArchiveError(
            f"{what} is not a complete image archive: no readable manifest.json",
            fix="copy the archive again, or save it again",
        ) from exc
    if not isinstance(manifest, list) or len(manifest) != 1:
        n = len(manifest) if isinstance(manifest, list) else "no"
        raise ArchiveError(f"{what} holds {n} images; `appliance image load` takes one")
    entry = manifest[0]
    config = str(entry.get("Config", ""))
    m = _ADDRESSED.match(config)
    missing = sorted({config, *entry.get("Layers", [])} - names)
    if not m or missing:
        raise ArchiveError(
            f"{what} is not a complete image archive: "
            + (f"missing {', '.join(missing[:3])}" if missing else f"config {config!r}"),
            fix="copy the archive again, or save it again",
        )
    image_id = f"sha256:{m.group(1) or m.group(2)}"
    return ArchiveInfo(
        image_id=image_id,
        tags=list(entry.get("RepoTags") or []),
        sha256=stream.sha256.hexdigest(),
        size_bytes=stream.size,
        ids=frozenset(_manifest_ids(small, image_id)),
    )


def _manifest_ids(small: dict[str, bytes], image_id: str) -> set[str]:
    """``image_id`` and the digests in ``index.json`` that lead to it: a manifest blob (hashed
    against its name above) whose config is ``image_id``, or an index of such manifests; the
    containerd image store names the image by one of these."""

    def blob(digest: str) -> dict:
        try:
            return json.loads(small[f"blobs/sha256/{digest.removeprefix('sha256:')}"])
        except (KeyError, ValueError):
            return {}

    def leads_to_config(digest: str, depth: int = 0) -> bool:
        doc = blob(digest)
        if (doc.get("config") or {}).get("digest") == image_id:
            return True
        return depth < 1 and any(
            leads_to_config(str(m.get("digest")), depth + 1) for m in doc.get("manifests") or []
        )

    ids = {image_id}
    with contextlib.suppress(KeyError, ValueError, TypeError, AttributeError):
        for m in json.loads(small["index.json"])["manifests"]:
            if leads_to_config(str(m["digest"])):
                ids.add(str(m["digest"]))
    return ids


def inspect(path: Path | str, *, show: bool = False) -> ArchiveInfo:
    """What the archive at ``path`` holds (one full read; nothing reaches the engine); with
    ``show``, the read's progress on stderr (:mod:`appliance.progress`)."""
    path = Path(path)
    try:
        f = path.open("rb")
        total = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    with f, contextlib.ExitStack() as stack:
        meter = stack.enter_context(progress.meter(f"checking {path}", total)) if show else None
        return _inspect(_Reader(f.read, meter=meter), str(path))


class _Upload:
    """The archive file as the engine's load reads it (a body of known length), counted."""

    def __init__(self, f, size: int, meter: progress.Meter) -> None:
        self._f, self._size, self._meter = f, size, meter

    def __len__(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._meter.update(len(data))
        return data


def _save_name(image, ref: str) -> str:
    """What to ask the engine to save: ``ref`` when it is one of the image's tags (the archive
    then carries that tag, and only that one: a floating tag such as ``mtp`` must not move on
    the target host unasked), else the bare ID (no tag; a repository name alone would save every
    tag of the repository)."""
    for name in (ref, f"{ref}:latest"):
        if name in image.tags:
            return name
    return image.id


def save(client, ref: str, out_path: Path | str) -> SaveResult:
    """Write image ``ref`` as a ``docker save`` archive at ``out_path``, atomically."""
    import docker.errors

    out = Path(out_path)
    if out.is_dir():
        raise UsageError(f"{out} is a directory", fix="give the archive's file name with --out")
    if not out.parent.is_dir():
        raise UsageError(
            f"cannot write {out}: the directory {out.parent} does not exist",
            fix=f"create it first: mkdir -p {out.parent}",
        )
    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound as exc:
        raise UsageError(
            f"no image {ref} in the Docker engine", fix="see `appliance image list`"
        ) from exc
    except docker.errors.APIError as exc:
        raise refused(f"inspect {ref}", exc) from exc
    name = _save_name(image, ref)
    started = time.monotonic()
    # The image's size: about the archive's (its layers' tars), known before the first byte.
    about = (image.attrs or {}).get("Size") or None
    with (
        fsutil.atomic_writer(out, mode=0o644) as f,
        progress.meter(f"saving {ref} to {out}", about) as meter,
    ):
        try:
            chunks = client.api.get_image(name, chunk_size=CHUNK)
            reader = _Reader(_Chunks(chunks), copy_to=f, meter=meter)
            info = _inspect(reader, f"the engine's save of {ref}")
        except docker.errors.APIError as exc:
            raise refused(f"save {ref}", exc) from exc
        if image.id not in info.ids:  # raised inside: the half-made archive goes
            raise ArchiveError(
                f"{ref} changed while it was saved (it was {image.id}, the archive holds "
                f"{info.image_id})",
                fix="save it again",
            )
    return SaveResult(
        ref=ref,
        path=str(out),
        image_id=image.id,
        tags=info.tags,
        archive_sha256=info.sha256,
        size_bytes=info.size_bytes,
        seconds=time.monotonic() - started,
    )


def load(connect, path: Path | str, expect_id: str | None = None) -> LoadResult:
    """Load the archive at ``path`` into the engine ``connect()`` returns and verify the image
    ID and its tags.

    The archive is read whole first, before the engine is asked anything: it is refused when
    it is missing, incomplete, corrupt, or holds another image than ``expect_id`` (default: the
    image its manifest names).
    """
    import docker.errors

    path = Path(path)
    want = normalize_id(expect_id) if expect_id else None
    started = time.monotonic()
    info = inspect(path, show=True)
    if want is not None and want not in info.ids:
        raise ArchiveError(
            f"{path} holds image {info.image_id}, not the expected {want}",
            fix="check --expect-id against the ID `appliance image save` printed",
        )
    client = connect()
    loaded: list[str] = []
    try:
        with (
            path.open("rb") as f,
            progress.meter(f"loading {path} into the engine", info.size_bytes) as meter,
        ):
            for chunk in client.api.load_image(_Upload(f, info.size_bytes, meter), quiet=True):
                err = chunk.get("errorDetail", {}).get("message") or chunk.get("error")
                if err:
                    raise ArchiveError(f"the Docker engine could not load {path}: {err}")
                m = re.match(r"Loaded image(?: ID)?: (\S+)", chunk.get("stream", ""))
                if m:
                    loaded.append(m.group(1))
    except docker.errors.APIError as exc:
        raise refused(f"load {path}", exc) from exc
    image_id = _engine_id(client, info.tags[0] if info.tags else info.image_id)
    for tag in info.tags:
        if (got := _engine_id(client, tag)) != image_id:
            raise ArchiveError(f"after loading {path}, {tag} is {got}, not {image_id}")
    # Any of info.ids names this one verified image (the store decides which the engine shows).
    if image_id not in info.ids:
        raise ArchiveError(
            f"after loading {path}, the engine holds {image_id}, not "
            f"{want or info.image_id}; loaded: {', '.join(loaded) or 'nothing'}"
        )
    return LoadResult(
        path=str(path),
        image_id=image_id,
        tags=info.tags,
        archive_sha256=info.sha256,
        size_bytes=info.size_bytes,
        seconds=time.monotonic() - started,
    )


def _engine_id(client, ref: str) -> str:
    import docker.errors

    try:
        return client.images.get(ref).id
    except docker.errors.ImageNotFound:
        return "nothing"
    except docker.errors.APIError as exc:
        raise refused(f"inspect {ref}", exc) from exc
