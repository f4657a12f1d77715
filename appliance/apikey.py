"""The one reader of API key files, with one rule for every caller (doctor, bench, cutover).

The rule, the same as the serve script's: surrounding whitespace (a trailing newline, CRLF line
endings, spaces) is not part of the key; an empty file is an error, not "no key" (vLLM started
with an empty key would accept anyone); the key must be made of URL-safe characters, so it can
never be mangled on its way through a shell, an HTTP header or a container's environment.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import UsageError

# token_urlsafe's alphabet plus the base64 and "." characters: enough for any generated key,
# nothing a shell, a header or an env file could read two ways.
SAFE_KEY = re.compile(r"[A-Za-z0-9._~+/=-]+")
SAFE_KEY_TEXT = "letters, digits and ._~+/=-"


def parse(text: str, where: str) -> str:
    """The key in ``text`` (the content of ``where``) by the rule above, else a UsageError."""
    key = text.strip()
    if not key:
        raise UsageError(f"API key file {where} is empty", fix="write the key into it, or remove it")
    if not SAFE_KEY.fullmatch(key):
        raise UsageError(
            f"API key file {where} holds characters outside the safe set ({SAFE_KEY_TEXT})",
            fix="generate a new key, e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
        )
    return key


def read(path: Path | str) -> str | None:
    """The key in ``path``; ``None`` when the file does not exist; a UsageError when it cannot
    be read, is empty or holds unsafe characters."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"cannot read API key file {path}: {getattr(exc, 'strerror', None) or exc}",
            fix="run as a user that may read it (root, for an installed instance)",
        ) from exc
    return parse(text, str(path))
