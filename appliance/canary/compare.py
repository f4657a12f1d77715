"""Compare two canary records: task pass rate and token parity, judged by a policy.

- Task pass rate: checked cases that passed, before and after. A drop by more than
  ``policy.max_pass_rate_drop`` fails.
- Token parity: the share of cases whose output token ids are identical (by text when a record
  has no ids), and the median position (in tokens) of the first divergence among those that
  differ. Below ``policy.min_parity`` it fails when both records ran the same vLLM version and is
  a warning when the version changed: a new engine may legitimately move the numerics (see
  gotchas/canary-across-vllm-versions.md), while an MTP switch, a label or a config change
  within one version must not change a greedy answer.
- Draft acceptance: how the answers were made, judged per prompt by
  :mod:`appliance.judge.acceptance` (the fleet soak's and the paired bench's judgement too). A
  median drop beyond ``policy.max_acceptance_drop`` fails whatever the versions; a rise is a
  note. Records without figures (no MTP on a side, or written before the figures) compare on
  answers only, and the summary says so.
- Under batching (the after-record's batched pass, when it ran one): each answer with every case
  in flight against the same engine's answer alone (:func:`batched`). Fewer identical than
  ``policy.min_parity`` fails (one engine, one version); an answer that follows another case's
  answer alone further than its own fails always: answers mixed across the sequences of a batch
  (vLLM #46088, ``--kv-cache-dtype auto`` with MTP).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

from ..errors import UsageError
from ..judge import acceptance
from .record import Output, Record

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


MIXING = "vLLM #46088: --kv-cache-dtype auto with MTP"


@dataclass(frozen=True)
class Batched:
    """A record's batched pass against its answers alone: how many are identical, which
    differ, and which answered like another case (``(case, the case it answered like)``)."""

    outputs: int
    identical: int
    differing: tuple[str, ...]
    crossed: tuple[tuple[str, str], ...]
    min_parity: float
    by_text: bool = False

    @property
    def parity(self) -> float:
        return self.identical / self.outputs

    def failures(self) -> list[str]:
        out = [
            f"under batching {case} answered like {other} ({MIXING}: answers mixed across "
            "the sequences of a batch)"
            for case, other in self.crossed
        ]
        if self.parity < self.min_parity:
            out.append(
                f"under batching {self.identical}/{self.outputs} answers equal the same engine's "
                f"answers alone ({self.parity:.0%}, min {self.min_parity:.0%}): "
                f"{', '.join(self.differing)} differ"
            )
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def summary(self) -> str:
        """One line: the verdict on the batched pass."""
        unit = "by text" if self.by_text else "token-identical"
        head = "batched answers pass" if self.ok else "batched answers FAIL"
        line = f"{head}: {self.identical}/{self.outputs} {unit} to the answers alone"
        return f"{line}: {'; '.join(self.failures())}" if not self.ok else line

    def figures(self) -> dict:
        return {
            "outputs": self.outputs,
            "identical": self.identical,
            "parity": round(self.parity, 4),
            "by_text": self.by_text,
            "differing": list(self.differing),
            "crossed": [list(c) for c in self.crossed],
            "ok": self.ok,
        }


def _shared(a: Output, b: Output) -> int:
    """How far ``a`` and ``b`` agree from the start: tokens (characters without ids)."""
    x, y = (a.token_ids, b.token_ids) if a.token_ids and b.token_ids else (a.text, b.text)
    n = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        n += 1
    return n


def batched(record: Record, min_parity: float = 1.0) -> Batched | None:
    """``record``'s batched pass judged against its answers alone; None when it ran none."""
    if not record.batched:
        return None
    alone = {o.id: o for o in record.outputs}
    differing, crossed = [], []
    for b in record.batched:
        own = alone[b.id]
        if _identical(own, b):
            continue
        differing.append(b.id)
        # Another case's answer alone that this one follows from its start, for half of it at
        # least and further than its own: a shared first word is no mix-up.
        mine, length = _shared(b, own), len(b.token_ids or b.text)
        others = [(_shared(b, o), o.id) for o in alone.values() if not _identical(o, own)]
        best = max(others, default=(0, ""))
        if best[0] > mine and 2 * best[0] >= length:
            crossed.append((b.id, best[1]))
    by_text = any(o.token_ids is None for o in (*record.outputs, *record.batched))
    return Batched(
        len(record.batched),
        len(record.batched) - len(differing),
        tuple(differing),
        tuple(crossed),
        min_parity,
        by_text,
    )


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
    acceptance: acceptance.Change | None = None  # None: not compared (a side has no figures)
    batched: Batched | None = None  # None: the after-record ran no batched pass

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
        if self.batched is not None:
            b = self.batched
            parts.append(f"under batching {b.identical}/{b.outputs} as alone")
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
            "batched": None if self.batched is None else self.batched.figures(),
            "seconds_before": self.seconds_before,
            "seconds_after": self.seconds_after,
            "differing": list(self.differing),
            "failures": list(self.failures),
            "warnings": list(self.warnings),
        }


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
    acc = acceptance.change(
        ((b.spec and b.spec.delta, a.spec and a.spec.delta) for b, a in pairs), "prompts"
    )
    if acc is not None:
        dropped = acc.failures(acceptance.Tolerance(policy.max_acceptance_drop))
        same = " (the same answers, decoded with fewer accepted drafts)" if not differing else ""
        failures += [f"{line}{same}" for line in dropped]
    under_batching = batched(after, policy.min_parity)
    if under_batching is not None:
        failures += under_batching.failures()
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
        batched=under_batching,
    )


def _settings(r: Record) -> str:
    return f"max_tokens {r.settings.max_tokens}, seed {r.settings.seed}"
