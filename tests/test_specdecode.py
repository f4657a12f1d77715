"""Counter arithmetic: properties (hypothesis) and real captures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.bench import schedule
from appliance.engine_api import specdecode as sd

CAPTURE = Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp.txt"

counts = st.integers(min_value=0, max_value=10**9)


@st.composite
def counters(draw, k: int = 2):
    drafts = draw(counts)
    per_pos = tuple(draw(st.integers(0, drafts)) for _ in range(k))
    accepted = sum(per_pos)
    draft_tokens = drafts * k
    return sd.Counters(drafts, draft_tokens, accepted, per_pos, created=1.0)


@st.composite
def growth(draw, k: int = 2):
    """A reading and a later reading of the same, unrestarted counters."""
    before = draw(counters(k))
    steps = draw(st.integers(0, 10**6))
    pos_inc = tuple(draw(st.integers(0, steps)) for _ in range(k))
    after = sd.Counters(
        before.drafts + steps,
        before.draft_tokens + steps * k,
        before.accepted + sum(pos_inc),
        tuple(b + i for b, i in zip(before.accepted_per_pos, pos_inc)),
        created=1.0,
    )
    return before, after


@given(growth())
def test_delta_of_growing_counters_is_never_negative_and_in_range(pair):
    before, after = pair
    d = sd.counters_delta(before, after)
    assert d.status == "ok"
    assert min(d.drafts, d.draft_tokens, d.accepted, *d.accepted_per_pos) >= 0
    if d.draft_tokens:
        assert 0.0 <= d.acceptance <= 1.0
        assert 1.0 <= d.tokens_per_step <= 1.0 + len(d.accepted_per_pos)
        assert all(0.0 <= p <= 1.0 for p in d.per_position)
    else:
        assert d.acceptance is None and d.tokens_per_step is None


@given(counters(), counters())
def test_any_counter_going_backwards_is_a_reset_with_no_figures(a, b):
    d = sd.counters_delta(a, b)
    went_back = (
        b.drafts < a.drafts
        or b.draft_tokens < a.draft_tokens
        or b.accepted < a.accepted
        or any(y < x for x, y in zip(a.accepted_per_pos, b.accepted_per_pos))
    )
    if went_back:
        assert d.status == "reset"
        assert (d.drafts, d.draft_tokens, d.accepted, d.acceptance, d.tokens_per_step) == (
            None,
            None,
            None,
            None,
            None,
        )
    else:
        assert d.status == "ok"


@given(growth())
def test_restart_detected_by_creation_time_even_when_counters_grew(pair):
    before, after = pair
    restarted = sd.Counters(
        after.drafts, after.draft_tokens, after.accepted, after.accepted_per_pos, created=2.0
    )
    assert sd.counters_delta(before, restarted).status == "reset"


@given(growth(), growth())
def test_deltas_add_up_over_engines(p1, p2):
    """Summing two engines then taking the delta equals the sum of per-engine deltas."""
    d_sum = sd.counters_delta(p1[0] + p2[0], p1[1] + p2[1])
    d1, d2 = sd.counters_delta(*p1), sd.counters_delta(*p2)
    assert d_sum.accepted == d1.accepted + d2.accepted
    assert d_sum.draft_tokens == d1.draft_tokens + d2.draft_tokens


def test_real_capture_parses_to_the_counters_it_shows():
    snap = sd.parse(CAPTURE.read_text())
    assert snap.speculative
    total = snap.total("gemma4-tiny")
    assert (total.drafts, total.draft_tokens, total.accepted) == (21, 42, 42)
    assert total.accepted_per_pos == (21, 21)
    assert total.created is not None
    assert snap.running == 0


def test_snapshot_without_speculative_series_gives_absent_not_zero():
    # The real capture with every spec_decode line removed is what a baseline server shows.
    text = "\n".join(ln for ln in CAPTURE.read_text().splitlines() if "spec_decode" not in ln)
    snap = sd.parse(text)
    assert not snap.speculative
    d = sd.delta(snap, snap)
    assert d.status == "absent"
    assert d.acceptance is None


def test_series_vanishing_between_reads_is_a_reset():
    with_spec = sd.parse(CAPTURE.read_text())
    without = sd.parse(
        "\n".join(ln for ln in CAPTURE.read_text().splitlines() if "spec_decode" not in ln)
    )
    assert sd.delta(with_spec, without).status == "reset"
    assert sd.delta(without, with_spec).status == "reset"


@pytest.mark.parametrize(
    "garbage", ["<html>hello</html>", "}}}{{{", "vllm:num_requests_running x y z"]
)
def test_garbage_raises_parse_error(garbage):
    with pytest.raises(sd.MetricsParseError):
        sd.parse(garbage)


def test_ratios_follow_vllm_definitions():
    assert sd.acceptance(73, 113) == pytest.approx(0.646, abs=1e-3)
    assert sd.tokens_per_step(73, 40) == pytest.approx(2.825)
    assert sd.per_position((29, 24, 20), 40) == (0.725, 0.6, 0.5)
    assert sd.acceptance(0, 0) is None and sd.tokens_per_step(5, 0) is None


def test_per_request_block_maps_to_a_delta():
    body = {
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": 3,
                "num_draft_tokens": 6,
                "num_accepted_draft_tokens": 4,
                "num_spec_tokens": 2,
                "per_step_accepted": [2, 1, 1],
                "per_step_drafted": [2, 2, 2],
            }
        }
    }
    d = sd.from_response_metrics(body)
    assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_pos) == (3, 6, 4, (3, 1))
    assert d.tokens_per_step == pytest.approx(1 + 4 / 3)
    assert sd.from_response_metrics({"metrics": None}) is None
    assert sd.from_response_metrics({"usage": {}}) is None


def _snap(c: sd.Counters | None, running: float = 0.0, model: str = "m") -> sd.Snapshot:
    return sd.Snapshot({(model, "0"): c} if c else {}, running=running)


@given(growth(), st.booleans(), st.booleans(), st.booleans())
def test_attribution_is_shared_exactly_when_something_else_ran(pair, overlapped, run_b, run_a):
    b, a = pair
    att = sd.attribute(_snap(b, float(run_b)), _snap(a, float(run_a)), "m", overlapped=overlapped)
    assert att.delta == sd.counters_delta(b, a)
    shared = overlapped or run_b or run_a
    assert att.source == ("shared" if shared else "counters")
    assert att.exact is not shared and att.shared is shared


def _delta_reference(b: sd.Counters, a: sd.Counters) -> sd.Delta:
    """counters_delta as first written (position by position, padded with zeros)."""
    if b.created is not None and a.created is not None and a.created != b.created:
        return sd.Delta("reset")
    width = max(len(a.accepted_per_pos), len(b.accepted_per_pos))
    at = sd._at
    pos = tuple(at(a.accepted_per_pos, i) - at(b.accepted_per_pos, i) for i in range(width))
    moves = (a.drafts - b.drafts, a.draft_tokens - b.draft_tokens, a.accepted - b.accepted, *pos)
    if any(m < 0 for m in moves):
        return sd.Delta("reset")
    return sd.Delta("ok", *map(round, moves[:3]), tuple(round(p) for p in pos))


small = st.integers(0, 50).map(float)
any_counters = st.builds(
    sd.Counters,
    small,
    small,
    small,
    st.lists(small, max_size=3).map(tuple),
    st.sampled_from([None, 1.0, 2.0]),
)


@given(any_counters, any_counters)
def test_counters_delta_matches_the_position_by_position_rule(b, a):
    # Any widths (a restart that changed k pads with zeros), any move backwards: reset.
    assert sd.counters_delta(b, a) == _delta_reference(b, a)


@given(st.dictionaries(st.tuples(st.sampled_from("mn"), st.sampled_from("01")), any_counters))
def test_total_of_one_series_is_the_sum_over_the_series(series):
    snap = sd.Snapshot(series)
    for model in (None, "m", "n", "other"):
        picked = [c for (m, _), c in sorted(series.items()) if model in (None, m)]
        want = None
        for c in picked:
            want = c if want is None else want + c
        assert snap.total(model) == want


@given(growth(), st.floats(0, 3), st.floats(0, 3))
def test_attribution_proved_alone_ignores_the_running_gauge(pair, run_b, run_a):
    # The agent's token-counter proof covers what ran at either read (rules.only_this_call).
    b, a = pair
    att = sd.attribute(_snap(b, run_b), _snap(a, run_a), "m", alone=True)
    assert (att.source, att.delta) == ("counters", sd.counters_delta(b, a))
    restarted = sd.Counters(0, 0, 0, (0, 0), created=2.0)
    att = sd.attribute(_snap(b, run_b), _snap(restarted, run_a), "m", alone=True)
    assert (att.source, att.delta.status) == ("unknown", "reset")


def test_attribution_prefers_the_request_block_and_says_absent_and_unknown():
    block = sd.Delta("ok", drafts=3, draft_tokens=6, accepted=5, accepted_per_pos=(3, 2))
    grown = sd.Counters(10, 20, 15, (8, 7), created=1.0)
    att = sd.attribute(_snap(grown, 2), _snap(grown, 2), "m", request=block)
    assert (att.source, att.delta) == ("request", block)
    assert sd.attribute(_snap(None), _snap(None), "m").source == "absent"
    restarted = sd.Counters(1, 2, 1, (1, 0), created=2.0)
    att = sd.attribute(_snap(grown), _snap(restarted), "m")
    assert (att.source, att.delta.status) == ("unknown", "reset")
    # A served-model alias that is not the series' label still finds the server's counters.
    after = sd.Counters(13, 26, 20, (10, 10), created=1.0)
    att = sd.attribute(_snap(grown), _snap(after), "alias")
    assert (att.source, att.delta.drafts, att.delta.accepted) == ("counters", 3, 5)


def test_sums_take_ratios_over_the_summed_counts_and_project_under_vllm_names():
    a = sd.Delta("ok", drafts=2, draft_tokens=4, accepted=4, accepted_per_pos=(2, 2))
    b = sd.Delta("ok", drafts=6, draft_tokens=12, accepted=0, accepted_per_pos=(0, 0))
    total = sd.summed([a, b, sd.Delta("absent"), sd.Delta("reset")])
    assert (total.drafts, total.draft_tokens, total.accepted) == (8, 16, 4)
    assert total.accepted_per_pos == (2, 2)
    assert total.acceptance == 4 / 16  # not the mean of 1.0 and 0.0
    assert sd.summed([sd.Delta("absent")]) is None
    assert total.to_dict() == {
        "status": "ok",
        "drafts": 8,
        "draft_tokens": 16,
        "accepted": 4,
        "accepted_per_pos": [2, 2],
        "acceptance": 0.25,
        "tokens_per_step": 1.5,
        "per_position": [0.25, 0.25],
    }
    assert sd.Delta("absent").to_dict()["drafts"] is None


def test_predicted_lengths_are_one_plus_the_first_k_prime_rates():
    assert schedule.predicted_lengths((0.8, 0.5, 0.3)) == pytest.approx((1.8, 2.3, 2.6))
    assert schedule.predicted_lengths(()) == ()


def test_prediction_weighs_requests_by_their_steps_at_k_prime_not_at_k():
    # One request accepts all 3 drafts (10 steps, 40 tokens), one accepts none (40 steps, 40
    # tokens). At k'=1 they take 20 and 40 steps for 80 tokens: 80/60 tokens per step, not the
    # 1 + 10/50 that truncating the summed counters gives.
    always = sd.Delta("ok", drafts=10, draft_tokens=30, accepted=30, accepted_per_pos=(10, 10, 10))
    never = sd.Delta("ok", drafts=40, draft_tokens=120, accepted=0, accepted_per_pos=(0, 0, 0))
    assert schedule.predicted_lengths_of([always, never]) == pytest.approx(
        (80 / 60, 80 / (40 / 3 + 40), 80 / 50)
    )
    assert schedule.predicted_lengths_of([always]) == pytest.approx((2.0, 3.0, 4.0))
    assert schedule.predicted_lengths_of([sd.Delta("absent")]) is None


@given(
    st.lists(
        st.tuples(st.integers(1, 50), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    )
)
def test_predicted_length_at_k_is_the_measured_one_and_grows_with_k_prime(reqs):
    deltas = []
    for drafts, a, b, c in reqs:
        p1 = min(a, 3) * drafts // 3
        p2 = min(p1, b * drafts // 3)
        p3 = min(p2, c * drafts // 3)
        deltas.append(sd.Delta("ok", drafts, 3 * drafts, p1 + p2 + p3, (p1, p2, p3)))
    lengths = schedule.predicted_lengths_of(deltas)
    assert list(lengths) == sorted(lengths)
    assert lengths[-1] == pytest.approx(sd.summed(deltas).tokens_per_step)


def test_step_cost_and_predicted_tpot():
    # No speculation: 10 ms a token (one per step). k=3: 5 ms a token at 4 per step, 20 ms a step.
    cost = schedule.step_cost((0, 0.010, 1.0), (3, 0.005, 4.0))
    assert (cost.base_s, cost.per_draft_s) == pytest.approx((0.010, 0.010 / 3))
    assert schedule.predicted_tpot((2.0, 3.0, 4.0), cost) == pytest.approx(
        (0.040 / 3 / 2, 0.050 / 3 / 3, 0.005)
    )
    assert schedule.step_cost((2, 0.01, 2.0), (2, 0.02, 2.0)) is None


# --- a k schedule read back from the counters ---------------------------------------------------

SCHEDULED = Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp-schedule.txt"


@st.composite
def scheduled_level(draw):
    """k, a level's concurrency c, the schedule's k per batch size 1..c, and the level's steps:
    the batch size of each (filling and draining in any order), at least one step at c."""
    k = draw(st.integers(1, 4))
    c = draw(st.integers(1, 8))
    per_batch = (None, *(draw(st.integers(0, k)) for _ in range(c)))
    steps = draw(st.lists(st.integers(1, c), max_size=12)) + [c] * draw(st.integers(1, 12))
    return k, c, per_batch, steps


def _drafted(steps: list[int], tokens_at) -> sd.Delta:
    """The counters' movement over ``steps`` when each of a step's b requests drafts
    ``tokens_at(b)`` tokens (vLLM counts no draft for a step that drafts nothing)."""
    drafts = sum(b for b in steps if tokens_at(b) > 0)
    return sd.Delta("ok", drafts, sum(b * tokens_at(b) for b in steps), 0, ())


@given(scheduled_level())
def test_a_drafter_that_follows_the_schedule_is_never_called_ignoring_it(level):
    k, c, per_batch, steps = level
    k_at, most = per_batch[c], max(per_batch[1:])
    check = schedule.check_schedule(_drafted(steps, lambda b: per_batch[b]), c, k, k_at, most)
    want = "unchanged" if k_at == k else "unmeasured" if k_at == 0 else "follows"
    assert check.verdict == want


@given(scheduled_level())
def test_a_drafter_that_drafts_k_at_every_batch_size_is_called_out_where_it_should_not(level):
    k, c, per_batch, steps = level
    k_at, most = per_batch[c], max(per_batch[1:])
    check = schedule.check_schedule(_drafted(steps, lambda b: k), c, k, k_at, most)
    if most < k or 0 < k_at < k:
        assert check.verdict == "ignored"
        assert "DOES NOT FOLLOW" in check.summary() and "#57053" in check.summary()
    else:  # the schedule keeps k at c, or drafts nothing there: the counters cannot tell
        assert check.verdict == ("unchanged" if k_at == k else "unmeasured")
    assert check.drafted_per_step == k


def test_real_captures_of_one_request_alone_with_and_without_the_schedule():
    # k=2, schedule [[1, 1, 1], [2, 2, 2]]: alone (batch size 1) the drafter drafts one token.
    moved = sd.counters_delta(sd.Counters(), sd.parse(SCHEDULED.read_text()).total())
    assert schedule.drafted_per_step(moved) == 1.0
    check = schedule.check_schedule(moved, 1, k=2, k_at=1, k_most=1)
    assert check.verdict == "follows"
    assert check.summary() == (
        "concurrency 1: the schedule says k=1 (k=2 unscheduled): drafted 1.00 tokens per step, "
        "fewer as scheduled"
    )
    # The same engine without a schedule drafts k=2 every step: what a drafter that ignores the
    # schedule shows (vLLM #57053).
    plain = sd.counters_delta(sd.Counters(), sd.parse(CAPTURE.read_text()).total())
    check = schedule.check_schedule(plain, 1, k=2, k_at=1, k_most=1)
    assert (check.verdict, check.drafted_per_step) == ("ignored", 2.0)
    assert check.summary() == (
        "concurrency 1: the schedule says k=1: DOES NOT FOLLOW: drafted 2.00 tokens per step, "
        "more than the 1 the schedule allows at any batch size up to here (vLLM #57053)"
    )
    assert schedule.check_schedule(plain, 1, k=2, k_at=2, k_most=2).verdict == "unchanged"
    assert schedule.check_schedule(sd.Delta("absent"), 1, 2, 1, 1).verdict == "unmeasured"
