"""The canary as a cutover gate: record before the restart, compare after the other gates pass.

A cutover has one endpoint at a time (a 31B host cannot hold two engines), so the canary runs
twice against the same URL: :func:`before` while the old image serves, :func:`after` once the new
one has passed the other gates. Both print their cost. The caller turns :class:`Result` into a
gate (``Gate("canary", result.ok, seconds, result.summary())``) and keeps
:meth:`Result.figures` in its history entry. Nothing here touches the unit or the env file.

When the old image drafted nothing (no MTP), the new image's acceptance is judged against the
instance's acceptance baseline instead (:mod:`.baseline`); keeping a passing record as the next
baseline is the caller's, once the cutover has passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError, UsageError
from . import baseline as baselines
from . import record as records
from .baseline import Baseline
from .compare import Comparison, Policy, compare
from .policy import Plan
from .record import Record

GATE = "canary"
Progress = Callable[[str], None]


class CanaryFailed(ApplianceError):
    """The after-run broke the policy; ``result`` holds the figures."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.summary())
        self.result = result


@dataclass(frozen=True)
class Result:
    """Both records and the comparison of one canary."""

    before: Record
    after: Record
    comparison: Comparison  # its verdict and failures include the baseline's
    baseline: baselines.Check | None = None  # None: ``before`` drafted, so it was the reference

    @property
    def ok(self) -> bool:
        return self.comparison.ok

    def summary(self) -> str:
        line = self.comparison.summary()
        return f"{line}; {self.baseline.summary(self.ok)}" if self.baseline else line

    def figures(self) -> dict:
        """The comparison's figures plus each side's cost per prompt (history, status, metrics)."""
        return {
            **self.comparison.figures(),
            "baseline": None if self.baseline is None else self.baseline.figures(),
            "summary": self.summary(),
            "seconds_per_prompt_before": round(self.before.seconds_per_prompt, 3),
            "seconds_per_prompt_after": round(self.after.seconds_per_prompt, 3),
            "image_before": self.before.image,
            "image_after": self.after.image,
        }


def _cases(plan: Plan):
    if plan.cases is None:
        raise UsageError(f"the canary is off for profile {plan.profile}")
    return plan.cases


def _record(
    plan: Plan,
    url: str,
    model: str,
    when: str,
    *,
    api_key: str | None,
    image: str | None,
    save_to: Path | None,
    say: Progress,
    within: float,
) -> Record:
    cases = _cases(plan)
    say(f"canary: recording {len(cases.cases)} prompts on {image or url}{when}")
    rec = records.run(
        cases,
        url,
        model,
        api_key=api_key,
        settings=plan.settings,
        image=image,
        profile=plan.profile,
        within=within,
        batched=plan.batched,
        at_once=plan.at_once,
    )
    if save_to is not None:
        records.save(rec, save_to)
    say(rec.cost())
    return rec


def before(
    plan: Plan,
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    image: str | None = None,
    save_to: Path | None = None,
    progress: Progress | None = None,
    within: float = records.DEFAULT_WITHIN_S,
) -> Record:
    """Record the serving (old) image's answers, within ``within`` seconds; saved to
    ``save_to`` when given."""
    say = progress or (lambda _m: None)
    return _record(
        plan,
        url,
        model,
        " before the restart",
        api_key=api_key,
        image=image,
        save_to=save_to,
        say=say,
        within=within,
    )


def recorded(plan: Plan, path: Path, image: str | None) -> Record:
    """The before-record at ``path`` (``appliance canary record``), taken earlier than the
    cutover (a group's head, whose workers move first); a UsageError unless it is of ``image``
    and of the plan's set and settings, so that it compares like one the cutover recorded."""
    cases = _cases(plan)
    rec = records.load(path)
    if rec.image != image:
        raise UsageError(
            f"canary record {path} is of image {rec.image or 'unknown'}, the nodes run {image}",
            fix="record it on the serving image before anything moves",
        )
    if rec.set_digest != cases.digest() or rec.settings != plan.settings:
        raise UsageError(
            f"canary record {path} ran another canary set or settings than profile "
            f"{plan.profile}'s",
            fix="record it with the same profile and --canary-file options as the cutover",
        )
    return rec


def judge(
    before: Record, after: Record, policy: Policy, acceptance_baseline: Baseline | None = None
) -> Result:
    """``after`` against ``before`` by ``policy``; when ``before`` drafted nothing (an old image
    without MTP), ``after``'s acceptance is judged against ``acceptance_baseline`` too, and a
    drop beyond the policy fails the canary, naming the baseline."""
    comparison = compare(before, after, policy)
    if baselines.drafted(before) is not None:
        return Result(before, after, comparison)
    check = baselines.judge(after, acceptance_baseline, policy)
    if check.failures:
        comparison = dataclasses.replace(
            comparison, verdict="fail", failures=(*comparison.failures, *check.failures)
        )
    return Result(before, after, comparison, check)


def after(
    plan: Plan,
    baseline: Record,
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    image: str | None = None,
    save_to: Path | None = None,
    progress: Progress | None = None,
    within: float = records.DEFAULT_WITHIN_S,
    acceptance_baseline: Baseline | None = None,
) -> Result:
    """Record the new image's answers and judge them against ``baseline`` (the before-record)
    by the plan's policy, and against ``acceptance_baseline`` as :func:`judge` says.

    Returns the result whether it passed or not (the caller decides to roll back on
    ``not result.ok``); engine errors propagate as :class:`appliance.errors.EngineError`.
    """
    say = progress or (lambda _m: None)
    rec = _record(
        plan, url, model, "", api_key=api_key, image=image, save_to=save_to, say=say, within=within
    )
    result = judge(baseline, rec, plan.policy, acceptance_baseline)
    say(result.summary())
    return result
