"""An instance's env file: the one parser (one rule for everyone) and the byte-preserving editor.

The file is systemd's ``EnvironmentFile=``. Systemd's own grammar has backslash escapes, line
continuations, ``"a"b`` concatenation and multi-line quoted values, and systemd before 254 lets
a comment ending in ``\\`` swallow the next line; a parser that skips any of these reads another
value than the unit runs. So the appliance reads only the subset whose meaning is the same for
both, and refuses the rest with one line naming it, before anything is touched:

- blank lines, and comments (``#`` or ``;`` first) that do not end in a backslash;
- ``KEY=value`` with ``KEY`` a shell name, spaces around ``=`` ignored, trailing spaces dropped;
- ``value`` either bare or wholly inside one pair of ``"`` or ``'``, with no quote or backslash
  anywhere else in it; the last assignment of a key wins (as in systemd).

:func:`parse` is that rule; :class:`EnvFile` applies it to a file's bytes, and
:meth:`EnvFile.with_value` changes one assignment while every other byte (comments, order, other
keys, CRLF, a missing final newline) stays, so a rollback that writes the saved bytes back is
byte-identical to before. Units, cutover, status and doctor all read env files through here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..errors import ApplianceError, UsageError

# The keys the appliance writes in an env file, their one home (templates, serve program, status).
IMAGE_KEY = "VLLM_IMAGE"
PROFILE_KEY = "APPLIANCE_PROFILE"
HOST_KEY = "VLLM_HOST"
PORT_KEY = "VLLM_PORT"
GPUS_KEY = "VLLM_GPUS"
MODEL_DIR_KEY = "MODEL_DIR"
HF_CACHE_KEY = "HF_CACHE_DIR"
VLLM_CACHE_KEY = "VLLM_CACHE_DIR"

_ASSIGN = re.compile(rb"^[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*=(.*?)(\r?)$")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUOTES = "\"'"
FIX = "write one KEY=value a line, the value bare or in one pair of quotes, without backslashes"


class EnvFileError(ApplianceError):
    """The env file is missing or unreadable."""


class UnknownInstance(EnvFileError, UsageError):
    """No env file: the instance NAME is not installed here. Bad input (exit 2), the one line
    every command that takes a NAME says for a name it does not know."""

    name: str
    path: Path


def unknown_instance(name: str, path: Path, *, alternative: str = "") -> UnknownInstance:
    """The one refusal of an unknown instance ``name`` whose env file would be ``path``;
    ``alternative``: what else the command takes instead (``give --url``)."""
    fix = (
        f"`appliance status` lists the installed instances; "
        f"`appliance instance install {name} --profile PROFILE` installs it"
    )
    exc = UnknownInstance(
        f"no instance {name}: no {path}", fix=f"{fix}; or {alternative}" if alternative else fix
    )
    exc.name, exc.path = name, path
    return exc


class EnvFileSyntaxError(UsageError):
    """A line systemd and the appliance could read differently: refused, never guessed."""


def _value(text: str) -> str | None:
    """The value of ``KEY=text`` by the rule above; None when it is outside the rule."""
    text = text.strip(" \t")
    if "\\" in text:
        return None
    if text[:1] and text[0] in _QUOTES:
        inner = text[1:-1]
        if len(text) < 2 or text[-1] != text[0] or any(q in inner for q in _QUOTES):
            return None
        return inner
    return None if any(q in text for q in _QUOTES) else text


def parse(raw: bytes, where: str = "env file") -> dict[str, str]:
    """The assignments of env-file bytes (last one wins); an
    :class:`EnvFileSyntaxError` naming ``where`` and the line for anything outside the rule."""
    out: dict[str, str] = {}
    for number, line_bytes in enumerate(raw.split(b"\n"), 1):
        try:
            line = line_bytes.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            raise EnvFileSyntaxError(f"{where}:{number}: not UTF-8", fix=FIX) from None
        body = line.lstrip(" \t")
        if not body:
            continue
        if body[0] in "#;":
            if body.rstrip(" \t").endswith("\\"):
                raise EnvFileSyntaxError(
                    f"{where}:{number}: a comment ending in a backslash (older systemd joins "
                    f"the next line to it): {line!r}",
                    fix="remove the trailing backslash",
                )
            continue
        key, eq, rest = body.partition("=")
        key = key.rstrip(" \t")
        value = _value(rest) if eq and _KEY.fullmatch(key) else None
        if value is None:
            raise EnvFileSyntaxError(
                f"{where}:{number}: systemd and the appliance could read this line "
                f"differently: {line!r}",
                fix=FIX,
            )
        out[key] = value
    return out


@dataclass(frozen=True)
class EnvFile:
    """The bytes of one env file and what its assignments say."""

    path: Path
    raw: bytes

    @cached_property
    def values(self) -> dict[str, str]:
        """Every assignment, by :func:`parse` (raises on a line outside the rule)."""
        return parse(self.raw, str(self.path))

    def get(self, key: str) -> str | None:
        """The value of the last assignment of ``key``, unquoted; None when unset."""
        return self.values.get(key)

    def with_value(self, key: str, value: str) -> bytes:
        """The file's bytes with ``key`` set to ``value``; every other line unchanged."""
        return set_value(self.raw, key, value)


def set_value(raw: bytes, key: str, value: str) -> bytes:
    """Set ``key=value`` in env-file bytes: replace the last assignment, or append one."""
    if any(c in value for c in "\n\r\0"):
        raise UsageError(f"{key} value must be one line")
    new = f"{key}={value}".encode()
    try:
        same = parse(new) == {key: value}
    except EnvFileSyntaxError:
        same = False
    if not same:
        raise UsageError(f"{key} value {value!r} cannot be written bare", fix=FIX)
    lines = raw.split(b"\n")
    last = None
    for i, line in enumerate(lines):
        m = _ASSIGN.match(line)
        if m and m.group(1).decode() == key:
            last = i
    if last is not None:
        cr = _ASSIGN.match(lines[last]).group(3)
        lines[last] = new + cr
        return b"\n".join(lines)
    if raw and not raw.endswith(b"\n"):
        raw += b"\n"
    return raw + new + b"\n"


def read(path: Path) -> EnvFile:
    """The env file at ``path``, checked against the rule; a clear error if it is not there."""
    try:
        env = EnvFile(path, path.read_bytes())
    except FileNotFoundError:
        raise unknown_instance(path.stem, path) from None
    except OSError as exc:
        raise EnvFileError(f"cannot read {path}: {exc.strerror}") from exc
    env.values  # noqa: B018 -- refuse an ambiguous file before anyone acts on it
    return env
