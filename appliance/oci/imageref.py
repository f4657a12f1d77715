"""Container image references: the one check used before any reference reaches a file or Docker.

The grammar is Docker's (distribution/reference): ``[host[:port]/]path[:tag][@digest]``, path
components lowercase. A reference that fails it (spaces, shell metacharacters, upper case,
an empty tag) never gets written into an env file, where the unit would only fail at start.
"""

from __future__ import annotations

import re

from ..errors import UsageError

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_NAME = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_REFERENCE = re.compile(
    rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?", re.ASCII
)

MAX_NAME_LENGTH = 255


def validate(ref: str) -> str:
    """Return ``ref`` when it is a valid image reference, else raise a UsageError naming it."""
    match = _REFERENCE.fullmatch(ref or "")
    if match is None or len(match.group("name")) > MAX_NAME_LENGTH:
        raise UsageError(
            f"invalid image reference {ref!r}",
            fix="expected NAME[:TAG][@DIGEST], e.g. gemma4-vllm:0.21.0-mtp "
            "(lowercase name; no spaces or shell characters)",
        )
    return ref
