"""Write an instance's files: atomically, with their modes, idempotently, keeping its image.

:func:`write_tree` is the one writer (``render --out`` uses it too): every file goes to a
temporary file in its directory, gets its mode, is fsynced and renamed over the target, so a
reader (systemd, a cutover) sees the old file or the new one. Everything is rendered and
validated before the first write: a bad input leaves the tree untouched.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..fsutil import write_atomic
from ..profiles import Profile, get
from .template import MODE_SECRET, Options, RenderedFile, options_from_env, parse_env, paths, render

_PORT_LINE = re.compile(r"^readonly PORT=(\d+)$", re.MULTILINE)


@dataclass
class WriteResult:
    """What a write did, by absolute path."""

    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.written)


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` and ``mode`` in one rename (see :mod:`appliance.fsutil`)."""
    write_atomic(path, data, mode=mode)


def write_tree(root: Path, files: dict[str, RenderedFile]) -> WriteResult:
    """Write ``files`` under ``root``; a file already identical in content and mode is left."""
    result = WriteResult()
    for rel, rendered in sorted(files.items()):
        path = Path(root) / rel
        data = rendered.content.encode()
        try:
            same = path.read_bytes() == data and (path.stat().st_mode & 0o7777) == rendered.mode
        except FileNotFoundError:
            same = False
        if same:
            result.unchanged.append(path)
        else:
            atomic_write(path, data, rendered.mode)
            result.written.append(path)
    return result


def _existing_options(root: Path, instance: str, explicit: Options) -> Options:
    """Explicit options, else what the installed env file and serve script already say."""
    p = paths(instance)
    env_path = root / p.env
    try:
        existing = parse_env(env_path.read_text())
    except FileNotFoundError:
        existing = {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {env_path}: {exc}") from exc
    opts = options_from_env(existing, explicit)
    if opts.port is None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            m = _PORT_LINE.search((root / p.script).read_text())
            if m:
                opts = Options(**{**opts.__dict__, "port": int(m.group(1))})
    return opts


def install(
    profile: str | Profile,
    instance: str,
    *,
    root: Path | str = Path("/"),
    options: Options | None = None,
) -> WriteResult:
    """Install ``instance`` of ``profile`` under ``root``: unit, env file, serve script, API key.

    Re-running is idempotent (identical files are not rewritten). Values already in the
    instance's env file (``VLLM_IMAGE`` above all) and its port are kept unless given in
    ``options``. The API key file (mode 0600) is created once and never overwritten or shown.
    Does not call systemctl: ``root`` may be an image being built.
    """
    root = Path(root)
    prof = get(profile) if isinstance(profile, str) else profile
    opts = _existing_options(root, paths(instance).instance, options or Options())
    files = render(prof, instance, opts)  # validates everything before the first write
    result = write_tree(root, files)
    key = root / paths(instance).api_key
    if not key.exists():
        atomic_write(key, (secrets.token_urlsafe(32) + "\n").encode(), MODE_SECRET)
        result.written.append(key)
    elif key.stat().st_mode & 0o7777 != MODE_SECRET:
        os.chmod(key, MODE_SECRET)  # a key readable by others is a leaked key: tighten it
        result.written.append(key)
    else:
        result.unchanged.append(key)
    return result


def render_to(
    profile: str | Profile, instance: str, out: Path | str, options: Options | None = None
) -> WriteResult:
    """Render ``instance``'s files into ``out`` (same layout as under ``/``), no API key."""
    return write_tree(Path(out), render(profile, instance, options))
