"""One version helper: releases compared by number, suffixes ignored, MTP from one threshold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.engine_api import versions
from appliance.errors import UsageError
from appliance.oci import labels

releases = st.lists(st.integers(0, 40), min_size=1, max_size=4)
suffixes = st.sampled_from(["", "rc1", ".dev0", "+cpu", "rc2+cpu", ".post1"])


def _text(numbers: list[int], suffix: str = "") -> str:
    return ".".join(map(str, numbers)) + suffix


@given(releases, releases, suffixes, suffixes)
def test_order_is_the_release_numbers_whatever_the_suffix(a, b, sa, sb):
    def key(n):  # trailing zeros name the same release
        n = list(n)
        while len(n) > 1 and n[-1] == 0:
            n.pop()
        return tuple(n)

    assert versions.older(_text(a, sa), _text(b, sb)) == (key(a) < key(b))
    assert versions.same_release(_text(a, sa), _text(b, sb)) == (key(a) == key(b))


@given(releases, suffixes)
def test_mtp_starts_at_the_one_threshold(n, suffix):
    text = _text(n, suffix)
    assert versions.has_mtp(text) == (not versions.older(text, labels.MTP_MIN_VLLM))
    assert versions.has_per_request_metrics(text) == (
        not versions.older(text, labels.PER_REQUEST_METRICS_MIN_VLLM)
    )
    assert versions.has_queue_bound(text) == (not versions.older(text, labels.QUEUE_BOUND_MIN_VLLM))
    assert versions.has_drain(text) == (not versions.older(text, labels.DRAIN_MIN_VLLM))


@pytest.mark.parametrize(
    ("version", "mtp", "per_request"),
    [
        ("0.19.0", False, False),
        ("0.21.0", True, False),
        ("0.21", True, False),
        ("0.21.0rc1+cpu", True, False),
        ("0.32.0+cpu", True, True),
        ("1.0", True, True),
        ("nonsense", False, False),
    ],
)
def test_the_shipped_versions(version, mtp, per_request):
    assert versions.has_mtp(version) is mtp
    assert versions.has_per_request_metrics(version) is per_request
    # --max-num-queued-reqs came with 0.29 (vLLM PR #49445): in the 0.32 images, not 0.21's.
    assert versions.has_queue_bound(version) is per_request
    # --shutdown-timeout came with 0.18 (vLLM PR #36666): both CPU images (0.19, 0.32) have it.
    assert versions.has_drain(version) is (version != "nonsense")


@pytest.mark.parametrize("text", ["", "v", "0.32.x", "latest"])
def test_an_unreadable_version_is_one_line(text):
    with pytest.raises(UsageError) as err:
        versions.parse(text)
    assert str(err.value) == f"not a version: {text!r} (expected e.g. 0.32.0)"
