"""Live: a real Prometheus on 127.0.0.1 scrapes the real CPU engine (copy drafter) and the agent
exporter while demo-like traffic runs through the agent; every dashboard query, annotation,
recording rule and alert is then evaluated through Prometheus' HTTP API."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, start_http_server

from appliance import agent
from appliance.agent import metrics as agent_metrics
from appliance.engine.local import free_port
from appliance.observability import generate, metric_check, rules, scrape, state_metrics
from appliance.observability.dashboards import DASHBOARDS

pytestmark = pytest.mark.engine

ROLES = ("architect", "worker")
PROMPTS = (
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "Explain speculative decoding in two sentences.",
)
# Panels with no series on a healthy, error-free run: the agent's own errors.
MAY_BE_EMPTY = {"Agent errors"}
# Grafana's variables as "All" and a rate window that spans the whole short run.
SUBST = {
    "$__rate_interval": "1m",
    **{f"${v.name}": ".*" for b in DASHBOARDS.values() for v in b().variables if v.query},
}
assert {"$host", "$instance", "$model_name", "$role"} <= SUBST.keys()


def _grafana(expr: str) -> str:
    for k, v in SUBST.items():
        expr = expr.replace(k, v)
    return expr


def _serve(registry: CollectorRegistry):
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return port, server, thread


def _traffic(engine_url: str, registry: CollectorRegistry, seconds: float) -> int:
    """Sequential calls per role, every other one streamed, like the demo; returns the count."""
    clients = {
        r: agent.instrument(
            openai.OpenAI(base_url=engine_url + "/v1", api_key="unused"), role=r, registry=registry
        )
        for r in ROLES
    }
    model = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    calls, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline or calls < 8:
        role = ROLES[calls % 2]
        kwargs = {
            "model": model,
            "max_tokens": 48,
            "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[calls % len(PROMPTS)]}],
        }
        if calls % 4 >= 2:
            for _ in clients[role].chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            ):
                pass
        else:
            clients[role].chat.completions.create(**kwargs)
        calls += 1
    return calls


def test_dashboards_rules_and_alerts_live(mtp_engine, prometheus_server):
    agent_reg = CollectorRegistry()
    agent_port, agent_srv, agent_thread = _serve(agent_metrics.for_registry(agent_reg).registry)
    # Stands in for node_exporter's textfile collector: the same registry the textfile is
    # written from, served over HTTP (node_exporter is not installed on these machines).
    state_reg = state_metrics.build_registry(
        [
            state_metrics.InstanceState(
                "cpu-tiny",
                "gemma4-vllm:cpu-mtp",
                "0.32.0",
                True,
                {("cutover", "ok"): 1},
                time.time(),
            )
        ]
    )
    state_port, state_srv, state_thread = _serve(state_reg)
    try:
        engine_target = mtp_engine.url.removeprefix("http://")
        # The engine is scraped under the appliance instance name the state metrics carry.
        config = scrape.render(
            scrape.ScrapeTargets(
                engine=(f"cpu-tiny={engine_target}",),
                engine_files=(),
                agent=(f"127.0.0.1:{agent_port}",),
                state=(f"127.0.0.1:{state_port}",),
                scrape_interval="1s",
                evaluation_interval="1s",
                rule_files=("rules/*.yml",),
                alertmanagers=(),  # the alert path is test_alerting.py's
            )
        )
        files = {
            p.removeprefix("prometheus/"): t
            for p, t in generate.outputs().items()
            if p.startswith("prometheus/rules/")
        }
        prom = prometheus_server(config, files)
        _wait(
            lambda: (
                prom.targets_up()
                == {"vllm": "up", "gemma4-agent": "up", "gemma4-appliance-state": "up"}
            ),
            20,
            prom,
        )
        calls = _traffic(mtp_engine.url, agent_reg, seconds=20)
        assert agent.flush(30)  # every call's figures are in the agent's registry
        _settle(prom, since=time.time())
        at = time.time()
        # Prometheus holds the agent's every call (the poll above waited for the final scrape).
        assert _values(prom.query("sum(gemma4_agent_calls_total)", at)) == [calls]

        results: dict[tuple[str, str], list[dict]] = {}
        for fname, build in DASHBOARDS.items():
            board = build()
            for panel in board.panels():
                for t in panel.targets:
                    results[(panel.title, f"{fname}: {panel.title}: {t.legend}")] = prom.query(
                        _grafana(t.expr.text), at
                    )
            for a in board.annotations:
                prom.query(_grafana(a.expr.text), at)  # must evaluate; empty without events
        for r in rules.all_rules():
            prom.query(r.expr.text, at)

        empty = [
            name for (title, name), res in results.items() if title not in MAY_BE_EMPTY and not res
        ]
        assert not empty, f"panels with no series: {empty}"
        for res in results.values():
            for s in res:
                assert s["value"][1] not in ("NaN", "+Inf", "-Inf"), s

        acc = _values(prom.query(rules.ACCEPTANCE_1M, at))
        tps = _values(prom.query(rules.TOKENS_PER_STEP_1M, at))
        pos = _values(prom.query(rules.POSITION_1M, at))
        role_p50 = _values(prom.query(f'{rules.ROLE_CALL_ACCEPTANCE_Q}{{quantile="0.5"}}', at))
        role_p10 = _values(prom.query(f'{rules.ROLE_CALL_ACCEPTANCE_Q}{{quantile="0.1"}}', at))
        role_tps = _values(prom.query(f'{rules.ROLE_CALL_TPS_Q}{{quantile="0.5"}}', at))
        role_acc = _values(prom.query(rules.ROLE_ACCEPTANCE_5M, at))
        print(
            f"\nlive: {calls} calls; acceptance {acc}; tokens/step {tps}; per position {pos}; "
            f"per-role p50 {role_p50} p10 {role_p10}; per-role tokens/step p50 {role_tps}; "
            f"per-role token-weighted {role_acc}"
        )
        assert acc and min(acc) >= 0.9
        assert tps and min(tps) >= 2.8  # k=2, copy drafter: 1 + ~2
        assert len(pos) == 2 and min(pos) >= 0.9
        assert len(role_p50) == len(ROLES) and min(role_p50) >= 0.9
        assert len(role_p10) == len(ROLES) and min(role_p10) >= 0.9
        assert len(role_acc) == len(ROLES) and min(role_acc) >= 0.9
        assert len(role_tps) == len(ROLES) and min(role_tps) >= 2.5
        # The new views: output from drafts, the running image's figures, the extremes.
        from_drafts = _values(prom.query(rules.OUTPUT_FROM_DRAFTS_1M, at))
        by_image = prom.query(rules.IMAGE_ACCEPTANCE_1M, at)
        near_one = _values(prom.query(rules.ROLE_NEAR_ONE, at))
        near_zero = _values(prom.query(rules.ROLE_NEAR_ZERO, at))
        print(
            f"output from drafts {from_drafts}; acceptance by image "
            f"{[(s['metric']['image'], s['value'][1]) for s in by_image]}; "
            f"per-role share near 1 {near_one}, near 0 {near_zero}"
        )
        assert from_drafts and min(from_drafts) >= 0.5  # k=2, copy drafter: ~2 of 3 tokens
        assert [s["metric"]["image"] for s in by_image] == ["gemma4-vllm:cpu-mtp"]
        assert float(by_image[0]["value"][1]) >= 0.9
        assert len(near_one) == len(ROLES) and len(near_zero) == len(ROLES)
        assert max(near_zero) == 0.0
        # No alert fires on a healthy engine with a good drafter.
        assert prom.query('ALERTS{alertstate="firing"}', at) == []

        # Every series used exists in THIS engine's /metrics or the agent's/state registries.
        known = metric_check.exposition_names(httpx.get(mtp_engine.url + "/metrics").text)
        known |= metric_check.registry_names(agent_reg) | metric_check.registry_names(state_reg)
        assert metric_check.missing(known) == {}
    finally:
        for srv, thread in ((agent_srv, agent_thread), (state_srv, state_thread)):
            srv.shutdown()
            srv.server_close()
            thread.join(timeout=5)


def _values(result: list[dict]) -> list[float]:
    return [round(float(s["value"][1]), 4) for s in result]


NEVER = "1970-01-01T00:00:00Z"


def _settle(prom, since: float, timeout: float = 60) -> None:
    """Wait until every target was scraped without error after ``since`` (wall clock), then
    every rule group evaluated twice after that (a rule reading a series that another group
    records sees its final value), so queries from the time this returns see the final
    figures. Fails at the deadline saying what is behind."""
    waits = ("every target scraped", "every rule group evaluated", "... and evaluated again")
    mark, deadline = since, time.monotonic() + timeout
    for waiting_for in waits:
        while True:
            if waiting_for == waits[0]:
                data = httpx.get(prom.url + "/api/v1/targets", timeout=10).json()["data"]
                # A failed scrape (its 1 s timeout on a loaded host) marks the target's series
                # stale, and a rule that joins them records nothing: only a healthy one counts.
                last = {
                    t["scrapeUrl"]: t["lastScrape"] if t["health"] == "up" else NEVER
                    for t in data["activeTargets"]
                }
            else:
                data = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]
                last = {g["name"]: g["lastEvaluation"] for g in data["groups"]}
            behind = {k: v for k, v in last.items() if _unix(v) <= mark}
            if last and not behind:
                break
            if time.monotonic() > deadline:
                pytest.fail(
                    f"Prometheus did not catch up within {timeout} s of the last call: waiting "
                    f"for {waiting_for} after {mark}, behind: {behind or last}; "
                    f"log {Path(prom.log_path).read_text()[-1500:]}"
                )
            time.sleep(0.2)
        mark = time.time()  # what was reported so far is stored: the next wait starts here


def _unix(rfc3339: str) -> float:
    """Prometheus' API timestamps (RFC 3339, nanoseconds) as Unix seconds."""
    return datetime.fromisoformat(rfc3339).timestamp()


def _wait(cond, timeout: float, prom) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(
                f"targets not up: {prom.targets_up()}; "
                f"log {Path(prom.log_path).read_text()[-1500:]}"
            )
        time.sleep(0.5)
