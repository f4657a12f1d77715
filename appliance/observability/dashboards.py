"""The appliance's Grafana dashboards, defined with the typed builders.

Edit the panels here and run ``appliance dev generate``; the committed JSON in
``grafana/dashboards/`` is its output and a test fails when they drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import names as n
from . import rules as r
from .panels import Annotation, Dashboard, Layout, Panel, Target, Variable
from .promql import Expr, Selector, agg, histogram_quantile, increase, ratio, recorded, sum_rate

RATE = "$__rate_interval"
# Every query of a dashboard follows every variable of it (tests/test_dashboard_variables.py).
# `host`: the fleet's file_sd and agents label every series with its inventory host, and the
# fleet role installs the same instance names on every host; a single host has no such label,
# which the variable's All (.*) matches.
ENGINE = {"host": "$host", "instance": "$instance", "model_name": "$model_name"}
# The agent's series: their `instance` is the scrape address, never an appliance instance.
ROLE = {"host": "$host", "role": "$role", "model": "$model_name"}
BY_ENGINE = ("host", "instance", "model_name")
BY_DP_ENGINE = ("host", "instance", "engine")  # vLLM's `engine` label: one per data-parallel engine
BY_EVENT = ("host", "instance", "kind", "outcome")
LATENCY_QUANTILES = (0.5, 0.9, 0.99)
# Legend suffix: instances of one name on many hosts stay told apart (empty on a single host).
ON_HOST = " {{host}}"

DATASOURCE = Variable("datasource", "Datasource")
HOST = Variable("host", "Host", "label_values(vllm:num_requests_running, host)")
ENGINE_VARIABLES = (
    DATASOURCE,
    HOST,
    Variable(
        "instance",
        "Instance",
        'label_values(vllm:num_requests_running{host=~"$host"}, instance)',
    ),
    Variable(
        "model_name",
        "Model",
        'label_values(vllm:num_requests_running{host=~"$host", instance=~"$instance"}, model_name)',
    ),
)
# The per-role dashboard's: no instance (the agent's series carry none of the appliance's), the
# models and roles the agent reported on the chosen hosts.
ROLE_VARIABLES = (
    DATASOURCE,
    HOST,
    Variable("model_name", "Model", 'label_values(gemma4_agent_calls_total{host=~"$host"}, model)'),
    Variable(
        "role",
        "Role",
        'label_values(gemma4_agent_calls_total{host=~"$host", model=~"$model_name"}, role)',
    ),
)


@dataclass(frozen=True)
class Scope:
    """How one dashboard's variables narrow series that lack some of their labels (the
    appliance state carries ``host`` and ``instance`` only; the agent's errors no role).

    ``where`` selects on the labels the series have. A variable they lack (the model, the role)
    narrows them through ``present`` series that know it, joined ``on`` the labels both carry: a
    series goes where ``present`` has series for its ``on`` labels and none of them is
    ``chosen``. With All nothing goes, and an instance whose engine is down (no ``present``
    series) keeps its cutover marks."""

    where: dict[str, str]
    on: tuple[str, ...]
    present: Selector
    chosen: Selector

    def select(self, sel: Selector) -> Selector:
        return sel.where(**self.where)

    def narrow(self, expr: Expr) -> Expr:
        others = agg("group", self.on, self.present.expr).unless_on(
            agg("group", self.on, self.chosen.expr), self.on
        )
        return expr.unless_on(others.paren(), self.on)


ENGINE_SCOPE = Scope(
    where={"host": "$host", "instance": "$instance"},
    on=("host", "instance"),
    present=n.RUNNING.where(host="$host", instance="$instance"),
    chosen=n.RUNNING.where(**ENGINE),
)
# The per-role view: the hosts whose agent reports calls of the chosen roles to the chosen models
# (or reports none).
ROLE_SCOPE = Scope(
    where={"host": "$host"},
    on=("host",),
    present=n.AGENT_CALLS.where(host="$host"),
    chosen=n.AGENT_CALLS.where(**ROLE),
)

ITL_NOTE = (
    " Under MTP one engine step emits 1 + accepted tokens, and a streamed chunk carries all of "
    "them: ITL measures gaps between chunks, so it rises with MTP while per-token time (TPOT) "
    "falls. Judge MTP by TPOT and tokens per second (gotchas/itl-under-mtp.md)."
)


def _latency(title: str, sel, what: str, note: str = "") -> Panel:
    targets = tuple(
        Target(
            histogram_quantile(q, sel.where(**ENGINE), BY_ENGINE, RATE),
            f"p{round(q * 100)} {{{{instance}}}} {{{{model_name}}}}{ON_HOST}",
        )
        for q in LATENCY_QUANTILES
    )
    return Panel(
        "timeseries",
        title,
        f"{what} p50/p90/p99 from vLLM's histogram.{note}",
        targets,
        unit="s",
        width=8,
    )


def _cutover(kind: str, scope: Scope) -> Annotation:
    sel = scope.select(n.CUTOVER_EVENTS.where(kind=kind))
    return Annotation(
        name=f"{kind.capitalize()}s",
        expr=scope.narrow(agg("sum", BY_EVENT, increase(sel, "1m")) > 0),
        color="blue" if kind == "cutover" else "red",
        title=f"{kind} on {{{{instance}}}}{ON_HOST}",
        text="outcome {{outcome}}",
    )


def _canary(scope: Scope) -> Annotation:
    """Where a cutover's output canary ran, with its verdict and figures in the text.

    The series' labels change with every canary (its figures), so ``changes()`` would miss a
    new series; the annotation marks the minute after the canary's recorded time instead."""
    labels = ("host", "instance", "verdict", "identical", "tasks", "vllm")
    last = agg("max", labels, scope.select(n.LAST_CANARY).expr)
    return Annotation(
        name="Output canary",
        expr=scope.narrow(Expr(f"(time() - {last.text}) < 60", last.metrics)),
        color="purple",
        title=f"canary {{{{verdict}}}} on {{{{instance}}}}{ON_HOST}",
        text="{{identical}} outputs identical, tasks {{tasks}}, vLLM {{vllm}}",
    )


def _annotations(scope: Scope) -> tuple[Annotation, ...]:
    return (_cutover("cutover", scope), _cutover("rollback", scope), _canary(scope))


def _state(sel: Selector) -> Expr:
    """An appliance state series on the overview's chosen hosts and instances."""
    return ENGINE_SCOPE.select(sel).expr


def _stat(
    title: str,
    description: str,
    expr,
    unit: str = "short",
    decimals: int | None = None,
    legend: str = "all selected",
) -> Panel:
    return Panel(
        "stat",
        title,
        description,
        (Target(expr, legend),),
        unit=unit,
        width=4,
        height=4,
        decimals=decimals,
    )


def _sel_rate(sel):
    """The selection's rate summed over every engine (the stat row's one number)."""
    return sum_rate(sel.where(**ENGINE), (), RATE)


def at_a_glance() -> tuple[Panel, ...]:
    """vLLM's speculative-decoding stat row, over the selected instances and models."""
    acc, drafted = _sel_rate(n.ACCEPTED), _sel_rate(n.DRAFT_TOKENS)
    return (
        _stat(
            "Draft acceptance",
            "accepted / draft tokens over the selection.",
            ratio(acc, drafted),
            "percentunit",
            3,
        ),
        _stat(
            "Mean acceptance length",
            "1 + accepted / drafts: tokens per engine step, "
            "bonus token included; the ceiling is 1 + k.",
            1 + ratio(acc, _sel_rate(n.DRAFTS)),
            decimals=2,
        ),
        _stat(
            "Accepted tokens / s", "Draft tokens the target accepted, per second.", acc, "tps", 1
        ),
        _stat("Draft tokens / s", "Draft tokens proposed, per second.", drafted, "tps", 1),
        _stat(
            "Drafts / s",
            "Drafts (verification steps with a draft) per second.",
            _sel_rate(n.DRAFTS),
            "short",
            1,
        ),
        _stat(
            "Output from drafts",
            "Share of output tokens that were accepted drafts: what "
            "MTP added on top of one token per step.",
            ratio(acc, _sel_rate(n.GENERATION_TOKENS)),
            "percentunit",
            3,
        ),
    )


def per_engine() -> tuple[Panel, ...]:
    """Data-parallel deployments: one line per engine (vLLM's `engine` label)."""

    def by_engine(sel):
        return sum_rate(sel.where(**ENGINE), BY_DP_ENGINE, RATE)

    return (
        Panel(
            "timeseries",
            "Draft acceptance by engine",
            "accepted / draft tokens per data-parallel engine: one engine drifting from the "
            "others points at that engine (its GPU, its drafter load), not at the workload.",
            (
                Target(
                    ratio(by_engine(n.ACCEPTED), by_engine(n.DRAFT_TOKENS)),
                    "{{instance}} engine {{engine}}" + ON_HOST,
                ),
            ),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Output tokens per second by engine",
            "Generated tokens per second per data-parallel engine: the load balance.",
            (Target(by_engine(n.GENERATION_TOKENS), "{{instance}} engine {{engine}}" + ON_HOST),),
            unit="tps",
        ),
    )


def before_after() -> tuple[Panel, ...]:
    """Around each cutover annotation: the previous image's figures against the new one's."""
    note = (
        " Each line is one image: at a cutover annotation the previous image's line ends "
        "and the new one's starts, so the two sit side by side on the same axes. The image "
        "comes from the appliance state; the engine's scrape names the same instance."
    )
    return (
        Panel(
            "timeseries",
            "Output tokens per second by running image",
            "Generated tokens per second, by the image the instance ran." + note,
            (Target(recorded(r.IMAGE_TOKENS_1M, ENGINE), "{{image}} {{instance}}" + ON_HOST),),
            unit="tps",
        ),
        Panel(
            "timeseries",
            "Draft acceptance by running image",
            "accepted / draft tokens, by the image the instance ran." + note,
            (
                Target(
                    recorded(r.IMAGE_ACCEPTANCE_1M, ENGINE),
                    "{{image}} {{instance}}" + ON_HOST,
                ),
            ),
            unit="percentunit",
            min=0,
            max=1,
        ),
    )


def overload() -> tuple[Panel, ...]:
    """The queue and what the engine turns away at its bound (gotchas/queue-bound.md)."""
    return (
        Panel(
            "timeseries",
            "Queue depth",
            "Requests waiting for a place in the running batch. The engine's queue bound "
            "(--max-num-queued-reqs, from the profile) counts these and the running ones; past "
            "it a request is turned away with 503 at once instead of waiting.",
            (
                Target(
                    agg("sum", BY_ENGINE, n.WAITING.where(**ENGINE).expr),
                    "waiting {{instance}} {{model_name}}" + ON_HOST,
                ),
            ),
        ),
        Panel(
            "timeseries",
            "Requests turned away per second",
            "Requests the engine answered 503 at its queue bound, by the bound that turned them "
            "away (max_num_queued_reqs or max_num_queued_tokens; vLLM >= 0.29). The "
            "Gemma4RequestsRejected alert fires when it lasts.",
            (
                Target(
                    sum_rate(n.ADMISSION_REJECTIONS.where(**ENGINE), (*BY_ENGINE, "reason"), RATE),
                    "{{reason}} {{instance}} {{model_name}}" + ON_HOST,
                ),
            ),
            unit="reqps",
        ),
    )


def overview() -> Dashboard:
    """Engine-side MTP, throughput, latency, load and the running image."""
    lay = Layout()
    lay.row("Gemma 4 MTP at a glance")
    lay.add(*at_a_glance())
    lay.row("Gemma 4 MTP")
    lay.add(
        Panel(
            "timeseries",
            "Draft acceptance rate",
            "vLLM's definition: accepted draft tokens / drafted tokens over 1m (the bonus "
            "token is not a draft, so it is not counted). No series while idle.",
            (Target(recorded(r.ACCEPTANCE_1M, ENGINE), "{{instance}} {{model_name}}" + ON_HOST),),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Mean tokens per step (acceptance length)",
            "vLLM's definition: 1 + accepted / drafts over 1m; the 1 is the bonus token the "
            "target always emits. 1.0 means MTP gains nothing; the ceiling is 1 + k.",
            (
                Target(
                    recorded(r.TOKENS_PER_STEP_1M, ENGINE), "{{instance}} {{model_name}}" + ON_HOST
                ),
            ),
            min=1,
            decimals=2,
        ),
        Panel(
            "timeseries",
            "Acceptance by draft position",
            "accepted_per_pos[i] / drafts over 1m: how often position i of a draft was "
            "accepted. Falls with position; position 0 bounds all others.",
            (Target(recorded(r.POSITION_1M, ENGINE), "pos {{position}} {{instance}}" + ON_HOST),),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Accepted vs rejected draft tokens",
            "Token flow through the drafter per second: accepted tokens and the drafted "
            "tokens the target rejected (drafted - accepted).",
            (
                Target(
                    sum_rate(n.ACCEPTED.where(**ENGINE), BY_ENGINE, RATE),
                    "accepted {{instance}}" + ON_HOST,
                ),
                Target(recorded(r.REJECTED_1M, ENGINE), "rejected {{instance}}" + ON_HOST),
            ),
            unit="tps",
            stack=True,
        ),
        Panel(
            "timeseries",
            "Share of output tokens from drafts",
            "Accepted draft tokens / output tokens over 1m: the part of the output MTP "
            "produced beyond one token per engine step.",
            (
                Target(
                    recorded(r.OUTPUT_FROM_DRAFTS_1M, ENGINE),
                    "{{instance}} {{model_name}}" + ON_HOST,
                ),
            ),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "stat",
            "MTP state",
            "MTP on: the running image was built with MTP (appliance state) and the engine "
            "exposes speculative-decoding counters (vLLM exposes none without it).",
            (
                Target(
                    ENGINE_SCOPE.narrow(
                        agg("max", ("host", "instance", "mtp"), _state(n.IMAGE_INFO))
                    ),
                    "image mtp={{mtp}} {{instance}}" + ON_HOST,
                    instant=True,
                ),
                Target(
                    agg("count", BY_ENGINE, n.DRAFTS.where(**ENGINE).expr),
                    "engine counters {{instance}}" + ON_HOST,
                    instant=True,
                ),
            ),
            width=8,
        ),
        Panel(
            "table",
            "Running image per instance",
            "The image each instance runs, its vLLM version and MTP flag, and the GPUs it is "
            "given (gpus: its device set), from the appliance's state textfile. Cutovers and "
            "rollbacks are annotations.",
            (Target(ENGINE_SCOPE.narrow(_state(n.IMAGE_INFO).eq(1)), instant=True),),
            width=16,
        ),
    )
    lay.row("Per engine (data parallel)")
    lay.add(*per_engine())
    lay.row("Before and after each cutover")
    lay.add(*before_after())
    lay.row("Throughput and latency")
    lay.add(
        Panel(
            "timeseries",
            "Output tokens per second",
            "Generated tokens per second (all tokens, including accepted drafts and the "
            "bonus token).",
            (
                Target(
                    sum_rate(n.GENERATION_TOKENS.where(**ENGINE), BY_ENGINE, RATE),
                    "{{instance}} {{model_name}}" + ON_HOST,
                ),
            ),
            unit="tps",
            width=8,
        ),
        _latency("Time to first token", n.TTFT, "TTFT: request arrival to first output token."),
        _latency(
            "Time per output token",
            n.TPOT,
            "TPOT: (end-to-end - TTFT) / (output tokens - 1) per request (vLLM's "
            "definition, first token excluded).",
        ),
        _latency("Inter-token latency", n.ITL, "ITL: gaps between streamed outputs.", ITL_NOTE),
        _latency("End-to-end request latency", n.E2E, "E2E: arrival to last token."),
        Panel(
            "timeseries",
            "Requests running and waiting",
            "Requests in the running batch and in the queue.",
            (
                Target(
                    agg("sum", BY_ENGINE, n.RUNNING.where(**ENGINE).expr),
                    "running {{instance}}" + ON_HOST,
                ),
                Target(
                    agg("sum", BY_ENGINE, n.WAITING.where(**ENGINE).expr),
                    "waiting {{instance}}" + ON_HOST,
                ),
            ),
            width=8,
        ),
    )
    lay.row("Overload")
    lay.add(*overload())
    lay.row("Capacity")
    lay.add(
        Panel(
            "timeseries",
            "KV cache usage",
            "Fraction of KV cache blocks in use (vLLM reports a fraction 0..1). The "
            "Gemma4KVCacheNearFull alert fires above its threshold.",
            (
                Target(
                    agg("max", BY_ENGINE, n.KV_CACHE.where(**ENGINE).expr),
                    "{{instance}} {{model_name}}" + ON_HOST,
                ),
            ),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Cutover and rollback events",
            "Cutovers and rollbacks per hour by outcome, from the appliance's state "
            "textfile (also drawn as annotations on every panel).",
            (
                Target(
                    ENGINE_SCOPE.narrow(
                        agg("sum", BY_EVENT, increase(ENGINE_SCOPE.select(n.CUTOVER_EVENTS), "1h"))
                    ),
                    "{{kind}} {{outcome}} {{instance}}" + ON_HOST,
                ),
            ),
            width=8,
        ),
        Panel(
            "stat",
            "Last cutover",
            "When the instance last changed image (cutover or rollback), from the "
            "appliance's state textfile.",
            (
                Target(
                    ENGINE_SCOPE.narrow(
                        agg("max", ("host", "instance"), _state(n.LAST_CUTOVER)) * 1000
                    ),
                    "{{instance}}" + ON_HOST,
                    instant=True,
                ),
            ),
            unit="dateTimeFromNow",
            width=4,
        ),
    )
    return Dashboard(
        uid="gemma4-mtp-overview",
        title="Gemma 4 MTP / Overview",
        description="Gemma 4 on vLLM with MTP speculative decoding: acceptance, tokens per "
        "step, throughput, latency, load and the running image. Generated by "
        "appliance/observability; do not edit by hand.",
        layout=lay,
        variables=ENGINE_VARIABLES,
        annotations=_annotations(ENGINE_SCOPE),
    )


def roles() -> Dashboard:
    """Per-role, per-call MTP figures from the telemetry agent's histograms and counters."""
    lay = Layout()
    lay.row("Per-role MTP (from the agent)")
    lay.add(
        Panel(
            "timeseries",
            "Per-call acceptance by role (p10 / median / p90)",
            "Distribution over calls of each call's draft acceptance (accepted / drafted), "
            "per role, over 5m. A low p10 shows the calls (e.g. code-heavy prompts) that the "
            "engine-wide ratio hides.",
            (Target(recorded(r.ROLE_CALL_ACCEPTANCE_Q, ROLE), "{{role}} q{{quantile}}" + ON_HOST),),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Per-call tokens per step by role (p10 / median / p90)",
            "Distribution over calls of 1 + accepted / drafts per call, per role, over 5m.",
            (Target(recorded(r.ROLE_CALL_TPS_Q, ROLE), "{{role}} q{{quantile}}" + ON_HOST),),
            min=1,
            decimals=2,
        ),
        Panel(
            "timeseries",
            "Token-weighted acceptance by role",
            "Accepted / drafted tokens summed over the role's calls (weights long calls more "
            "than the per-call median does).",
            (Target(recorded(r.ROLE_ACCEPTANCE_5M, ROLE), "{{role}} {{model}}" + ON_HOST),),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Calls by role and figure source",
            "Calls per second by role, where the MTP figures came from (request: exact "
            "per-request metrics; counters: exact snapshot; shared: overlapped; absent: no "
            "speculative decoding) and outcome.",
            (
                Target(
                    sum_rate(
                        n.AGENT_CALLS.where(**ROLE), ("host", "role", "source", "outcome"), RATE
                    ),
                    "{{role}} {{source}} {{outcome}}" + ON_HOST,
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "timeseries",
            "Call duration by role (p50 / p90)",
            "Wall time of each call as the application saw it, per role.",
            tuple(
                Target(
                    histogram_quantile(q, n.AGENT_DURATION.where(**ROLE), ("host", "role"), RATE),
                    f"{{{{role}}}} p{round(q * 100)}{ON_HOST}",
                )
                for q in (0.5, 0.9)
            ),
            unit="s",
        ),
        Panel(
            "timeseries",
            "Calls at the acceptance extremes by role",
            "Share of each role's exact calls (15m) with acceptance near 1 (repetition-loop "
            "suspects) and near 0 (drafter mismatch or garbage), and the role's mean draft "
            "tokens per call (the alerts judge only long calls). Thresholds: "
            "gotchas/per-call-acceptance-extremes.md.",
            (
                Target(recorded(r.ROLE_NEAR_ONE, ROLE), "{{role}} near 1" + ON_HOST),
                Target(recorded(r.ROLE_NEAR_ZERO, ROLE), "{{role}} near 0" + ON_HOST),
            ),
            unit="percentunit",
            min=0,
            max=1,
        ),
        Panel(
            "timeseries",
            "Draft tokens per call by role",
            "Mean draft tokens per exact call over 15m: a call's acceptance is only telling "
            "when it is a ratio of many drafts.",
            (Target(recorded(r.ROLE_DRAFT_TOKENS_PER_CALL, ROLE), "{{role}} {{model}}" + ON_HOST),),
            decimals=1,
        ),
        Panel(
            "timeseries",
            "Agent errors",
            "The agent's own failures by kind (metrics unreachable, timeouts, parse errors); "
            "never the calls' errors.",
            (
                Target(
                    ROLE_SCOPE.narrow(
                        agg(
                            "sum",
                            ("host", "kind"),
                            increase(ROLE_SCOPE.select(n.AGENT_ERRORS), "5m"),
                        )
                    ),
                    "{{kind}}" + ON_HOST,
                ),
            ),
        ),
    )
    return Dashboard(
        uid="gemma4-mtp-roles",
        title="Gemma 4 MTP / Per-role calls",
        description="Per-call, per-role MTP figures from the appliance's telemetry agent: "
        "what vLLM's engine-wide counters cannot show. Generated by "
        "appliance/observability; do not edit by hand.",
        layout=lay,
        variables=ROLE_VARIABLES,
        annotations=_annotations(ROLE_SCOPE),
    )


DASHBOARDS = {"gemma4-mtp-overview.json": overview, "gemma4-mtp-roles.json": roles}
