"""vLLM versions: one parser (``packaging``'s), one ordering, one "does it serve Gemma 4 MTP?".

Versions are compared by their release numbers only: ``0.32.0rc1+cpu`` is a 0.32.0 as far as a
profile's ``min_vllm`` or the MTP flag go (a release candidate or a CPU build has the feature
set of its release).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from ..errors import UsageError
from ..oci import labels


def parse(text: str) -> Version:
    """``text`` as a version, or a UsageError naming it."""
    try:
        return Version(text.strip())
    except (InvalidVersion, AttributeError):
        raise UsageError(f"not a version: {text!r}", fix="expected e.g. 0.32.0") from None


def release(text: str) -> tuple[int, ...]:
    """The release numbers of ``text``: ``"0.32.0rc1+cpu"`` -> ``(0, 32, 0)``; trailing zeros
    do not count (``0.32`` and ``0.32.0`` are the same release)."""
    numbers = list(parse(text).release)
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def older(version: str, than: str) -> bool:
    """True when ``version``'s release comes before ``than``'s."""
    return release(version) < release(than)


def same_release(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name the same release (a server's and its image label's)."""
    return release(a) == release(b)


def has_mtp(version: str) -> bool:
    """True when vLLM ``version`` serves Gemma 4 MTP (``labels.MTP_MIN_VLLM`` and later); an
    unreadable version does not."""
    return _at_least(version, labels.MTP_MIN_VLLM)


def has_per_request_metrics(version: str) -> bool:
    """True when vLLM ``version`` has ``--per-request-spec-decode-metrics`` (unreadable: no)."""
    return _at_least(version, labels.PER_REQUEST_METRICS_MIN_VLLM)


def has_queue_bound(version: str) -> bool:
    """True when vLLM ``version`` has ``--max-num-queued-reqs`` (unreadable: no)."""
    return _at_least(version, labels.QUEUE_BOUND_MIN_VLLM)


def has_drain(version: str) -> bool:
    """True when vLLM ``version`` has ``--shutdown-timeout`` (unreadable: no)."""
    return _at_least(version, labels.DRAIN_MIN_VLLM)


def _at_least(version: str, minimum: str) -> bool:
    try:
        return not older(version, minimum)
    except UsageError:
        return False
