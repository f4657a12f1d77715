"""The live-acceptance gate: the traffic the instance serves, before the move and after it.

The canary's prompts are prose, and the seed measured 99% acceptance on prose against 73% on
its real workload: a drafter that fails the real traffic can pass the canary. So, beside it:

- :func:`before`, while the old image serves and before anything is touched: windows of the
  live traffic's acceptance (:mod:`appliance.judge.traffic_acceptance`). With no traffic, or no
  speculative decoding on the old image, the rule has nothing to judge: said once, and the
  canary decides (never a refusal for it);
- :func:`after`, the last gate: windows of the new image's traffic, judged against those by
  :func:`appliance.judge.noninferiority.judge` after each new window until it decides or ``after_s``
  passes. ``worse`` fails the gate (the way back follows, as for any gate); ``not worse``
  passes; no decision by then (too few calls, an interval across the margin) passes too,
  saying so: the rule never decides on too few calls, and a quiet hour is no reason to roll a
  good image back.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from ..errors import UsageError
from ..judge import noninferiority, traffic_acceptance
from . import gates
from .context import Context
from .history import Gate

GATE = "live-acceptance"
UNIT = "windows"


@dataclass(frozen=True)
class Settings:
    """The rule, how windows are read, and how long each side may take."""

    rule: noninferiority.Rule = field(default_factory=noninferiority.Rule)
    sampling: traffic_acceptance.Settings = field(default_factory=traffic_acceptance.Settings)
    # The before-side stops here, or earlier once settled (noninferiority.settled).
    before_windows: int = 30
    before_s: float = 90.0  # at most this long recording before the move
    idle_s: float = 4.0  # nothing served for this long before the move: no traffic
    after_s: float = 180.0  # at most this long waiting for a decision after the move


DEFAULT = Settings()
# A window shorter than a few decode steps reads mostly noise (and a metrics read per window).
MIN_WINDOW_S = 0.2


def settings(
    enabled: bool = True, margin: float | None = None, window_s: float | None = None
) -> Settings | None:
    """The gate as the command line sets it: None when off; ``margin`` (absolute acceptance,
    0..1) in place of the rule's; ``window_s`` (seconds a window lasts at least) in place of
    the sampling's."""
    if not enabled:
        return None
    chosen = DEFAULT
    if margin is not None:
        chosen = dataclasses.replace(chosen, rule=dataclasses.replace(chosen.rule, margin=margin))
    if window_s is not None:
        if not (math.isfinite(window_s) and window_s >= MIN_WINDOW_S):
            raise UsageError(
                f"a live-acceptance window must last at least {MIN_WINDOW_S} s, not {window_s}"
            )
        sampling = dataclasses.replace(chosen.sampling, window_s=window_s)
        chosen = dataclasses.replace(chosen, sampling=sampling)
    return chosen


def before(
    ctx: Context, base_url: str, settings: Settings | None, new_drafts: bool = True
) -> traffic_acceptance.Traffic | None:
    """Record the old image's live traffic; None when the gate is off or has nothing to judge
    (said in a progress line). ``new_drafts``: the new image serves with speculative decoding
    (when it does not, its side has no acceptance to compare: nothing is recorded)."""
    if settings is None:
        ctx.progress("live acceptance: off")
        return None
    if not new_drafts:
        ctx.progress(
            "live acceptance: nothing to judge (the new image serves without speculative "
            "decoding); the canary decides"
        )
        return None
    rule = settings.rule
    traffic = traffic_acceptance.sample(
        base_url,
        until=lambda t: (
            (
                len(t.windows) >= settings.before_windows
                and (t.calls is None or t.calls >= rule.min_calls)
            )
            or noninferiority.settled(t.side(), rule)
        ),
        limit_s=settings.before_s,
        idle_s=settings.idle_s,
        settings=settings.sampling,
        progress=ctx.progress,
    )
    side = traffic.side()
    if not traffic.speculative:
        why = "the serving image exposes no speculative-decoding counters"
    elif not traffic.windows:
        why = "no traffic" if not traffic.busy else "too little traffic to read a window"
    elif side.n < rule.min_samples or side.n_calls < rule.min_calls:
        why = f"too little traffic ({traffic.describe()})"
    else:
        ctx.progress(f"live acceptance before: {traffic.describe()}")
        return traffic
    ctx.progress(f"live acceptance: nothing to judge ({why}); the canary decides")
    return None


def after(
    ctx: Context,
    base_url: str,
    recorded: traffic_acceptance.Traffic,
    settings: Settings,
    so_far: list[Gate],
    within: float,
) -> noninferiority.Judgement:
    """The gate on the new image's traffic against ``recorded``; appends it to ``so_far`` and
    raises :class:`gates.GateFailed` when the rule says ``worse``. ``within``: the seconds it may
    wait at most (besides ``settings.after_s``)."""
    since_restart = so_far[-1].seconds if so_far else 0.0
    rule = settings.rule
    t0 = time.monotonic()

    def decided(t: traffic_acceptance.Traffic) -> bool:
        verdict = noninferiority.judge(recorded.side(), t.side(), rule, UNIT).decision
        return verdict != noninferiority.NOT_ENOUGH

    traffic = traffic_acceptance.sample(
        base_url,
        until=decided,
        limit_s=min(settings.after_s, within),
        settings=settings.sampling,
        progress=ctx.progress,
    )
    seconds = round(since_restart + time.monotonic() - t0, 2)
    judgement = noninferiority.judge(recorded.side(), traffic.side(), rule, UNIT)
    if not traffic.speculative:
        detail = "nothing to judge: the new image exposes no speculative-decoding counters"
        return _passed(ctx, so_far, Gate(GATE, True, seconds, detail), judgement)
    detail = judgement.summary()
    if judgement.decision == noninferiority.WORSE:
        gate = Gate(GATE, False, seconds, f"draft acceptance on the live traffic is {detail}")
        so_far.append(gate)
        ctx.progress(f"live acceptance: FAILED ({gate.detail})")
        raise gates.GateFailed(gate.name, gate.detail, so_far)
    if judgement.decision == noninferiority.NOT_ENOUGH:
        detail = f"undecided within {traffic.seconds:.0f} s, the canary decides: {detail}"
    return _passed(ctx, so_far, Gate(GATE, True, seconds, detail), judgement)


def _passed(
    ctx: Context, so_far: list[Gate], gate: Gate, judgement: noninferiority.Judgement
) -> noninferiority.Judgement:
    so_far.append(gate)
    ctx.progress(f"live acceptance: ok ({gate.detail})")
    return judgement
