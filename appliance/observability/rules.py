"""Prometheus recording rules and alerts for the appliance, as data, rendered to YAML.

Recording rules are named ``level:metric:operation`` (the aggregation labels, the metric, what
was done to it). Every ratio divides by ``(denominator > 0)``: an idle engine has no series
rather than NaN. Thresholds are in :class:`Thresholds`; gotchas/alert-thresholds.md says where
each default comes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import names as n
from .promql import Expr, agg, histogram_quantile, rate, ratio, recorded, sum_rate

ENGINE_BY = ("instance", "model_name")
ROLE_BY = ("role", "model")
SHORT = "1m"  # dashboards: reacts within a minute at a 15 s scrape
LONG = "5m"  # alerts and per-role distributions: enough calls per window to mean something
QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class Thresholds:
    """Alert thresholds (see gotchas/alert-thresholds.md for the sources)."""

    # Below every reference the seeds give (lowest: ~0.355 at k=2 on an RTX PRO 6000 workload,
    # 0.54 lowest interval of an NVFP4 k=3 sweep), so it fires on drift, not on a normal workload.
    acceptance_min: float = 0.30
    acceptance_for: str = "30m"
    # Only judge acceptance when the drafter is busy enough for the ratio to be meaningful.
    min_draft_tokens_per_s: float = 1.0
    counters_flat_for: str = "10m"
    engine_down_for: str = "2m"
    kv_cache_max: float = 0.95
    kv_cache_for: str = "10m"


@dataclass(frozen=True)
class Rule:
    """A recording rule (``record``) or an alert (``alert``), with a one-line why."""

    name: str
    expr: Expr
    comment: str
    alert: bool = False
    for_: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Rule, ...]


# Recorded series names, used by the dashboards through promql.recorded().
ACCEPTANCE_1M = "instance_model_name:vllm_spec_decode_draft_acceptance:ratio_rate1m"
ACCEPTANCE_5M = "instance_model_name:vllm_spec_decode_draft_acceptance:ratio_rate5m"
TOKENS_PER_STEP_1M = "instance_model_name:vllm_spec_decode_tokens_per_step:ratio_rate1m"
POSITION_1M = "instance_model_name_position:vllm_spec_decode_position_acceptance:ratio_rate1m"
REJECTED_1M = "instance_model_name:vllm_spec_decode_rejected_tokens:rate1m"
ROLE_ACCEPTANCE_5M = "role_model:gemma4_agent_draft_acceptance:ratio_rate5m"
ROLE_CALL_ACCEPTANCE_Q = "role_model:gemma4_agent_call_acceptance:quantile_rate5m"
ROLE_CALL_TPS_Q = "role_model:gemma4_agent_call_tokens_per_step:quantile_rate5m"


def _acceptance(window: str) -> Expr:
    return ratio(sum_rate(n.ACCEPTED, ENGINE_BY, window), sum_rate(n.DRAFT_TOKENS, ENGINE_BY, window))


def recording_groups() -> tuple[Group, ...]:
    """The recording rules every dashboard ratio reads."""
    engine = (
        Rule(ACCEPTANCE_1M, _acceptance(SHORT),
             "vLLM's draft acceptance rate: accepted / drafted tokens."),
        Rule(ACCEPTANCE_5M, _acceptance(LONG),
             "The same over 5m, for the drafter-drift alert."),
        Rule(TOKENS_PER_STEP_1M,
             1 + ratio(sum_rate(n.ACCEPTED, ENGINE_BY, SHORT), sum_rate(n.DRAFTS, ENGINE_BY, SHORT)),
             "vLLM's mean acceptance length: 1 + accepted / drafts (counts the bonus token)."),
        Rule(POSITION_1M,
             ratio(sum_rate(n.ACCEPTED_PER_POS, (*ENGINE_BY, "position"), SHORT),
                   sum_rate(n.DRAFTS, ENGINE_BY, SHORT), on=ENGINE_BY, group_left=True),
             "Acceptance at each draft position: accepted_per_pos / drafts."),
        Rule(REJECTED_1M,
             sum_rate(n.DRAFT_TOKENS, ENGINE_BY, SHORT) - sum_rate(n.ACCEPTED, ENGINE_BY, SHORT),
             "Drafted tokens the target rejected, per second."),
    )
    role = [
        Rule(ROLE_ACCEPTANCE_5M,
             ratio(sum_rate(n.AGENT_ACCEPTED, ROLE_BY, LONG), sum_rate(n.AGENT_DRAFTED, ROLE_BY, LONG)),
             "Per-role token-weighted acceptance from the agent's counters."),
    ]
    for q in QUANTILES:
        role.append(Rule(ROLE_CALL_ACCEPTANCE_Q,
                         histogram_quantile(q, n.AGENT_ACCEPTANCE, ROLE_BY, LONG),
                         f"Per-call acceptance, {q} quantile over calls, per role.",
                         labels={"quantile": str(q)}))
    for q in QUANTILES:
        role.append(Rule(ROLE_CALL_TPS_Q,
                         histogram_quantile(q, n.AGENT_TOKENS_PER_STEP, ROLE_BY, LONG),
                         f"Per-call tokens per step, {q} quantile over calls, per role.",
                         labels={"quantile": str(q)}))
    return (Group("gemma4_mtp_engine.rules", engine), Group("gemma4_mtp_agent.rules", tuple(role)))


def alert_groups(t: Thresholds = Thresholds()) -> tuple[Group, ...]:
    """Drafter drift, MTP counters flat, engine down, KV cache near full."""
    busy = (sum_rate(n.DRAFT_TOKENS, ENGINE_BY, LONG) > t.min_draft_tokens_per_s).paren()
    generating = (sum_rate(n.GENERATION_TOKENS, ENGINE_BY, LONG) > 0).paren()
    flat = agg("sum", ENGINE_BY, rate(n.DRAFTS, LONG)).eq(0).paren()
    alerts = (
        Rule("Gemma4MTPAcceptanceLow",
             (recorded(ACCEPTANCE_5M) < t.acceptance_min).and_on(busy, ENGINE_BY),
             "Drafter drift: acceptance stays under the floor while the drafter is busy.",
             alert=True, for_=t.acceptance_for, labels={"severity": "warning"},
             annotations={
                 "summary": "MTP draft acceptance low on {{ $labels.instance }}",
                 "description": "Draft acceptance of {{ $labels.model_name }} is "
                                "{{ $value | humanizePercentage }} (floor "
                                f"{t.acceptance_min:.0%}) for {t.acceptance_for}: the drafter "
                                "no longer matches the target or the workload changed. "
                                "See gotchas/alert-thresholds.md.",
             }),
        Rule("Gemma4MTPCountersFlat",
             generating.and_on(flat, ENGINE_BY),
             "MTP is configured (the counters exist) but no drafts while tokens are generated.",
             alert=True, for_=t.counters_flat_for, labels={"severity": "critical"},
             annotations={
                 "summary": "MTP configured but not drafting on {{ $labels.instance }}",
                 "description": "{{ $labels.model_name }} generates tokens but its "
                                "speculative-decoding drafts counter has not moved for "
                                f"{t.counters_flat_for}: MTP is not paying at all.",
             }),
        Rule("Gemma4EngineDown",
             n.UP.where(job=n.JOB_ENGINE).expr.eq(0),
             "Prometheus cannot scrape the engine.",
             alert=True, for_=t.engine_down_for, labels={"severity": "critical"},
             annotations={
                 "summary": "vLLM engine {{ $labels.instance }} is down",
                 "description": "The scrape of {{ $labels.instance }} has failed for "
                                f"{t.engine_down_for}.",
             }),
        Rule("Gemma4KVCacheNearFull",
             agg("max", ENGINE_BY, n.KV_CACHE.expr) > t.kv_cache_max,
             "KV cache nearly full: requests will queue or be preempted.",
             alert=True, for_=t.kv_cache_for, labels={"severity": "warning"},
             annotations={
                 "summary": "KV cache near full on {{ $labels.instance }}",
                 "description": "KV cache usage of {{ $labels.model_name }} is "
                                "{{ $value | humanizePercentage }} for "
                                f"{t.kv_cache_for} (limit {t.kv_cache_max:.0%}).",
             }),
    )
    return (Group("gemma4_mtp.alerts", alerts),)


def all_rules(t: Thresholds = Thresholds()) -> list[Rule]:
    return [r for g in (*recording_groups(), *alert_groups(t)) for r in g.rules]


def render(groups: tuple[Group, ...]) -> str:
    """The rule file's YAML: strings JSON-quoted (valid YAML), one comment per rule."""
    lines = ["# Generated by `appliance observability generate`; edit appliance/observability/.",
             "groups:"]
    for g in groups:
        lines += [f"  - name: {g.name}", "    rules:"]
        for r in g.rules:
            lines.append(f"      # {r.comment}")
            key = "alert" if r.alert else "record"
            lines.append(f"      - {key}: {r.name}")
            lines.append(f"        expr: {json.dumps(r.expr.text)}")
            if r.for_:
                lines.append(f"        for: {r.for_}")
            for block, values in (("labels", r.labels), ("annotations", r.annotations)):
                if values:
                    lines.append(f"        {block}:")
                    lines += [f"          {k}: {json.dumps(v)}" for k, v in sorted(values.items())]
    return "\n".join(lines) + "\n"
