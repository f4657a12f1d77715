"""The canary's soak: its MTP figures and error rate after a cutover against its own before.

A fleet rollout (deploy/ansible) cuts the canary host over, then soaks it: it reads the
instance's vLLM ``/metrics`` counters before the cutover (:func:`read`, saved as JSON), reads
them again at the start and the end of the soak window while traffic flows (real traffic, or
the soak's own probe requests), and :func:`compare` decides whether the new image regressed:

- MTP **acceptance** (accepted / draft tokens) fell by more than ``max_acceptance_drop``
  (absolute), or **tokens per step** (1 + accepted / drafts) by more than
  ``max_tokens_per_step_drop`` (a fraction of the old figure): :mod:`appliance.judge.acceptance`'s
  judgement, the canary's and the paired bench's, over one window per side;
- MTP was on before and is off now (the image lost its drafter);
- the **error rate** (5xx answers / answers on ``/v1/``) rose by more than
  ``max_error_rate_rise``;
- too little traffic to tell (``min_drafts`` / ``min_requests``): no evidence is not a pass;
- the server restarted during the soak (its counters reset) or stopped answering.

The pre-cutover figures are the old server's counters since it started (the cutover replaces the
container, so they cannot be read later). All counter arithmetic is
:mod:`appliance.engine_api.specdecode`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .. import records
from ..engine_api import specdecode
from ..engine_api.vllm_client import VLLMClient
from ..errors import ApplianceError, EngineError, UsageError
from ..judge import acceptance

HTTP_REQUESTS = "http_requests_total"  # prometheus-fastapi-instrumentator, in vLLM's /metrics
API_PREFIX = "/v1/"
SCHEMA = 1
_FIX = "write it with `appliance fleet snapshot INSTANCE --out FILE`"

# Short, varied prompts: the soak's own traffic when the canary has none of its own.
PROBE_PROMPTS = (
    "Count from one to ten.",
    "Name three colours.",
    "Say hello in French.",
    "What is two plus two?",
)


@dataclass(frozen=True)
class Reading:
    """One read of an instance's ``/metrics``: speculative counters and API answer counts.

    ``counters`` is ``None`` when the server has no speculative decoding (MTP off). ``requests``
    and ``errors`` count answers on ``/v1/`` handlers (errors: status ``5xx``).
    """

    counters: specdecode.Counters | None
    requests: float
    errors: float
    at: float = 0.0

    def snapshot(self) -> specdecode.Snapshot:
        """The counters as a :class:`specdecode.Snapshot` (one series: the engines' total)."""
        return specdecode.Snapshot({("", "0"): self.counters} if self.counters else {})

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict, where: str = "input") -> Reading:
        """The inverse of :meth:`to_dict`; a UsageError naming ``where`` and the field for
        anything else."""
        where = f"{where} is not a soak reading"
        return records.from_dict(cls, records.require(data, "schema", SCHEMA, where, _FIX), where)


def parse(text: str, at: float = 0.0) -> Reading:
    """A :class:`Reading` from vLLM's whole ``/metrics`` page."""
    try:
        snap = specdecode.parse(text)
    except specdecode.MetricsParseError as exc:
        raise EngineError(f"/metrics: {exc}") from None
    requests = errors = 0.0
    lines = "\n".join(line for line in text.splitlines() if line.startswith(HTTP_REQUESTS + "{"))
    try:
        for fam in text_string_to_metric_families(lines + "\n"):
            for s in fam.samples:
                if s.name != HTTP_REQUESTS or not s.labels.get("handler", "").startswith(
                    API_PREFIX
                ):
                    continue
                requests += s.value
                if s.labels.get("status", "").startswith("5"):
                    errors += s.value
    except (ValueError, TypeError, IndexError, KeyError) as exc:  # the parser on garbage
        raise EngineError(f"/metrics: unparsable {HTTP_REQUESTS}: {exc}") from None
    return Reading(snap.total(), requests, errors, at)


def read(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> Reading:
    """Read the server's counters now (the whole page: the API answer counts are not in the
    speculative filter)."""
    with VLLMClient(base_url, timeout=timeout, api_key=api_key) as client:
        return parse(client.metrics_text(), at=time.time())


@dataclass(frozen=True)
class Window:
    """The figures of one stretch of a server's life: its MTP counters' movement and answers.

    ``requests``/``errors`` are ``None`` when the counters reset in between.
    """

    spec: specdecode.Delta
    requests: int | None
    errors: int | None
    seconds: float | None = None

    @property
    def error_rate(self) -> float | None:
        if self.requests is None or self.errors is None or not self.requests:
            return None
        return self.errors / self.requests

    def to_dict(self) -> dict:
        return {
            **self.spec.to_dict(),
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.error_rate,
            "seconds": self.seconds,
        }


def window(before: Reading | None, after: Reading) -> Window:
    """The movement from ``before`` to ``after``; ``before=None``: since the server started."""
    if before is None:
        zero = specdecode.Counters(created=after.counters.created) if after.counters else None
        before = Reading(zero, 0.0, 0.0, after.at)
    spec = specdecode.delta(before.snapshot(), after.snapshot())
    req, err = after.requests - before.requests, after.errors - before.errors
    if spec.status == "reset" or req < 0 or err < 0:
        return Window(specdecode.Delta("reset"), None, None)
    seconds = after.at - before.at if after.at and before.at else None
    return Window(spec, round(req), round(err), seconds)


@dataclass(frozen=True)
class Thresholds:
    """How much worse the canary may get before the rollout stops."""

    max_acceptance_drop: float = 0.10  # absolute: 0.80 -> 0.69 fails
    max_tokens_per_step_drop: float = 0.10  # a fraction of the old figure
    max_error_rate_rise: float = 0.01  # absolute
    min_drafts: int = 10  # fewer speculation steps in the soak: too little to judge MTP
    min_requests: int = 3

    def __post_init__(self) -> None:
        for name in ("max_acceptance_drop", "max_tokens_per_step_drop", "max_error_rate_rise"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise UsageError(f"{name.replace('_', '-')} must be within 0..1, not {value}")
        if self.min_drafts < 0 or self.min_requests < 0:
            raise UsageError("min-drafts and min-requests must not be negative")

    @property
    def tolerance(self) -> acceptance.Tolerance:
        """The drafting tolerances, for the judgement the canary and the paired bench share."""
        return acceptance.Tolerance(self.max_acceptance_drop, self.max_tokens_per_step_drop)


@dataclass(frozen=True)
class Verdict:
    """The soak's outcome: ``ok``, every regression found, and notes on what was not compared."""

    ok: bool
    regressions: tuple[str, ...]
    notes: tuple[str, ...]
    before: Window
    soak: Window
    probe_errors: int = 0

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "regressions": list(self.regressions),
            "notes": list(self.notes),
            "before": self.before.to_dict(),
            "soak": self.soak.to_dict(),
            "probe_errors": self.probe_errors,
        }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def compare(before: Window, soak: Window, t: Thresholds = Thresholds()) -> Verdict:
    """Judge the soak window against the pre-cutover window (see the module docstring)."""
    bad: list[str] = []
    notes: list[str] = []
    if soak.spec.status == "reset" or soak.requests is None:
        bad.append("the server restarted during the soak (its counters reset)")
        return Verdict(False, tuple(bad), (), before, soak)
    if soak.requests < t.min_requests:
        bad.append(f"too little traffic: {soak.requests} answers on /v1/ (need {t.min_requests})")
    b, s = before.spec, soak.spec
    judged_before = b.status == "ok" and (b.drafts or 0) >= t.min_drafts
    if s.status == "absent":
        if b.status == "ok":
            bad.append("MTP is off after the cutover (it was on before)")
        else:
            notes.append("MTP off before and after: nothing to compare")
    elif (s.drafts or 0) < t.min_drafts:
        bad.append(f"too little MTP traffic: {s.drafts} drafts in the soak (need {t.min_drafts})")
    elif not judged_before:
        why = "MTP was off" if b.status == "absent" else f"only {b.drafts or 0} drafts"
        notes.append(
            f"no pre-cutover MTP figures to compare ({why}); soak acceptance "
            f"{_pct(s.acceptance)}, tokens per step {_pct(s.tokens_per_step)}"
        )
    else:
        judged = acceptance.change([(b, s)], "windows")
        if judged is not None:
            bad += judged.failures(t.tolerance)
    rise = (soak.error_rate or 0.0) - (before.error_rate or 0.0)
    if rise > t.max_error_rate_rise:
        bad.append(
            f"error rate rose {_pct(before.error_rate or 0.0)} -> {_pct(soak.error_rate)} "
            f"(more than {t.max_error_rate_rise:.3f})"
        )
    return Verdict(not bad, tuple(bad), tuple(notes), before, soak)


@dataclass
class Soak:
    """What :func:`run` needs: where the canary is and what to send it."""

    base_url: str
    model: str
    api_key: str | None = None
    seconds: float = 60.0
    probe_requests: int = 0  # the soak's own requests, spread over the window
    max_tokens: int = 24
    thresholds: Thresholds = field(default_factory=Thresholds)


def run(
    soak: Soak,
    before: Reading,
    *,
    progress: Callable[[str], None] = lambda _m: None,
    sleep: Callable[[float], None] = time.sleep,
) -> Verdict:
    """Soak the canary for ``soak.seconds`` and judge it against ``before`` (pre-cutover)."""
    start = read(soak.base_url, soak.api_key)
    t0 = time.monotonic()
    probe_errors = 0
    with VLLMClient(soak.base_url, timeout=60.0, api_key=soak.api_key) as client:
        for i in range(soak.probe_requests):
            due = t0 + soak.seconds * i / max(soak.probe_requests, 1)
            sleep(max(0.0, due - time.monotonic()))
            try:
                client.generate(soak.model, PROBE_PROMPTS[i % len(PROBE_PROMPTS)], soak.max_tokens)
            except ApplianceError as exc:
                probe_errors += 1
                progress(f"soak: probe {i + 1} failed: {exc}")
    sleep(max(0.0, t0 + soak.seconds - time.monotonic()))
    try:
        end = read(soak.base_url, soak.api_key)
    except ApplianceError as exc:
        empty = Window(specdecode.Delta("reset"), None, None)
        return Verdict(
            False,
            (f"the canary stopped answering /metrics: {exc}",),
            (),
            window(None, before),
            empty,
            probe_errors,
        )
    verdict = compare(window(None, before), window(start, end), soak.thresholds)
    if probe_errors:
        verdict = Verdict(
            False,
            (*verdict.regressions, f"{probe_errors} of the soak's probe requests failed"),
            verdict.notes,
            verdict.before,
            verdict.soak,
            probe_errors,
        )
    return verdict


def dumps(reading: Reading) -> str:
    """A reading as the JSON file ``appliance fleet snapshot`` writes."""
    return json.dumps(reading.to_dict(), indent=2) + "\n"


def loads(text: str, where: str = "input") -> Reading:
    """A reading back from :func:`dumps`' JSON (a UsageError naming ``where`` and the field when
    it is not one)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where} is not a soak reading (not JSON): {exc}", fix=_FIX) from None
    return Reading.from_dict(data, where)
