"""Predictions and checks for ``bench tune`` and ``bench run --sweep-k``, on the figures of
:mod:`appliance.engine_api.specdecode`: tokens per step at every k' <= k from one run at k, the step
cost as a line through two runs, the predicted TPOT per k', and ``tune --verify``'s reading of a k
schedule back from the draft counters.

:mod:`appliance.engine_api.specdecode` keeps what every reader of ``/metrics`` shares (the parse,
the counter arithmetic, the attribution); what only the bench predicts or checks lives here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from ..engine_api.specdecode import Delta, per_position

# --- k from one run ---------------------------------------------------------------------------
# vLLM accepts drafts as a prefix: position i is accepted only if every position before it was.
# So accepted_per_pos[i] / drafts at k is also the chance that a run at any k' > i accepts
# position i, and the mean acceptance length at k' <= k is 1 + the first k' per-position rates.


def predicted_lengths(per_pos: tuple[float, ...] | list[float]) -> tuple[float, ...]:
    """Mean acceptance length (tokens per step) at k' = 1..k from per-position acceptance at k."""
    out, total = [], 1.0
    for rate in per_pos:
        total += rate
        out.append(total)
    return tuple(out)


def predicted_lengths_of(deltas: list[Delta]) -> tuple[float, ...] | None:
    """Tokens per step at k' = 1..k for a set of requests measured at k, as a run at k' counts it.

    Requests differ in acceptance, and a request that accepts more takes fewer steps, more so at
    a larger k: summing the counters at k and then truncating weighs each request by its steps
    at k, not at k'. So each request is predicted on its own (its tokens stay, its steps become
    tokens / length at k') and the requests are summed then, as vLLM's counters would be.
    """
    usable = [d for d in deltas if d.status == "ok" and d.drafts and d.accepted_per_pos]
    if not usable:
        return None
    width = min(len(d.accepted_per_pos or ()) for d in usable)
    tokens = [d.drafts * (1.0 + (d.accepted or 0) / d.drafts) for d in usable]
    lengths = [predicted_lengths(per_position(d.accepted_per_pos, d.drafts) or ()) for d in usable]
    return tuple(
        sum(tokens) / sum(t / length[i] for t, length in zip(tokens, lengths, strict=True))
        for i in range(width)
    )


@dataclass(frozen=True)
class StepCost:
    """Engine step time as ``base_s + per_draft_s * k``, from two measured points."""

    base_s: float
    per_draft_s: float

    def at(self, k: int) -> float:
        return self.base_s + self.per_draft_s * k


def step_cost(a: tuple[int, float, float], b: tuple[int, float, float]) -> StepCost | None:
    """The line through two runs ``(k, tpot_s, tokens_per_step)`` (k=0: no speculation, 1 token
    per step); a step takes tpot * tokens_per_step. ``None`` for one k twice."""
    (ka, tpot_a, len_a), (kb, tpot_b, len_b) = a, b
    if ka == kb:
        return None
    step_a, step_b = tpot_a * len_a, tpot_b * len_b
    slope = (step_b - step_a) / (kb - ka)
    return StepCost(step_a - slope * ka, slope)


def predicted_tpot(lengths: tuple[float, ...], cost: StepCost) -> tuple[float, ...]:
    """TPOT at k' = 1..len(lengths): one step's time over the tokens it yields."""
    return tuple(cost.at(i + 1) / length for i, length in enumerate(lengths))


# --- a k schedule, read back from the counters --------------------------------------------------
# vLLM counts every verified draft (num_drafts) and its tokens (num_draft_tokens): their ratio is
# the k the drafter actually drafted, on average. A drafter that follows a per-batch-size schedule
# drafts fewer where the schedule says so; one that ignores it (vLLM #57053, #51510: the V2 model
# runner's MTP drafter) drafts num_speculative_tokens at every step. The counters see the drafts
# the scheduler verified: a runner that drafted more and had them cut would look like it follows.

ScheduleVerdict = Literal["follows", "ignored", "unchanged", "unmeasured"]


def drafted_per_step(d: Delta) -> float | None:
    """Mean draft tokens per draft, ``draft_tokens / drafts``; ``None`` without drafts."""
    if d.status != "ok" or not d.drafts or d.draft_tokens is None:
        return None
    return d.draft_tokens / d.drafts


@dataclass(frozen=True)
class ScheduleCheck:
    """One concurrency level's drafts against the schedule.

    ``k``: num_speculative_tokens, what a drafter ignoring the schedule drafts at every step;
    ``k_at``: the schedule's k at batch size ``concurrency`` (where the level runs once full);
    ``k_most``: the most the schedule drafts at any batch size from 1 to ``concurrency`` (the
    level passes through them as it fills and drains). Verdicts: ``ignored`` when some draft was
    longer than ``k_most`` allows, or when every draft was ``k`` tokens where ``k_at`` is less;
    ``follows`` when the drafts were shorter than ``k`` where the schedule says so; ``unchanged``
    when the schedule keeps ``k`` at this batch size (nothing to see); ``unmeasured`` without
    drafts, or where the schedule says k=0 (a step that drafts nothing is not counted).
    """

    concurrency: int
    k: int
    k_at: int
    k_most: int
    drafts: int | None
    draft_tokens: int | None
    verdict: ScheduleVerdict

    @property
    def drafted_per_step(self) -> float | None:
        if not self.drafts or self.draft_tokens is None:
            return None
        return self.draft_tokens / self.drafts

    def summary(self) -> str:
        """One plain line: what the schedule says here and what the drafter did."""
        says = f"concurrency {self.concurrency}: the schedule says k={self.k_at}"
        if self.verdict == "unmeasured":
            if self.k_at == 0 and self.drafts:
                return f"{says}: a step that drafts nothing leaves no trace in the draft counters"
            return f"{says}; no drafts counted, nothing to read"
        drafted = f"drafted {self.drafted_per_step:.2f} tokens per step"
        if self.verdict == "unchanged":
            return f"{says}, the profile's k: {drafted}, nothing to verify here"
        if self.verdict == "follows":
            return f"{says} (k={self.k} unscheduled): {drafted}, fewer as scheduled"
        if (
            self.draft_tokens is not None
            and self.drafts
            and self.draft_tokens > (self.k_most * self.drafts)
        ):
            why = f"more than the {self.k_most} the schedule allows at any batch size up to here"
        else:
            why = (
                f"every draft {self.k} tokens: the schedule is not applied (or the level never "
                f"ran {self.concurrency} requests at once)"
            )
        return f"{says}: DOES NOT FOLLOW: {drafted}, {why} (vLLM #57053)"

    def to_dict(self) -> dict:
        return {**asdict(self), "drafted_per_step": self.drafted_per_step}


def check_schedule(d: Delta, concurrency: int, k: int, k_at: int, k_most: int) -> ScheduleCheck:
    """The verdict on one level's counter movement ``d`` (see :class:`ScheduleCheck`)."""

    def out(verdict: ScheduleVerdict) -> ScheduleCheck:
        return ScheduleCheck(concurrency, k, k_at, k_most, d.drafts, d.draft_tokens, verdict)

    if d.status != "ok" or d.drafts is None or d.draft_tokens is None:
        return out("unmeasured")
    if d.draft_tokens > k_most * d.drafts:
        return out("ignored")  # a draft longer than any batch size here may draft
    if k_at >= k:
        return out("unchanged")
    if not d.drafts or k_at == 0:
        # A step that drafts nothing is no draft: k=0 leaves no trace in these counters.
        return out("unmeasured")
    # Once the level runs ``concurrency`` requests, each draft is k_at < k tokens: not one was.
    return out("ignored" if d.draft_tokens >= k * d.drafts else "follows")
