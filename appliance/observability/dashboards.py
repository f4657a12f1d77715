"""The appliance's Grafana dashboards, defined with the typed builders.

Edit the panels here and run ``appliance observability generate``; the committed JSON in
``grafana/dashboards/`` is its output and a test fails when they drift apart.
"""

from __future__ import annotations

from . import names as n
from . import rules as r
from .panels import Annotation, Dashboard, Layout, Panel, Target, Variable
from .promql import agg, histogram_quantile, increase, recorded, sum_rate

RATE = "$__rate_interval"
ENGINE = {"instance": "$instance", "model_name": "$model_name"}
ROLE = {"role": "$role", "model": "$model_name"}
BY_ENGINE = ("instance", "model_name")
LATENCY_QUANTILES = (0.5, 0.9, 0.99)

VARIABLES = (
    Variable("datasource", "Datasource"),
    Variable("instance", "Instance", "label_values(vllm:num_requests_running, instance)"),
    Variable("model_name", "Model",
             'label_values(vllm:num_requests_running{instance=~"$instance"}, model_name)'),
    Variable("role", "Role", "label_values(gemma4_agent_calls_total, role)"),
)

ITL_NOTE = (
    " Under MTP one engine step emits 1 + accepted tokens, and a streamed chunk carries all of "
    "them: ITL measures gaps between chunks, so it rises with MTP while per-token time (TPOT) "
    "falls. Judge MTP by TPOT and tokens per second (gotchas/itl-under-mtp.md)."
)


def _latency(title: str, sel, what: str, note: str = "") -> Panel:
    targets = tuple(
        Target(histogram_quantile(q, sel.where(**ENGINE), BY_ENGINE, RATE),
               f"p{round(q * 100)} {{{{instance}}}} {{{{model_name}}}}")
        for q in LATENCY_QUANTILES
    )
    return Panel("timeseries", title, f"{what} p50/p90/p99 from vLLM's histogram.{note}",
                 targets, unit="s", width=8, group="latency")


def _cutover(kind: str) -> Annotation:
    sel = n.CUTOVER_EVENTS.where(kind=kind)
    return Annotation(
        name=f"{kind.capitalize()}s",
        expr=agg("sum", ("instance", "kind", "outcome"), increase(sel, "1m")) > 0,
        color="blue" if kind == "cutover" else "red",
        title=f"{kind} on {{{{instance}}}}",
        text="outcome {{outcome}}",
    )


def overview() -> Dashboard:
    """Engine-side MTP, throughput, latency, load and the running image."""
    lay = Layout()
    lay.row("Gemma 4 MTP")
    lay.add(
        Panel("timeseries", "Draft acceptance rate",
              "vLLM's definition: accepted draft tokens / drafted tokens over 1m (the bonus "
              "token is not a draft, so it is not counted). No series while idle.",
              (Target(recorded(r.ACCEPTANCE_1M, ENGINE), "{{instance}} {{model_name}}"),),
              unit="percentunit", min=0, max=1),
        Panel("timeseries", "Mean tokens per step (acceptance length)",
              "vLLM's definition: 1 + accepted / drafts over 1m; the 1 is the bonus token the "
              "target always emits. 1.0 means MTP gains nothing; the ceiling is 1 + k.",
              (Target(recorded(r.TOKENS_PER_STEP_1M, ENGINE), "{{instance}} {{model_name}}"),),
              min=1, decimals=2),
        Panel("timeseries", "Acceptance by draft position",
              "accepted_per_pos[i] / drafts over 1m: how often position i of a draft was "
              "accepted. Falls with position; position 0 bounds all others.",
              (Target(recorded(r.POSITION_1M, ENGINE), "pos {{position}} {{instance}}"),),
              unit="percentunit", min=0, max=1),
        Panel("timeseries", "Accepted vs rejected draft tokens",
              "Token flow through the drafter per second: accepted tokens and the drafted "
              "tokens the target rejected (drafted - accepted).",
              (Target(sum_rate(n.ACCEPTED.where(**ENGINE), BY_ENGINE, RATE),
                      "accepted {{instance}}"),
               Target(recorded(r.REJECTED_1M, ENGINE), "rejected {{instance}}")),
              unit="tps", stack=True),
        Panel("stat", "MTP state",
              "MTP on: the running image was built with MTP (appliance state) and the engine "
              "exposes speculative-decoding counters (vLLM exposes none without it).",
              (Target(agg("max", ("instance", "mtp"), n.IMAGE_INFO.expr),
                      "image mtp={{mtp}} {{instance}}", instant=True),
               Target(agg("count", BY_ENGINE, n.DRAFTS.where(**ENGINE).expr),
                      "engine counters {{instance}}", instant=True)),
              width=8, group="state"),
        Panel("table", "Running image per instance",
              "The image each instance runs, its vLLM version and MTP flag, from the "
              "appliance's state textfile. Cutovers and rollbacks are annotations.",
              (Target(n.IMAGE_INFO.expr.eq(1), instant=True),),
              width=16, group="state"),
    )
    lay.row("Throughput and latency")
    lay.add(
        Panel("timeseries", "Output tokens per second",
              "Generated tokens per second (all tokens, including accepted drafts and the "
              "bonus token).",
              (Target(sum_rate(n.GENERATION_TOKENS.where(**ENGINE), BY_ENGINE, RATE),
                      "{{instance}} {{model_name}}"),),
              unit="tps", width=8, group="latency"),
        _latency("Time to first token", n.TTFT, "TTFT: request arrival to first output token."),
        _latency("Time per output token", n.TPOT,
                 "TPOT: (end-to-end - TTFT) / (output tokens - 1) per request (vLLM's "
                 "definition, first token excluded)."),
        _latency("Inter-token latency", n.ITL, "ITL: gaps between streamed outputs.", ITL_NOTE),
        _latency("End-to-end request latency", n.E2E, "E2E: arrival to last token."),
        Panel("timeseries", "Requests running and waiting",
              "Requests in the running batch and in the queue.",
              (Target(agg("sum", BY_ENGINE, n.RUNNING.where(**ENGINE).expr), "running {{instance}}"),
               Target(agg("sum", BY_ENGINE, n.WAITING.where(**ENGINE).expr), "waiting {{instance}}")),
              width=8, group="load"),
    )
    lay.row("Capacity")
    lay.add(
        Panel("timeseries", "KV cache usage",
              "Fraction of KV cache blocks in use (vLLM reports a fraction 0..1). The "
              "Gemma4KVCacheNearFull alert fires above its threshold.",
              (Target(agg("max", BY_ENGINE, n.KV_CACHE.where(**ENGINE).expr),
                      "{{instance}} {{model_name}}"),),
              unit="percentunit", min=0, max=1, group="load"),
        Panel("timeseries", "Cutover and rollback events",
              "Cutovers and rollbacks per hour by outcome, from the appliance's state "
              "textfile (also drawn as annotations on every panel).",
              (Target(agg("sum", ("instance", "kind", "outcome"),
                          increase(n.CUTOVER_EVENTS, "1h")),
                      "{{kind}} {{outcome}} {{instance}}"),),
              width=8, group="state"),
        Panel("stat", "Last cutover",
              "When the instance last changed image (cutover or rollback), from the "
              "appliance's state textfile.",
              (Target(agg("max", ("instance",),
                          n.LAST_CUTOVER.expr) * 1000,
                      "{{instance}}", instant=True),),
              unit="dateTimeFromNow", width=4, group="state"),
    )
    return Dashboard(
        uid="gemma4-mtp-overview",
        title="Gemma 4 MTP / Overview",
        description="Gemma 4 on vLLM with MTP speculative decoding: acceptance, tokens per "
                    "step, throughput, latency, load and the running image. Generated by "
                    "appliance/observability; do not edit by hand.",
        layout=lay,
        variables=VARIABLES,
        annotations=(_cutover("cutover"), _cutover("rollback")),
    )


def roles() -> Dashboard:
    """Per-role, per-call MTP figures from the telemetry agent's histograms and counters."""
    lay = Layout()
    lay.row("Per-role MTP (from the agent)")
    lay.add(
        Panel("timeseries", "Per-call acceptance by role (p10 / median / p90)",
              "Distribution over calls of each call's draft acceptance (accepted / drafted), "
              "per role, over 5m. A low p10 shows the calls (e.g. code-heavy prompts) that the "
              "engine-wide ratio hides.",
              (Target(recorded(r.ROLE_CALL_ACCEPTANCE_Q, ROLE), "{{role}} q{{quantile}}"),),
              unit="percentunit", min=0, max=1, group="role"),
        Panel("timeseries", "Per-call tokens per step by role (p10 / median / p90)",
              "Distribution over calls of 1 + accepted / drafts per call, per role, over 5m.",
              (Target(recorded(r.ROLE_CALL_TPS_Q, ROLE), "{{role}} q{{quantile}}"),),
              min=1, decimals=2, group="role"),
        Panel("timeseries", "Token-weighted acceptance by role",
              "Accepted / drafted tokens summed over the role's calls (weights long calls more "
              "than the per-call median does).",
              (Target(recorded(r.ROLE_ACCEPTANCE_5M, ROLE), "{{role}} {{model}}"),),
              unit="percentunit", min=0, max=1, group="role"),
        Panel("timeseries", "Calls by role and figure source",
              "Calls per second by role, where the MTP figures came from (request: exact "
              "per-request metrics; counters: exact snapshot; shared: overlapped; absent: no "
              "speculative decoding) and outcome.",
              (Target(sum_rate(n.AGENT_CALLS.where(**ROLE), ("role", "source", "outcome"), RATE),
                      "{{role}} {{source}} {{outcome}}"),),
              unit="reqps", group="role"),
        Panel("timeseries", "Call duration by role (p50 / p90)",
              "Wall time of each call as the application saw it, per role.",
              tuple(Target(histogram_quantile(q, n.AGENT_DURATION.where(**ROLE), ("role",), RATE),
                           f"{{{{role}}}} p{round(q * 100)}") for q in (0.5, 0.9)),
              unit="s", group="role"),
        Panel("timeseries", "Agent errors",
              "The agent's own failures by kind (metrics unreachable, timeouts, parse errors); "
              "never the calls' errors.",
              (Target(agg("sum", ("kind",), increase(n.AGENT_ERRORS, "5m")), "{{kind}}"),),
              group="agent"),
    )
    return Dashboard(
        uid="gemma4-mtp-roles",
        title="Gemma 4 MTP / Per-role calls",
        description="Per-call, per-role MTP figures from the appliance's telemetry agent: "
                    "what vLLM's engine-wide counters cannot show. Generated by "
                    "appliance/observability; do not edit by hand.",
        layout=lay,
        variables=VARIABLES,
        annotations=(_cutover("cutover"), _cutover("rollback")),
    )


DASHBOARDS = {"gemma4-mtp-overview.json": overview, "gemma4-mtp-roles.json": roles}
