"""Every dashboard query follows every variable of its dashboard, and a host's view holds that
host alone: the fleet role installs the same instance name on every host (issue 56 §4, E4).

The static half reads the committed JSON; the other half evaluates the queries that read the
appliance state with a real promtool, on two hosts that both run an instance named ``31b``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from plugins.observability import PROMTOOL

from appliance.observability import rules

ROOT = Path(__file__).resolve().parents[1]
BOARDS = sorted((ROOT / "grafana/dashboards").glob("*.json"))
VAR = re.compile(r"\$\{?(\w+)\}?")
# `by (...)`, `on (...)` and `group_left (...)` label lists (a space before the list or not).
GROUPING = re.compile(r"\b(?:by|on|without)\s*\(([^)]*)\)")


def _board(path: Path) -> dict:
    return json.loads(path.read_text())


def _queries(board: dict) -> list[tuple[str, dict, str]]:
    """(what, datasource, expr) for every panel target and every Prometheus annotation."""
    out = []
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {t['refId']}", t["datasource"], t["expr"]))
    for a in board["annotations"]["list"]:
        if not a.get("builtIn"):
            out.append((f"annotation {a['name']!r}", a["datasource"], a["target"]["expr"]))
    return out


def _variables(board: dict) -> tuple[set[str], set[str]]:
    """(datasource variables, query variables) by name."""
    found = board["templating"]["list"]
    return (
        {v["name"] for v in found if v["type"] == "datasource"},
        {v["name"] for v in found if v["type"] == "query"},
    )


def _grouping_labels(expr: str) -> list[set[str]]:
    return [{s.strip() for s in m[1].split(",") if s.strip()} for m in GROUPING.finditer(expr)]


def test_the_committed_dashboards_are_found():
    assert [p.name for p in BOARDS] == ["gemma4-mtp-overview.json", "gemma4-mtp-roles.json"]


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.stem)
def test_every_query_uses_every_variable_of_its_dashboard(path):
    board = _board(path)
    datasources, variables = _variables(board)
    assert datasources == {"datasource"} and variables
    missing, unknown, elsewhere = [], [], []
    for what, datasource, expr in _queries(board):
        used = set(VAR.findall(expr)) - {"__rate_interval"}
        if variables - used:
            missing.append(f"{what}: no {sorted('$' + v for v in variables - used)}")
        if used - variables:
            unknown.append(f"{what}: {sorted(used - variables)} is no variable")
        if datasource["uid"] != "${datasource}":
            elsewhere.append(what)
    assert not missing, "\n".join(missing)
    assert not unknown, "\n".join(unknown)
    assert not elsewhere, f"queries not on the datasource variable: {elsewhere}"


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.stem)
def test_every_variable_query_follows_the_variables_before_it(path):
    """The pickers chain: each offers what the ones to its left leave (a host's instances)."""
    found = [v for v in _board(path)["templating"]["list"] if v["type"] == "query"]
    for i, v in enumerate(found):
        used = set(VAR.findall(v["query"]["query"]))
        assert used <= {w["name"] for w in found[:i]}, v["name"]
    assert found[0]["name"] == "host"


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.stem)
def test_dashboard_queries_keep_hosts_apart(path):
    """Wherever a query groups or joins by instance, it does by host as well."""
    bad = [
        f"{what}: {sorted(labels)}"
        for what, _, expr in _queries(_board(path))
        for labels in _grouping_labels(expr)
        if "instance" in labels and "host" not in labels
    ]
    assert not bad, "\n".join(bad)


def test_rules_and_alerts_keep_hosts_apart():
    """The same for the recording rules and alerts (the central server holds every host's)."""
    bad = [
        f"{r.name}: {sorted(labels)}"
        for r in rules.all_rules()
        for labels in _grouping_labels(r.expr.text)
        if "instance" in labels and "host" not in labels
    ]
    assert not bad, "\n".join(bad)
    for path in (ROOT / "prometheus/rules").glob("*.yml"):
        for labels in _grouping_labels(path.read_text()):
            assert "instance" not in labels or "host" in labels, (path.name, labels)


# --- a fleet, evaluated -----------------------------------------------------------------------

# h1 and h2 both run an instance named 31b serving model m; h2 also runs e2b serving model
# "small"; h3's 31b engine is down (no engine series). Every instance's state has a cutover, a
# rollback and a canary at 11m. The agent on h1 reports calls of role architect, on h2 of role
# worker; h3 has no agent.
INSTANCES = (("h1", "31b", "m"), ("h2", "31b", "m"), ("h2", "e2b", "small"), ("h3", "31b", None))
AGENT = (("h1", "architect"), ("h2", "worker"))
EVAL_TIME = "11m"


def _fleet_series() -> list[dict]:
    series = []

    def add(name: str, values: str) -> None:
        series.append({"series": name, "values": values})

    for host, instance, model in INSTANCES:
        at = f'host="{host}",instance="{instance}"'
        if model:
            add(f'vllm:num_requests_running{{{at},model_name="{model}"}}', "1x20")
        for kind in ("cutover", "rollback"):
            add(
                f'gemma4_appliance_cutover_events_total{{{at},kind="{kind}",outcome="ok"}}',
                "0x10 1x10",
            )
        info = f'{at},image="gemma4-vllm:new",vllm_version="0.32.0",mtp="true",gpus="all"'
        add(f"gemma4_appliance_image_info{{{info}}}", "1x20")
        add(f"gemma4_appliance_last_cutover_timestamp_seconds{{{at}}}", "660x20")
        canary = f'{at},verdict="pass",identical="5/5",tasks="",vllm="0.32.0"'
        add(f"gemma4_appliance_last_canary_timestamp_seconds{{{canary}}}", "660x20")
    for host, role in AGENT:
        calls = f'host="{host}",role="{role}",model="m",source="request",outcome="ok"'
        add(f"gemma4_agent_calls_total{{{calls}}}", "0+1x20")
    return series


# (dashboard, the variables picked, the (host, instance) pairs its state queries must show).
ALL = {("h1", "31b"), ("h2", "31b"), ("h2", "e2b"), ("h3", "31b")}
VIEWS = [
    ("gemma4-mtp-overview", {}, ALL),
    # One host's view: its own 31b, never the other host's of the same name.
    ("gemma4-mtp-overview", {"host": "h1"}, {("h1", "31b")}),
    ("gemma4-mtp-overview", {"host": "h2", "instance": "31b"}, {("h2", "31b")}),
    # A model: the instances serving another model go; h3's, whose engine is down, stays.
    ("gemma4-mtp-overview", {"model_name": "m"}, ALL - {("h2", "e2b")}),
    ("gemma4-mtp-overview", {"model_name": "small"}, {("h2", "e2b"), ("h3", "31b")}),
    ("gemma4-mtp-roles", {}, ALL),
    ("gemma4-mtp-roles", {"host": "h2"}, {("h2", "31b"), ("h2", "e2b")}),
    # A role: the hosts whose agent reports only other roles go; h3, without an agent, stays.
    ("gemma4-mtp-roles", {"role": "architect"}, {("h1", "31b"), ("h3", "31b")}),
    ("gemma4-mtp-roles", {"model_name": "small"}, {("h3", "31b")}),
]


def _pick(expr: str, picked: dict[str, str], variables: set[str]) -> str:
    """``expr`` as Grafana sends it: each variable its pick, or All (``.*``)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", picked.get(name, ".*"))
    return expr.replace("$__rate_interval", "1m")


def test_a_hosts_view_shows_that_host_alone(tmp_path):
    """Every query that reads the appliance state (the three annotations, the MTP state, the
    running image, the events and the last cutover), under each pick of the variables."""
    cases = []
    for stem, picked, expected in VIEWS:
        board = _board(ROOT / f"grafana/dashboards/{stem}.json")
        _, variables = _variables(board)
        state = [(w, e) for w, _, e in _queries(board) if "gemma4_appliance_" in e]
        assert len(state) >= (7 if stem.endswith("overview") else 3), stem
        for what, expr in state:
            cases.append(
                {
                    # Each query's series by host and instance: a query that drops the host
                    # shows as the label missing.
                    "expr": f"group by (host, instance) ({_pick(expr, picked, variables)})",
                    "eval_time": EVAL_TIME,
                    "exp_samples": [
                        {"labels": f'{{host="{h}",instance="{i}"}}', "value": 1}
                        for h, i in sorted(expected)
                    ],
                    "_what": f"{stem} {picked}: {what}",
                }
            )
    whats = [c.pop("_what") for c in cases]
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": _fleet_series(), "promql_expr_test": cases}],
    }
    path = tmp_path / "fleet-views.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    res = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    failed = [w for w, c in zip(whats, cases, strict=True) if c["expr"] in res.stdout]
    assert res.returncode == 0, "\n".join(failed) + "\n" + res.stdout[-4000:] + res.stderr
