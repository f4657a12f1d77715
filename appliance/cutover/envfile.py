"""Read and rewrite an instance's env file atomically, touching only the one assignment.

The file is systemd's ``EnvironmentFile=`` format. A cutover changes ``VLLM_IMAGE`` and nothing
else: every other byte (comments, order, other keys, a missing final newline) is preserved, so
a rollback that writes the saved bytes back is byte-identical to before. Writes go to a
temporary file in the same directory, are fsynced, and replace the file with ``rename(2)``: a
reader (systemd, or the next ``appliance status``) sees the old file or the new one, never part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .. import fsutil
from ..errors import ApplianceError, UsageError

IMAGE_KEY = "VLLM_IMAGE"

_ASSIGN = re.compile(rb"^[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*=(.*?)(\r?)$")


class EnvFileError(ApplianceError):
    """The env file is missing or unreadable."""


@dataclass(frozen=True)
class EnvFile:
    """The bytes of one env file and what its assignments say."""

    path: Path
    raw: bytes

    def get(self, key: str) -> str | None:
        """The value of the last assignment of ``key`` (systemd's rule), unquoted."""
        value = None
        for line in self.raw.split(b"\n"):
            m = _ASSIGN.match(line)
            if m and m.group(1).decode() == key:
                value = _unquote(m.group(2).decode("utf-8", "replace").strip())
        return value

    def with_value(self, key: str, value: str) -> bytes:
        """The file's bytes with ``key`` set to ``value``; every other line unchanged."""
        return set_value(self.raw, key, value)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def set_value(raw: bytes, key: str, value: str) -> bytes:
    """Set ``key=value`` in env-file bytes: replace the last assignment, or append one."""
    if any(c in value for c in "\n\r\0"):
        raise UsageError(f"{key} value must be one line")
    lines = raw.split(b"\n")
    last = None
    for i, line in enumerate(lines):
        m = _ASSIGN.match(line)
        if m and m.group(1).decode() == key:
            last = i
    new = f"{key}={value}".encode()
    if last is not None:
        cr = _ASSIGN.match(lines[last]).group(3)
        lines[last] = new + cr
        return b"\n".join(lines)
    if raw and not raw.endswith(b"\n"):
        raw += b"\n"
    return raw + new + b"\n"


def read(path: Path) -> EnvFile:
    """The env file at ``path``; a clear error if it is not there."""
    try:
        return EnvFile(path, path.read_bytes())
    except FileNotFoundError:
        raise EnvFileError(
            f"no env file {path}", fix="install the instance first: appliance install ..."
        ) from None
    except OSError as exc:
        raise EnvFileError(f"cannot read {path}: {exc.strerror}") from exc


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` atomically, keeping its mode and owner when it exists (:mod:`..fsutil`)."""
    fsutil.write_atomic(path, data, mode=mode)


def set_image(path: Path, image: str) -> tuple[bytes, bytes]:
    """Set ``VLLM_IMAGE`` in the env file at ``path``; returns ``(old_bytes, new_bytes)``."""
    old = read(path)
    new = old.with_value(IMAGE_KEY, image)
    write_atomic(path, new)
    return old.raw, new
