"""Compare two canary records: task pass rate and token parity, judged by a policy.

- Task pass rate: checked cases that passed, before and after. A drop by more than
  ``policy.max_pass_rate_drop`` fails.
- Token parity: the share of cases whose output token ids are identical (by text when a record
  has no ids), and the median position (in tokens) of the first divergence among those that
  differ. Below ``policy.min_parity`` it fails when both records ran the same vLLM version and is
  a warning when the version changed: a new engine may legitimately move the numerics (see
  gotchas/canary-across-vllm-versions.md), while an MTP switch, a label or a config change
  within one version must not change a greedy answer.
- Draft acceptance: how the answers were made. MTP's commonest regression keeps every answer
  and accepts fewer drafts (slower decoding; vLLM PR 49262). Per prompt with figures on both
  sides, the change in acceptance (accepted / draft tokens); the median change is the verdict's
  statistic, so one odd prompt does not decide and a drop across the set always does. A median
  drop beyond ``policy.max_acceptance_drop`` fails whatever the versions; a rise is a note.
  Records without figures (no MTP on a side, or written before the figures) compare on answers
  only, and the summary says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

from .. import specdecode
from ..errors import UsageError
from .record import Output, Record, SpecFigures

Verdict = Literal["pass", "warn", "fail"]
HEADS = {"pass": "canary passed", "warn": "canary passed with warnings", "fail": "canary FAILED"}


@dataclass(frozen=True)
class Policy:
    """Thresholds: the least share of identical outputs, the largest pass-rate drop allowed."""

    min_parity: float = 1.0
    max_pass_rate_drop: float = 0.0
    max_acceptance_drop: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_parity <= 1.0:
            raise UsageError(f"canary min_parity must be within 0..1, not {self.min_parity}")
        if not 0.0 <= self.max_pass_rate_drop <= 1.0:
            raise UsageError(
                f"canary max_pass_rate_drop must be within 0..1, not {self.max_pass_rate_drop}"
            )
        if not 0.0 <= self.max_acceptance_drop <= 1.0:
            raise UsageError(
                f"canary max_acceptance_drop must be within 0..1, not {self.max_acceptance_drop}"
            )

    @classmethod
    def of(cls, table) -> Policy:
        """The thresholds of a profile's ``[canary]`` table."""
        return cls(table.min_parity, table.max_pass_rate_drop, table.max_acceptance_drop)


@dataclass(frozen=True)
class Comparison:
    """The canary's judgement of ``after`` against ``before``."""

    verdict: Verdict
    outputs: int
    identical: int
    median_first_divergence: float | None
    tasks: int
    passed_before: int
    passed_after: int
    vllm_before: str
    vllm_after: str
    policy: Policy
    seconds_before: float
    seconds_after: float
    by_text: bool = False  # a record had no token ids: parity was judged on text
    differing: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    acceptance: Acceptance | None = None  # None: not compared (a side has no figures)

    @property
    def ok(self) -> bool:
        """True unless a threshold failed (a warning still passes)."""
        return self.verdict != "fail"

    @property
    def parity(self) -> float:
        return self.identical / self.outputs

    @property
    def version_changed(self) -> bool:
        return self.vllm_before != self.vllm_after

    def pass_rate(self, side: Literal["before", "after"]) -> float | None:
        n = self.passed_before if side == "before" else self.passed_after
        return n / self.tasks if self.tasks else None

    def summary(self) -> str:
        """One line for the terminal, the history's gate detail and the annotations."""
        head = HEADS[self.verdict]
        unit = "outputs identical by text" if self.by_text else "outputs token-identical"
        share = f"{self.parity:.0%}, min {self.policy.min_parity:.0%}"
        parts = [f"{self.identical}/{self.outputs} {unit} ({share})"]
        if self.median_first_divergence is not None:
            parts.append(f"first divergence at median token {self.median_first_divergence:g}")
        if self.tasks:
            n = self.tasks
            parts.append(f"tasks {self.passed_before}/{n} -> {self.passed_after}/{n} passed")
        if self.version_changed:
            parts.append(f"vLLM {self.vllm_before} -> {self.vllm_after}")
        else:
            parts.append(f"vLLM {self.vllm_after} on both")
        parts.append(
            self.acceptance.summary()
            if self.acceptance is not None
            else "acceptance not compared (a record has no speculative-decoding figures)"
        )
        reasons = (*self.failures, *self.warnings)
        tail = f": {'; '.join(reasons)}" if reasons else ""
        return f"{head}{tail} [{', '.join(parts)}]"

    def figures(self) -> dict:
        """The figures for history, status and metrics (stable keys, JSON-serialisable)."""
        return {
            "verdict": self.verdict,
            "outputs": self.outputs,
            "identical": self.identical,
            "parity": round(self.parity, 4),
            "median_first_divergence": self.median_first_divergence,
            "by_text": self.by_text,
            "tasks": self.tasks,
            "pass_rate_before": self.pass_rate("before"),
            "pass_rate_after": self.pass_rate("after"),
            "vllm_before": self.vllm_before,
            "vllm_after": self.vllm_after,
            "version_changed": self.version_changed,
            "min_parity": self.policy.min_parity,
            "max_pass_rate_drop": self.policy.max_pass_rate_drop,
            "max_acceptance_drop": self.policy.max_acceptance_drop,
            "acceptance": None if self.acceptance is None else self.acceptance.figures(),
            "seconds_before": self.seconds_before,
            "seconds_after": self.seconds_after,
            "differing": list(self.differing),
            "failures": list(self.failures),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class Acceptance:
    """Draft acceptance before and after over the prompts with figures on both sides."""

    prompts: int
    before: float  # accepted / draft tokens over those prompts
    after: float
    tokens_per_step_before: float | None
    tokens_per_step_after: float | None
    median_change: float  # of the per-prompt changes (after - before)
    per_position_before: tuple[float, ...]
    per_position_after: tuple[float, ...]

    def summary(self) -> str:
        steps = ""
        if self.tokens_per_step_before is not None and self.tokens_per_step_after is not None:
            steps = (
                f", tokens per step {self.tokens_per_step_before:.2f} -> "
                f"{self.tokens_per_step_after:.2f}"
            )
        return (
            f"acceptance {self.before:.0%} -> {self.after:.0%} over {self.prompts} prompts "
            f"(median change {self.median_change:+.0%}{steps})"
        )

    def figures(self) -> dict:
        return {
            "prompts": self.prompts,
            "before": round(self.before, 4),
            "after": round(self.after, 4),
            "tokens_per_step_before": self.tokens_per_step_before,
            "tokens_per_step_after": self.tokens_per_step_after,
            "median_change": round(self.median_change, 4),
            "per_position_before": [round(p, 4) for p in self.per_position_before],
            "per_position_after": [round(p, 4) for p in self.per_position_after],
        }


def acceptance(pairs: list[tuple[Output, Output]]) -> Acceptance | None:
    """The paired acceptance of ``(before, after)`` outputs; None without figures on both
    sides of any prompt that drafted."""
    both = [
        (b.spec, a.spec)
        for b, a in pairs
        if b.spec is not None and a.spec is not None and b.spec.draft_tokens and a.spec.draft_tokens
    ]
    if not both:
        return None

    def total(side: int) -> SpecFigures:
        figs = [p[side] for p in both]
        width = max(len(f.accepted_per_pos) for f in figs)
        per_pos = tuple(
            sum(f.accepted_per_pos[i] for f in figs if i < len(f.accepted_per_pos))
            for i in range(width)
        )
        drafts, tokens = sum(f.drafts for f in figs), sum(f.draft_tokens for f in figs)
        return SpecFigures(drafts, tokens, sum(f.accepted for f in figs), per_pos, figs[0].source)

    b, a = total(0), total(1)
    changes = [fa.acceptance - fb.acceptance for fb, fa in both]
    return Acceptance(
        prompts=len(both),
        before=b.acceptance,
        after=a.acceptance,
        tokens_per_step_before=b.tokens_per_step,
        tokens_per_step_after=a.tokens_per_step,
        median_change=statistics.median(changes),
        per_position_before=specdecode.per_position(b.accepted_per_pos, b.drafts) or (),
        per_position_after=specdecode.per_position(a.accepted_per_pos, a.drafts) or (),
    )


def first_divergence(a: Output, b: Output) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ; None when identical or when
    either has no token ids. A strict prefix diverges where the shorter one ends."""
    if a.token_ids is None or b.token_ids is None:
        return None
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x != y:
            return i
    if len(a.token_ids) != len(b.token_ids):
        return min(len(a.token_ids), len(b.token_ids))
    return None


def _identical(a: Output, b: Output) -> bool:
    if a.token_ids is not None and b.token_ids is not None:
        return a.token_ids == b.token_ids
    return a.text == b.text


def compare(before: Record, after: Record, policy: Policy = Policy()) -> Comparison:
    """Judge ``after`` against ``before`` (records of the same cases, matched by id)."""
    b_ids = [o.id for o in before.outputs]
    a_by_id = {o.id: o for o in after.outputs}
    if set(b_ids) != set(a_by_id):
        only_b = sorted(set(b_ids) - set(a_by_id))
        only_a = sorted(set(a_by_id) - set(b_ids))
        raise UsageError(
            "the records ran different canary sets "
            f"(only before: {', '.join(only_b) or '-'}; only after: {', '.join(only_a) or '-'})",
            fix="record both sides with the same canary set",
        )
    pairs = [(o, a_by_id[o.id]) for o in before.outputs]
    differing = tuple(b.id for b, a in pairs if not _identical(b, a))
    positions = [p for b, a in pairs if (p := first_divergence(b, a)) is not None]
    by_text = any(b.token_ids is None or a.token_ids is None for b, a in pairs)
    identical = len(pairs) - len(differing)
    # Tasks are the cases checked before; an after-side without the check counts as failed.
    tasks = [(b, a) for b, a in pairs if b.passed is not None]
    passed_b = sum(b.passed is True for b, _ in tasks)
    passed_a = sum(a.passed is True for _, a in tasks)

    failures: list[str] = []
    warnings: list[str] = []
    parity = identical / len(pairs)
    if parity < policy.min_parity:
        what = f"token parity {parity:.0%} below {policy.min_parity:.0%}"
        if before.vllm_version == after.vllm_version:
            failures.append(f"{what} on one vLLM version ({after.vllm_version})")
        else:
            warnings.append(
                f"{what} across vLLM {before.vllm_version} -> {after.vllm_version} "
                "(numerics may legitimately move)"
            )
    if tasks:
        drop = (passed_b - passed_a) / len(tasks)
        # A float tolerance: 1/3 - 0 against a tolerance of exactly 1/3 must pass.
        if drop > policy.max_pass_rate_drop + 1e-9:
            failures.append(
                f"task pass rate fell {passed_b}/{len(tasks)} -> {passed_a}/{len(tasks)} "
                f"(by {drop:.0%}, tolerance {policy.max_pass_rate_drop:.0%})"
            )
    acc = acceptance(pairs)
    if acc is not None and -acc.median_change > policy.max_acceptance_drop + 1e-9:
        failures.append(
            f"draft acceptance fell {acc.before:.0%} -> {acc.after:.0%} (median drop "
            f"{-acc.median_change:.0%} per prompt, tolerance {policy.max_acceptance_drop:.0%}): "
            "the same answers, decoded with fewer accepted drafts"
        )
    if before.settings != after.settings:
        warnings.append(f"settings differ ({_settings(before)} vs {_settings(after)})")
    if before.set_digest != after.set_digest:
        warnings.append("the cases' prompts or checks differ between the records")
    if before.model != after.model:
        warnings.append(f"served model {before.model} -> {after.model}")
    verdict: Verdict = "fail" if failures else "warn" if warnings else "pass"
    return Comparison(
        verdict=verdict,
        outputs=len(pairs),
        identical=identical,
        median_first_divergence=float(statistics.median(positions)) if positions else None,
        tasks=len(tasks),
        passed_before=passed_b,
        passed_after=passed_a,
        vllm_before=before.vllm_version,
        vllm_after=after.vllm_version,
        policy=policy,
        seconds_before=before.seconds,
        seconds_after=after.seconds,
        by_text=by_text,
        differing=differing,
        failures=tuple(failures),
        warnings=tuple(warnings),
        acceptance=acc,
    )


def _settings(r: Record) -> str:
    return f"max_tokens {r.settings.max_tokens}, seed {r.settings.seed}"
