"""The one acceptance judgement (appliance.judge.acceptance) that the canary, the fleet soak and the
paired bench share: its statistic, its tolerances and its refusals, tested once here; each caller's
own tests check that it hands over the right samples."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.engine_api.specdecode import Delta
from appliance.errors import UsageError
from appliance.judge import acceptance


def _d(accepted: int, drafts: int = 10, k: int = 2) -> Delta:
    """``drafts`` steps of ``k`` draft tokens, ``accepted`` of them accepted (front first)."""
    per_pos = tuple(min(drafts, max(0, accepted - i * drafts)) for i in range(k))
    return Delta("ok", drafts, drafts * k, accepted, per_pos)


def test_a_drop_across_the_set_fails_naming_both_figures():
    change = acceptance.change([(_d(16), _d(8))] * 5, "prompts")
    assert (change.samples, change.median_change) == (5, pytest.approx(-0.4))
    assert change.failures(acceptance.Tolerance()) == (
        "draft acceptance fell 80% -> 40% (median drop 40% over 5 prompts, tolerance 10%)",
    )
    figs = change.figures()
    assert figs["before"] == {"acceptance": 0.8, "tokens_per_step": 2.6, "per_position": [1.0, 0.6]}
    assert figs["after"]["per_position"] == [0.8, 0.0]


def test_one_window_is_judged_on_its_own_change_and_on_tokens_per_step():
    change = acceptance.change([(_d(18), _d(8))], "windows")
    tol = acceptance.Tolerance(max_acceptance_drop=0.1, max_tokens_per_step_drop=0.1)
    assert change.failures(tol) == (
        "draft acceptance fell 90% -> 40% (drop 50%, tolerance 10%)",
        "tokens per step fell 2.80 -> 1.80 (by 36%, tolerance 10%)",
    )
    # Without a tokens-per-step tolerance only acceptance is judged.
    assert len(change.failures(acceptance.Tolerance(0.1))) == 1


def test_a_rise_passes_and_says_by_how_much():
    change = acceptance.change([(_d(8), _d(16))] * 3, "prompts")
    assert change.failures(acceptance.Tolerance()) == ()
    assert "acceptance 40% -> 80% over 3 prompts (median change +40%" in change.summary()


def test_samples_that_did_not_draft_on_both_sides_are_left_out():
    absent = Delta("absent")
    assert acceptance.change([(absent, _d(10)), (None, _d(10))]) is None
    assert acceptance.change([(_d(10), Delta("reset"))]) is None
    assert acceptance.change([(Delta("ok", 0, 0, 0, ()), _d(10))]) is None
    assert acceptance.change([(absent, _d(10)), (_d(10), _d(4))]).samples == 1


@pytest.mark.parametrize("field", ["max_acceptance_drop", "max_tokens_per_step_drop"])
def test_tolerances_outside_0_1_are_refused_naming_the_field(field):
    with pytest.raises(UsageError, match=f"{field} must be within 0..1, not 1.5"):
        acceptance.Tolerance(**{field: 1.5})


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=9),
    st.sampled_from([0.0, 0.05, 0.1, 0.25]),
)
def test_the_verdict_follows_the_median_per_sample_change(pairs, tolerance):
    change = acceptance.change([(_d(b), _d(a)) for b, a in pairs])
    median = statistics.median(a / 20 - b / 20 for b, a in pairs)
    assert change.median_change == pytest.approx(median)
    # The summed figures are over the counts, never an average of per-sample ratios.
    assert change.before.acceptance == pytest.approx(sum(b for b, _ in pairs) / (20 * len(pairs)))
    failed = bool(change.failures(acceptance.Tolerance(tolerance)))
    assert failed == (-median > tolerance + 1e-9)
