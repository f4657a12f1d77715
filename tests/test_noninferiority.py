"""The live acceptance rule (appliance.judge.noninferiority): its three answers as properties that
hold for any samples, its refusals, and its numbers."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.errors import UsageError
from appliance.judge import noninferiority as ni

RULE = ni.Rule(margin=0.05, min_samples=10, min_calls=10)
acceptances = st.floats(0.0, 1.0, allow_nan=False)
enough = st.lists(acceptances, min_size=10, max_size=40)
# Each example resamples 2 x 1000 times: fewer examples than hypothesis' 100 keep the file fast.
few_examples = settings(max_examples=40)


def _side(values, calls=None) -> ni.Side:
    return ni.Side(tuple(values), calls)


@few_examples
@given(enough)
def test_identical_samples_are_never_worse(values):
    j = ni.judge(_side(values), _side(values), RULE)
    assert j.decision != ni.WORSE
    assert j.low <= 0.0 <= j.high
    assert j.difference == 0.0


@few_examples
@given(enough, st.floats(0.0, 0.049))
def test_samples_within_the_margin_of_each_other_are_not_worse(before, spread):
    # Every resampled mean after is at most ``spread`` under any resampled mean before.
    after = [max(before) - spread] * len(before)
    j = ni.judge(_side(before), _side(after), RULE)
    assert j.decision == ni.NOT_WORSE, j.summary()
    assert j.low >= -RULE.margin


@few_examples
@given(enough, enough, st.floats(0.051, 1.0))
def test_an_after_side_clearly_lower_is_worse(before, after, gap):
    # Every value after lies ``gap`` (> margin) under every value before: even the interval's
    # optimistic end is beyond the margin.
    before = [gap + v * (1.0 - gap) for v in before]
    after = [min(v, min(before) - gap) for v in after]
    j = ni.judge(_side(before), _side(after), RULE)
    assert j.decision == ni.WORSE, j.summary()
    assert j.high < -RULE.margin


@given(
    st.lists(acceptances, min_size=0, max_size=9),
    st.lists(acceptances, min_size=0, max_size=40),
    st.booleans(),
)
def test_too_few_samples_on_either_side_never_decide(few, many, few_first):
    before, after = (few, many) if few_first else (many, few)
    j = ni.judge(_side(before), _side(after), RULE)
    assert j.decision == ni.NOT_ENOUGH
    assert j.low is None and j.high is None
    assert "of 10 calls" in j.why


@given(enough, st.integers(0, 9))
def test_too_few_calls_never_decide_however_many_windows(values, calls):
    # Forty windows of one long call are one call: no decision, even on a collapse.
    j = ni.judge(_side(values, calls=calls), _side([0.0] * 40, calls=50), RULE, "windows")
    assert j.decision == ni.NOT_ENOUGH
    assert f"before spans {calls} of 10 calls" in j.why


def test_an_interval_across_the_margin_waits_for_more_calls():
    before = [0.7, 0.9] * 5
    after = [0.6, 0.9] * 5  # the mean fell 5 points; ten samples of this spread cannot tell
    j = ni.judge(_side(before), _side(after), RULE)
    assert j.decision == ni.NOT_ENOUGH
    assert j.why == "the interval straddles the margin"
    assert j.low < -RULE.margin <= j.high
    # Forty times the samples narrow it: a drop of 2 points is within the margin.
    j = ni.judge(_side(before * 40), _side([0.66, 0.9] * 200), RULE)
    assert j.decision == ni.NOT_WORSE, j.summary()


def test_the_same_samples_always_get_the_same_interval():
    before, after = [0.8, 0.7, 0.95, 0.6] * 4, [0.75, 0.7, 0.9, 0.5] * 4
    first = ni.judge(_side(before), _side(after), RULE)
    assert all(ni.judge(_side(before), _side(after), RULE) == first for _ in range(3))
    other = ni.judge(_side(before), _side(after), ni.Rule(seed=2))
    assert (other.low, other.high) != (first.low, first.high)


def test_the_interval_covers_the_true_difference_at_its_confidence():
    """Calibration: 100 pairs of sides drawn from two normal distributions 0.1 apart; the 95%
    interval covers the true difference about 95 times (the percentile bootstrap covers a
    little less at 20 samples a side). Fixed seeds: the count is the same on every run."""
    rng = random.Random(7)
    covered = 0
    for trial in range(100):
        before = [rng.gauss(0.75, 0.1) for _ in range(20)]
        after = [rng.gauss(0.65, 0.1) for _ in range(20)]
        low, high = ni.interval(before, after, ni.Rule(seed=trial))
        covered += low <= -0.1 <= high
    assert 88 <= covered <= 99, covered


def test_the_summary_and_figures_carry_every_number():
    before = [0.8] * 6 + [0.9] * 6
    after = [0.2] * 12
    j = ni.judge(_side(before, calls=30), _side(after, calls=25), RULE, "windows")
    assert j.decision == ni.WORSE
    assert j.summary() == (
        "worse: mean acceptance 85.0% -> 20.0%, 95% interval of the change [-0.675, -0.625] "
        "against margin -0.050, n 12 windows (30 calls) before, 12 windows (25 calls) after, "
        "1000 bootstrap resamples"
    )
    figs = j.figures()
    assert figs["before"] == {"n": 12, "calls": 30, "mean": 0.85}
    assert figs["after"] == {"n": 12, "calls": 25, "mean": 0.2}
    assert figs["difference"] == pytest.approx(-0.65)
    assert (figs["margin"], figs["confidence"], figs["resamples"]) == (0.05, 0.95, 1000)
    assert figs["low"] <= statistics.fmean(after) - statistics.fmean(before) <= figs["high"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"margin": 1.5}, "margin must be within 0..1, not 1.5"),
        ({"margin": float("nan")}, "margin must be within 0..1, not nan"),
        ({"confidence": 1.0}, "confidence must be within 0.5..1"),
        ({"min_samples": 1}, "at least 2 samples"),
        ({"resamples": 10}, "at least 100 bootstrap resamples"),
    ],
)
def test_a_rule_out_of_range_is_refused(kwargs, message):
    with pytest.raises(UsageError, match=message):
        ni.Rule(**kwargs)


def test_a_steady_side_settles_at_the_least_evidence_and_a_varying_one_does_not():
    rule = ni.Rule()  # margin 0.05: settled once the mean is known to within 0.0125
    assert not ni.settled(_side([1.0] * 9, calls=20), rule)  # 9 of 10 windows
    assert not ni.settled(_side([1.0] * 10, calls=9), rule)  # 9 of 10 calls
    assert ni.settled(_side([1.0] * 10, calls=10), rule)
    # Windows between 0.6 and 0.9: a half-width of 0.098 at 10 windows, still 0.036 at 30.
    varying = [0.6, 0.9] * 15
    assert not ni.settled(_side(varying[:10], calls=10), rule)
    assert not ni.settled(_side(varying, calls=30), rule)
    # The same spread around 0.75 settles once enough windows pin the mean down.
    assert ni.settled(_side([0.6, 0.9] * 300, calls=600), rule)


@given(st.lists(st.floats(0.0, 1.0), min_size=10, max_size=60))
@settings(max_examples=200, deadline=None)
def test_a_side_that_settled_has_its_normal_half_width_within_a_quarter_margin(values):
    rule = ni.Rule()
    side = _side(values, calls=len(values))
    half = 1.959964 * statistics.stdev(values) / len(values) ** 0.5
    assert (
        ni.settled(side, rule) == (half <= rule.margin / 4 + 1e-9)
        or abs(half - rule.margin / 4) < 1e-6
    )
