"""The one reader of API key files, with one rule for every caller (doctor, bench, cutover).

The rule, for the unit's serve program as for every command: surrounding whitespace (a
trailing newline, CRLF line endings, spaces) is not part of the key; an empty file is an error,
not "no key" (vLLM started with an empty key would accept anyone); the key must be made of
URL-safe characters, so it can never be mangled on its way through a shell, an HTTP header or a
container's environment; a NUL byte or a file over 4 KiB is no key either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from .layout import Layout

# token_urlsafe's alphabet plus the base64 and "." characters: enough for any generated key,
# nothing a shell, a header or an env file could read two ways.
SAFE_KEY = re.compile(r"[A-Za-z0-9._~+/=-]+")
SAFE_KEY_TEXT = "letters, digits and ._~+/=-"
MAX_KEY_BYTES = 4096  # a generated key is 43 characters


def parse(text: str, where: str) -> str:
    """The key in ``text`` (the content of ``where``) by the rule above, else a UsageError."""
    key = text.strip()
    if not key:
        raise UsageError(
            f"API key file {where} is empty", fix="write the key into it, or remove it"
        )
    if not SAFE_KEY.fullmatch(key):
        raise UsageError(
            f"API key file {where} holds characters outside the safe set ({SAFE_KEY_TEXT})",
            fix="generate a new key: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
        )
    return key


def read(path: Path | str) -> str | None:
    """The key in ``path``; ``None`` when the file does not exist; a UsageError when it cannot
    be read, is empty or holds unsafe characters."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_BYTES + 1)
        if len(data) > MAX_KEY_BYTES:
            raise UsageError(
                f"API key file {path} holds more than {MAX_KEY_BYTES} bytes: not a key",
                fix="write the key alone into it",
            )
        text = data.decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"cannot read API key file {path}: {getattr(exc, 'strerror', None) or exc}",
            fix="run as a user that may read it (root, for an installed instance)",
        ) from exc
    return parse(text, str(path))


@dataclass(frozen=True)
class ApiKey:
    """A key to send and where it came from (``source`` is safe to print; the key is not)."""

    value: str = field(repr=False)
    source: str


def resolve(
    api_key: str | None = None,
    api_key_file: Path | str | None = None,
    instance: str | None = None,
    root: Path = Path("/"),
) -> ApiKey | None:
    """The key to send: ``api_key_file``, else ``api_key``, else the instance's key file.

    The instance's file (``<root>/etc/gemma4-vllm/<instance>.api-key``, a group's head's
    ``<group>-head.api-key``, written by ``appliance instance install``) is optional: an
    instance without one runs vLLM without a key. A named
    ``api_key_file`` must exist. Every file is read by :func:`read`'s rule.
    """
    # A bad instance name is the first thing to report, whatever else was given.
    key_path = Layout(root).served_key_file(instance) if instance is not None else None
    if api_key_file is not None:
        key = read(api_key_file)
        if key is None:
            raise UsageError(f"API key file {api_key_file} does not exist")
        return ApiKey(key, f"file {api_key_file}")
    if api_key and api_key.strip():
        return ApiKey(api_key.strip(), "--api-key/VLLM_API_KEY")
    if key_path is not None:
        key = read(key_path)
        if key is not None:
            return ApiKey(key, f"file {key_path}")
    return None
