"""Prometheus recording rules and alerts for the appliance, as data, rendered to YAML.

Recording rules are named ``level:metric:operation`` (the aggregation labels, the metric, what
was done to it). Every ratio divides by ``(denominator > 0)``: an idle engine has no series
rather than NaN. Thresholds are in :class:`Thresholds`; gotchas/alert-thresholds.md says where
each default comes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from ..host.layout import Layout
from . import names as n
from .promql import (
    Expr,
    Selector,
    absent,
    agg,
    histogram_quantile,
    rate,
    ratio,
    recorded,
    sum_rate,
)

# `host` is carried where the scrape has it (a fleet's file_sd, appliance.observability.file_sd):
# two hosts serving instances of one name stay two series. The recorded names keep their
# `instance_...` level, so queries and dashboards built on them keep working.
ENGINE_BY = ("host", "instance", "model_name")
# The agent's series carry `host` where a fleet host's Prometheus agent scrapes the application
# beside its engines: a role's figures stay per host, like the engines' (the dashboards' host
# variable); the recorded names keep their `role_model` level.
ROLE_BY = ("host", "role", "model")
# The instance in an alert's summary, with its host where the scrape labels one (a fleet).
ON_INSTANCE = "{{ $labels.instance }}{{ with $labels.host }} on host {{ . }}{{ end }}"
SHORT = "1m"  # dashboards: reacts within a minute at a 15 s scrape
LONG = "5m"  # alerts and per-role distributions: enough calls per window to mean something
EXTREMES = "15m"  # per-call extremes: enough long calls per role for a share to mean something
# Live acceptance against the instance's baseline: long enough that a few odd requests do not
# move it, short enough that a cutover's effect shows within the alert's `for`.
BASELINE = "15m"
IMAGE_BY = ("host", "instance", "image")
# The engine's figures by image keep its model too (the dashboards' model variable selects it).
IMAGE_ENGINE_BY = (*ENGINE_BY, "image")
# The state metrics carry the appliance instance (and, across a fleet, the host), not the model.
BASELINE_BY = ("host", "instance")
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
    # None: a failed unit stays failed until an operator acts (restarts show as activating).
    unit_failed_for: str | None = None
    kv_cache_max: float = 0.95
    kv_cache_for: str = "10m"
    # Per-call extremes (gotchas/per-call-acceptance-extremes.md). The edges are bucket bounds
    # of the agent's per-call acceptance histogram: near 0 is acceptance <= 0.05, near 1 is
    # acceptance > 0.99 (a repetition loop accepts every draft).
    near_zero_le: float = 0.05
    near_one_le: float = 0.99
    near_zero_share_max: float = 0.2
    near_one_share_max: float = 0.5
    # "Long calls": the role's exact calls average at least this many draft tokens (about 32
    # output tokens at k=2), so a call's acceptance is a ratio of many drafts, not of two.
    long_call_draft_tokens: float = 64.0
    # And enough of them: about one exact call a minute or more over the window.
    extremes_min_calls_per_s: float = 0.02
    extremes_for: str = "15m"
    # Below the instance's own baseline (its last passing MTP canary) by more than this, in
    # acceptance points, over BASELINE: the canary's prompts are not the live workload, so a
    # workload alone moves it by a few points; a regression like vLLM PR 49262 moves it by 20-40.
    baseline_margin: float = 0.15
    baseline_for: str = "30m"
    # Requests turned away at the queue bound (503), as a share of those that arrived (turned
    # away + finished) over 5m: a burst's few are the bound doing its job; a twentieth of the
    # traffic for a quarter of an hour is a host short of capacity (gotchas/queue-bound.md).
    rejected_share_max: float = 0.05
    rejected_for: str = "15m"
    # The state timer rewrites the textfile every minute (ADR 0016): five missed runs is a
    # writer that stopped (a refused file, a hung Docker or D-Bus, a disabled timer), not a
    # slow one (a run may take its 50 s TimeoutStartSec, then the scrape interval).
    state_stale_s: float = 300.0
    state_stale_for: str = "5m"
    # The collector itself (node_exporter's scrape, its textfile): a restart (a package upgrade)
    # misses a scrape or two; five minutes without it is a collector that stopped, and the
    # staleness alert above cannot say so (no mtime series, nothing to compare).
    state_collector_for: str = "5m"


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
OUTPUT_FROM_DRAFTS_1M = "instance_model_name:vllm_spec_decode_output_from_drafts:ratio_rate1m"
IMAGE_TOKENS_1M = "instance_image:vllm_generation_tokens:rate1m"
IMAGE_ACCEPTANCE_1M = "instance_image:vllm_spec_decode_draft_acceptance:ratio_rate1m"
ROLE_NEAR_ZERO = "role_model:gemma4_agent_calls_acceptance_near_zero:ratio_rate15m"
ROLE_NEAR_ONE = "role_model:gemma4_agent_calls_acceptance_near_one:ratio_rate15m"
ROLE_DRAFT_TOKENS_PER_CALL = "role_model:gemma4_agent_draft_tokens_per_call:ratio_rate15m"
ROLE_EXACT_CALLS = "role_model:gemma4_agent_exact_calls:rate15m"
BASELINE_SHORTFALL = (
    "instance_model_name:vllm_spec_decode_draft_acceptance:baseline_shortfall_rate15m"
)


def _acceptance(window: str) -> Expr:
    return ratio(
        sum_rate(n.ACCEPTED, ENGINE_BY, window), sum_rate(n.DRAFT_TOKENS, ENGINE_BY, window)
    )


def by_image(sel: Selector, window: str) -> Expr:
    """``sum by (host, instance, model_name, image)`` of a rate, each engine series labelled with
    its running image.

    The image comes from the appliance state (``gemma4_appliance_image_info``, one series per
    instance); the engine's scrape carries the same ``instance`` (scrape.py names it).
    """
    # One image per instance even where an old and a new series overlap for a scrape.
    info = Expr(
        f"topk by (host, instance) (1, {agg('max', IMAGE_BY, n.IMAGE_INFO.expr).text})",
        n.IMAGE_INFO.expr.metrics,
    )
    return agg(
        "sum", IMAGE_ENGINE_BY, rate(sel, window).mul_on(info, ("host", "instance"), ("image",))
    )


def _bucket_rate(le: float, window: str) -> Expr:
    return sum_rate(
        n.AGENT_ACCEPTANCE.suffixed("_bucket").where(le=floatToGoString(le)), ROLE_BY, window
    )


def extremes_rules(t: Thresholds = Thresholds()) -> tuple[Rule, ...]:
    """Per role: the share of exact calls with acceptance near 0 and near 1, and call length."""
    calls = sum_rate(n.AGENT_ACCEPTANCE.suffixed("_count"), ROLE_BY, EXTREMES)
    return (
        Rule(
            ROLE_NEAR_ZERO,
            ratio(_bucket_rate(t.near_zero_le, EXTREMES), calls),
            f"Share of calls with acceptance <= {t.near_zero_le}: drafter mismatch or garbage.",
        ),
        Rule(
            ROLE_NEAR_ONE,
            ratio((calls - _bucket_rate(t.near_one_le, EXTREMES)).paren(), calls),
            f"Share of calls with acceptance > {t.near_one_le}: repetition-loop suspects.",
        ),
        Rule(
            ROLE_DRAFT_TOKENS_PER_CALL,
            ratio(sum_rate(n.AGENT_DRAFTED, ROLE_BY, EXTREMES), calls),
            "Mean draft tokens per exact call: are the role's calls long enough to judge?",
        ),
        Rule(ROLE_EXACT_CALLS, calls, "Exact calls per second (those with a per-call acceptance)."),
    )


def recording_groups() -> tuple[Group, ...]:
    """The recording rules every dashboard ratio reads."""
    engine = (
        Rule(
            ACCEPTANCE_1M,
            _acceptance(SHORT),
            "vLLM's draft acceptance rate: accepted / drafted tokens.",
        ),
        Rule(ACCEPTANCE_5M, _acceptance(LONG), "The same over 5m, for the drafter-drift alert."),
        Rule(
            TOKENS_PER_STEP_1M,
            1 + ratio(sum_rate(n.ACCEPTED, ENGINE_BY, SHORT), sum_rate(n.DRAFTS, ENGINE_BY, SHORT)),
            "vLLM's mean acceptance length: 1 + accepted / drafts (counts the bonus token).",
        ),
        Rule(
            POSITION_1M,
            ratio(
                sum_rate(n.ACCEPTED_PER_POS, (*ENGINE_BY, "position"), SHORT),
                sum_rate(n.DRAFTS, ENGINE_BY, SHORT),
                on=ENGINE_BY,
                group_left=True,
            ),
            "Acceptance at each draft position: accepted_per_pos / drafts.",
        ),
        Rule(
            REJECTED_1M,
            sum_rate(n.DRAFT_TOKENS, ENGINE_BY, SHORT) - sum_rate(n.ACCEPTED, ENGINE_BY, SHORT),
            "Drafted tokens the target rejected, per second.",
        ),
        Rule(
            OUTPUT_FROM_DRAFTS_1M,
            ratio(
                sum_rate(n.ACCEPTED, ENGINE_BY, SHORT),
                sum_rate(n.GENERATION_TOKENS, ENGINE_BY, SHORT),
            ),
            "Share of output tokens that were accepted drafts (the rest: one per engine step).",
        ),
        Rule(
            BASELINE_SHORTFALL,
            agg("max", BASELINE_BY, n.ACCEPTANCE_BASELINE.expr).sub_on(
                _acceptance(BASELINE).paren(), BASELINE_BY
            ),
            "How far the 15m draft acceptance is below the instance's own baseline (its last "
            "passing MTP canary, from the state metrics); negative: above it.",
        ),
        Rule(
            IMAGE_TOKENS_1M,
            by_image(n.GENERATION_TOKENS, SHORT),
            "Output tokens per second by the image the instance ran: before/after a cutover.",
        ),
        Rule(
            IMAGE_ACCEPTANCE_1M,
            ratio(by_image(n.ACCEPTED, SHORT), by_image(n.DRAFT_TOKENS, SHORT)),
            "Draft acceptance by the image the instance ran: before/after a cutover.",
        ),
    )
    role = [
        Rule(
            ROLE_ACCEPTANCE_5M,
            ratio(
                sum_rate(n.AGENT_ACCEPTED, ROLE_BY, LONG), sum_rate(n.AGENT_DRAFTED, ROLE_BY, LONG)
            ),
            "Per-role token-weighted acceptance from the agent's counters.",
        ),
    ]
    for q in QUANTILES:
        role.append(
            Rule(
                ROLE_CALL_ACCEPTANCE_Q,
                histogram_quantile(q, n.AGENT_ACCEPTANCE, ROLE_BY, LONG),
                f"Per-call acceptance, {q} quantile over calls, per role.",
                labels={"quantile": str(q)},
            )
        )
    for q in QUANTILES:
        role.append(
            Rule(
                ROLE_CALL_TPS_Q,
                histogram_quantile(q, n.AGENT_TOKENS_PER_STEP, ROLE_BY, LONG),
                f"Per-call tokens per step, {q} quantile over calls, per role.",
                labels={"quantile": str(q)},
            )
        )
    return (
        Group("gemma4_mtp_engine.rules", engine),
        Group("gemma4_mtp_agent.rules", tuple(role)),
        Group("gemma4_mtp_agent_extremes.rules", extremes_rules()),
    )


def alert_groups(t: Thresholds = Thresholds()) -> tuple[Group, ...]:
    """Drafter drift, acceptance below the baseline, MTP counters flat, engine down, requests
    turned away at the queue bound, KV cache near full."""
    busy = (sum_rate(n.DRAFT_TOKENS, ENGINE_BY, LONG) > t.min_draft_tokens_per_s).paren()
    busy_long = (sum_rate(n.DRAFT_TOKENS, ENGINE_BY, BASELINE) > t.min_draft_tokens_per_s).paren()
    generating = (sum_rate(n.GENERATION_TOKENS, ENGINE_BY, LONG) > 0).paren()
    flat = agg("sum", ENGINE_BY, rate(n.DRAFTS, LONG)).eq(0).paren()
    rejected = sum_rate(n.ADMISSION_REJECTIONS, ENGINE_BY, LONG)
    arrived = (rejected + sum_rate(n.REQUEST_SUCCESS, ENGINE_BY, LONG)).paren()
    alerts = (
        Rule(
            "Gemma4MTPAcceptanceLow",
            (recorded(ACCEPTANCE_5M) < t.acceptance_min).and_on(busy, ENGINE_BY),
            "Drafter drift: acceptance stays under the floor while the drafter is busy.",
            alert=True,
            for_=t.acceptance_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"MTP draft acceptance low on {ON_INSTANCE}",
                "description": "Draft acceptance of {{ $labels.model_name }} is "
                "{{ $value | humanizePercentage }} (floor "
                f"{t.acceptance_min:.0%}) for {t.acceptance_for}: the drafter "
                "no longer matches the target or the workload changed. "
                "See gotchas/alert-thresholds.md.",
            },
        ),
        Rule(
            "Gemma4AcceptanceBelowBaseline",
            (recorded(BASELINE_SHORTFALL) > t.baseline_margin).and_on(busy_long, ENGINE_BY),
            "Fewer drafts accepted than the instance's own baseline, while the drafter is busy.",
            alert=True,
            for_=t.baseline_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"MTP draft acceptance below its baseline on {ON_INSTANCE}",
                "description": "Draft acceptance of {{ $labels.model_name }} is short of the "
                "instance's own baseline (its last passing MTP canary: `appliance status "
                "{{ $labels.instance }}`) by {{ $value | humanizePercentage }} (absolute; "
                f"margin {t.baseline_margin:.0%}) over {BASELINE} for {t.baseline_for}: the "
                "same answers decoded with fewer accepted drafts, or a changed workload. "
                "See gotchas/alert-thresholds.md.",
            },
        ),
        Rule(
            "Gemma4MTPCountersFlat",
            generating.and_on(flat, ENGINE_BY),
            "MTP is configured (the counters exist) but no drafts while tokens are generated.",
            alert=True,
            for_=t.counters_flat_for,
            labels={"severity": "critical"},
            annotations={
                "summary": f"MTP configured but not drafting on {ON_INSTANCE}",
                "description": "{{ $labels.model_name }} generates tokens but its "
                "speculative-decoding drafts counter has not moved for "
                f"{t.counters_flat_for}: MTP is not paying at all.",
            },
        ),
        Rule(
            "Gemma4EngineDown",
            n.UP.where(job=n.JOB_ENGINE).expr.eq(0),
            "Prometheus cannot scrape the engine.",
            alert=True,
            for_=t.engine_down_for,
            labels={"severity": "critical"},
            annotations={
                "summary": f"vLLM engine {ON_INSTANCE} is down",
                "description": "The scrape of {{ $labels.instance }} has failed for "
                f"{t.engine_down_for}.",
            },
        ),
        Rule(
            "Gemma4InstanceFailed",
            n.UNIT_STATE.where(state="failed").expr.eq(1),
            "The instance's unit is failed: systemd gave up restarting it (start limit, or an "
            "exit it does not restart); it stays down until an operator acts.",
            alert=True,
            for_=t.unit_failed_for,
            labels={"severity": "critical"},
            annotations={
                "summary": "Instance {{ $labels.instance }} failed ({{ $labels.result }})",
                "description": "systemd stopped restarting gemma4-vllm@{{ $labels.instance }} "
                "(result {{ $labels.result }}): read `journalctl -u "
                "gemma4-vllm@{{ $labels.instance }}`, fix the cause, then `systemctl "
                "reset-failed` and start it, or `appliance rollback {{ $labels.instance }}`. "
                "See gotchas/unit-restarts-and-start-limit.md.",
            },
        ),
        Rule(
            "Gemma4RequestsRejected",
            ratio(rejected, arrived) > t.rejected_share_max,
            "The engine keeps turning requests away at its queue bound (503).",
            alert=True,
            for_=t.rejected_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"Requests turned away at the queue bound on {ON_INSTANCE}",
                "description": "{{ $labels.model_name }} answers 503 to "
                "{{ $value | humanizePercentage }} of its requests (limit "
                f"{t.rejected_share_max:.0%}) for {t.rejected_for}: more traffic than the "
                "engine holds. Add capacity or send less; raise the profile's queue bound only "
                "if callers can wait longer. See gotchas/queue-bound.md.",
            },
        ),
        Rule(
            "Gemma4StateMetricsStale",
            Expr("time()") - _state_textfile() > t.state_stale_s,
            "The state textfile is not rewritten any more: every state series (a failed unit "
            "included) shows the past.",
            alert=True,
            for_=t.state_stale_for,
            labels={"severity": "warning"},
            annotations={
                "summary": "The appliance's state metrics are stale{{ with $labels.host }} on "
                "host {{ . }}{{ end }}",
                "description": "{{ $labels.file }} was last written {{ $value | "
                "humanizeDuration }} ago (the state timer writes it every minute): "
                "`systemctl status gemma4-appliance-state.service` and `appliance status "
                "--write-metrics` say why. Until then a unit that fails raises no "
                "Gemma4InstanceFailed.",
            },
        ),
        *_state_collector(t),
        Rule(
            "Gemma4EnvFileRefused",
            n.ENV_FILE_READABLE.where(job=n.JOB_STATE).expr.eq(0),
            "The appliance refuses the instance's env file: no cutover, rollback or status.",
            alert=True,
            labels={"severity": "warning"},
            annotations={
                "summary": f"The env file of {ON_INSTANCE} is refused",
                "description": "/etc/gemma4-vllm/{{ $labels.instance }}.env has a line systemd "
                "and the appliance could read differently: the unit runs on, but cutover, "
                "rollback and status refuse the instance. `appliance status "
                "{{ $labels.instance }}` names the line. See gotchas/alert-thresholds.md.",
            },
        ),
        Rule(
            "Gemma4KVCacheNearFull",
            agg("max", ENGINE_BY, n.KV_CACHE.expr) > t.kv_cache_max,
            "KV cache nearly full: requests will queue or be preempted.",
            alert=True,
            for_=t.kv_cache_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"KV cache near full on {ON_INSTANCE}",
                "description": "KV cache usage of {{ $labels.model_name }} is "
                "{{ $value | humanizePercentage }} for "
                f"{t.kv_cache_for} (limit {t.kv_cache_max:.0%}).",
            },
        ),
    )
    return (Group("gemma4_mtp.alerts", alerts), Group("gemma4_mtp_extremes.alerts", _extremes(t)))


def _state_collector(t: Thresholds) -> tuple[Rule, ...]:
    """The state collector down, serving no state textfile, or not scraped at all: the cases
    where Gemma4StateMetricsStale has no series to judge and so never fires."""
    up = n.UP.where(job=n.JOB_STATE)
    textfile = Layout().metrics_textfile()
    on_host = "{{ with $labels.host }} on host {{ . }}{{ end }}"
    blind = "Until then a unit that fails raises no Gemma4InstanceFailed."
    return (
        Rule(
            "Gemma4StateCollectorDown",
            up.expr.eq(0),
            "node_exporter, which serves the state textfile, does not answer its scrape.",
            alert=True,
            for_=t.state_collector_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"The appliance's state collector is down{on_host}",
                "description": "node_exporter at {{ $labels.instance }} has not answered the "
                f"{n.JOB_STATE} scrape for {t.state_collector_for}: no state series is read. "
                "`systemctl status prometheus-node-exporter` (or your node_exporter's unit) "
                f"says why. {blind}",
            },
        ),
        Rule(
            "Gemma4StateTextfileMissing",
            up.expr.eq(1).unless_on(_state_textfile(), ("host", "instance", "job")),
            "node_exporter answers but serves no state textfile (its textfile collector reads "
            "another folder, or the state timer never wrote the file).",
            alert=True,
            for_=t.state_collector_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"The appliance's state textfile is not served{on_host}",
                "description": "node_exporter at {{ $labels.instance }} answers but has served "
                f"no {textfile.name} for {t.state_collector_for}: link {textfile} into its "
                f"textfile directory (Debian's {n.DEBIAN_TEXTFILE_DIR}), or from node_exporter "
                f"1.9 add --collector.textfile.directory={textfile.parent} beside the flag of "
                "that directory (README, Monitoring); and see that gemma4-appliance-state.timer "
                f"runs (`appliance status --write-metrics` writes the file once). {blind}",
            },
        ),
        Rule(
            "Gemma4StateCollectorAbsent",
            absent(up),
            "No state collector is scraped at all: no job, or no host's agent writes one.",
            alert=True,
            for_=t.state_collector_for,
            labels={"severity": "warning"},
            annotations={
                "summary": f"No {n.JOB_STATE} target is scraped",
                "description": f"Prometheus has had no {n.JOB_STATE} target for "
                f"{t.state_collector_for}: its scrape config lacks the job (`appliance "
                "observability write`, or `appliance fleet scrape-config` on each host), or no "
                f"host's Prometheus agent writes to this server. {blind}",
            },
        ),
    )


def _state_textfile() -> Expr:
    """The state textfile's mtime as node_exporter reports it (``file`` is its path, or its
    base name before node_exporter 1.5)."""
    name = Layout().metrics_textfile().name.replace(".", "[.]")
    matchers = (("job", "=", n.JOB_STATE), ("file", "=~", f"(.*/)?{name}"))
    return Selector(n.TEXTFILE_MTIME.metric, matchers).expr


def _extremes(t: Thresholds) -> tuple[Rule, ...]:
    """Too many long calls per role at an acceptance edge (see the gotcha for the values)."""
    judged = (
        (recorded(ROLE_DRAFT_TOKENS_PER_CALL) >= t.long_call_draft_tokens)
        .paren()
        .and_on((recorded(ROLE_EXACT_CALLS) >= t.extremes_min_calls_per_s).paren(), ROLE_BY)
    )
    out = []
    for name, series, limit, edge, what, why in (
        (
            "Gemma4MTPRepetitionSuspects",
            ROLE_NEAR_ONE,
            t.near_one_share_max,
            f"> {t.near_one_le}",
            "repetition-loop suspects",
            "a drafter accepts everything when the target repeats itself",
        ),
        (
            "Gemma4MTPDrafterMismatchSuspects",
            ROLE_NEAR_ZERO,
            t.near_zero_share_max,
            f"<= {t.near_zero_le}",
            "drafter mismatch or garbage suspects",
            "a drafter that does not match the target, or garbled output, accepts almost nothing",
        ),
    ):
        out.append(
            Rule(
                name,
                (recorded(series) > limit).and_on(judged, ROLE_BY),
                f"Share of the role's long calls with acceptance {edge} above {limit:.0%}.",
                alert=True,
                for_=t.extremes_for,
                labels={"severity": "warning"},
                annotations={
                    "summary": f"MTP {what} in role {{{{ $labels.role }}}}"
                    "{{ with $labels.host }} on host {{ . }}{{ end }}",
                    "description": "{{ $value | humanizePercentage }} of the long calls of role "
                    "{{ $labels.role }} ({{ $labels.model }}) have per-call "
                    f"acceptance {edge} (limit {limit:.0%}) for {t.extremes_for}: "
                    f"{why}. See gotchas/per-call-acceptance-extremes.md.",
                },
            )
        )
    return tuple(out)


def all_rules(t: Thresholds = Thresholds()) -> list[Rule]:
    return [r for g in (*recording_groups(), *alert_groups(t)) for r in g.rules]


def render(groups: tuple[Group, ...]) -> str:
    """The rule file's YAML: strings JSON-quoted (valid YAML), one comment per rule."""
    lines = ["# Generated by `appliance dev generate`; edit appliance/observability/.", "groups:"]
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
