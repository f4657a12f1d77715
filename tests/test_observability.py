"""Dashboards, rules, alerts and scrape config: generated, drift-checked, schema-checked, and
every series they read proven to exist. The live half is tests/test_observability_live.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from plugins.observability import PROMTOOL

from appliance.agent import metrics as agent_metrics
from appliance.errors import UsageError
from appliance.observability import generate, metric_check, names, rules, state_metrics
from appliance.observability.dashboards import DASHBOARDS

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = ROOT / "tests" / "data" / "metrics-vllm-0.32-mtp.txt"


def _copy_generated(tmp_path: Path) -> Path:
    for d in ("grafana", "prometheus"):
        shutil.copytree(ROOT / d, tmp_path / d)
    return tmp_path


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


# --- generator and drift --------------------------------------------------------------------

# Drift, stray and hand-edit checks of the generated files: tests/test_generate.py.


def test_output_is_deterministic_with_stable_unique_ids():
    first, second = generate.outputs(), generate.outputs()
    assert first == second
    uids = [json.loads(first[f"grafana/dashboards/{f}"])["uid"] for f in sorted(DASHBOARDS)]
    assert uids == ["gemma4-mtp-overview", "gemma4-mtp-roles"]
    # Each dashboard's variables are those its series carry (tests/test_dashboard_variables.py):
    # the agent's have no appliance instance, the engines' no role.
    variables = {
        "gemma4-mtp-overview.json": ["datasource", "host", "instance", "model_name"],
        "gemma4-mtp-roles.json": ["datasource", "host", "model_name", "role"],
    }
    for fname in DASHBOARDS:
        board = json.loads(first[f"grafana/dashboards/{fname}"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        assert [v["name"] for v in board["templating"]["list"]] == variables[fname]


def test_every_panel_description_names_the_metrics_it_reads():
    for build in DASHBOARDS.values():
        for panel in build().to_json()["panels"]:
            if panel["type"] == "row":
                continue
            desc = panel["description"]
            assert "\n\nMetrics: " in desc, panel["title"]
            for target in panel["targets"]:
                # Each series name in the query is named in the description.
                for metric in _series_in(target["expr"]):
                    assert f"`{metric}`" in desc, (panel["title"], metric)


def _series_in(expr: str) -> set[str]:
    import re

    candidates = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{|\[)", expr))
    return {c for c in candidates if c not in {"rate", "increase", "by", "on"}}


def test_required_panels_exist():
    titles = {p.title for b in DASHBOARDS.values() for p in b().panels()}
    for needed in (
        "Draft acceptance rate",
        "Mean tokens per step (acceptance length)",
        "Acceptance by draft position",
        "Accepted vs rejected draft tokens",
        "Per-call acceptance by role (p10 / median / p90)",
        "Per-call tokens per step by role (p10 / median / p90)",
        "Output tokens per second",
        "Time to first token",
        "Time per output token",
        "Inter-token latency",
        "Requests running and waiting",
        "KV cache usage",
        "Running image per instance",
        "MTP state",
        # vLLM's stat row, output from drafts, per engine, before/after a cutover.
        "Draft acceptance",
        "Mean acceptance length",
        "Accepted tokens / s",
        "Draft tokens / s",
        "Drafts / s",
        "Output from drafts",
        "Share of output tokens from drafts",
        "Draft acceptance by engine",
        "Output tokens per second by running image",
        "Draft acceptance by running image",
        # Per-call extremes per role.
        "Calls at the acceptance extremes by role",
    ):
        assert needed in titles
    itl = next(
        p for b in DASHBOARDS.values() for p in b().panels() if p.title == "Inter-token latency"
    )
    assert "chunk" in itl.description and "TPOT" in itl.description
    overview = DASHBOARDS["gemma4-mtp-overview.json"]().to_json()
    names_ = [a["name"] for a in overview["annotations"]["list"]]
    assert "Cutovers" in names_ and "Rollbacks" in names_


def test_vllm_parity_table_names_real_panels():
    """grafana/README.md compares vLLM's speculative-decoding dashboard with ours, panel by panel:
    every panel of ours the table names exists, and every vLLM panel has a row."""
    text = (ROOT / "grafana/README.md").read_text()
    table = text[text.index("| vLLM panel |") :].split("\n\n")[0].splitlines()[2:]
    titles = {p.title for b in DASHBOARDS.values() for p in b().panels()}
    vllm_panels = {
        "Draft acceptance rate (stat)",
        "Acceptance length (stat)",
        "Accepted tokens / s (stat)",
        "Draft tokens / s (stat)",
        "Drafts / s (stat)",
        "Output from drafts (stat)",
        "Draft acceptance rate",
        "Mean acceptance length",
        "Acceptance rate by draft position",
        "Draft acceptance rate by engine",
        "Draft tokens / s (proposed, accepted, rejected)",
        "Inter-token latency",
    }
    seen = set()
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        seen.add(cells[0])
        for ours in re.findall(r"`([^`]+)`", cells[1]):
            assert ours in titles, (cells[0], ours)
    assert vllm_panels <= seen, vllm_panels - seen


def test_extreme_edges_are_bounds_of_the_agent_acceptance_histogram():
    # The rules select le="0.05" and le="0.99": both must be buckets the agent exports.
    from prometheus_client.utils import floatToGoString

    t = rules.Thresholds()
    bounds = {floatToGoString(b) for b in agent_metrics.ACCEPTANCE_BUCKETS}
    assert floatToGoString(t.near_zero_le) in bounds, sorted(bounds)
    assert floatToGoString(t.near_one_le) in bounds, sorted(bounds)


def test_named_engine_targets_carry_the_appliance_instance():
    from appliance.observability import scrape

    conf = yaml.safe_load(
        scrape.render(scrape.ScrapeTargets(engine=("31b=127.0.0.1:8050", "127.0.0.1:8060")))
    )
    vllm = next(j for j in conf["scrape_configs"] if j["job_name"] == names.JOB_ENGINE)
    assert vllm["static_configs"] == [
        {"targets": ["127.0.0.1:8050"], "labels": {"instance": "31b"}},
        {"targets": ["127.0.0.1:8060"]},
    ]


# --- promtool -------------------------------------------------------------------------------


def test_promtool_check_config_and_rules():
    res = _promtool("check", "config", "prometheus.yml", cwd=ROOT / "prometheus")
    assert res.returncode == 0, res.stdout + res.stderr
    rule_files = sorted(str(p) for p in (ROOT / "prometheus/rules").glob("*.yml"))
    assert len(rule_files) == 2
    res = _promtool("check", "rules", *rule_files)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 20 rules found" in res.stdout and "SUCCESS: 14 rules found" in res.stdout


def test_promtool_unit_tests_pass():
    tests = sorted(str(p) for p in (ROOT / "prometheus/tests").glob("*.test.yml"))
    assert len(tests) == 5
    res = _promtool("test", "rules", *tests)
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_cover_every_rule_and_alert_with_idle_and_reset():
    exprs, alerts, idle = "", set(), set()
    for path in (ROOT / "prometheus/tests").glob("*.test.yml"):
        doc = yaml.safe_load(path.read_text())
        for t in doc["tests"]:
            for e in t.get("promql_expr_test", []):
                exprs += e["expr"] + "\n"
                if e["exp_samples"] == []:
                    idle.add(e["expr"].split("{")[0])
            alerts |= {a["alertname"] for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    for r in rules.all_rules():
        if r.alert:
            assert r.name in alerts, f"alert {r.name} never fires in a promtool test"
        else:
            assert r.name in exprs, f"recording rule {r.name} untested"
    # Every guarded ratio is asserted empty (no NaN/Inf) in an idle period.
    for r in rules.all_rules():
        if not r.alert and "> 0)" in r.expr.text:
            assert r.name in idle, f"{r.name} has no idle-period test"
    text = (ROOT / "prometheus/tests/engine-rules.test.yml").read_text()
    assert "Counter reset" in text


def _bitten(tmp_path: Path, test_file: str, **changed: object) -> str:
    """promtool's run of ``test_file`` on alerts generated with ``changed`` thresholds: it must
    fail (the tests bite); its output."""
    root = _copy_generated(tmp_path)
    (root / "prometheus/rules/gemma4-mtp-alerts.yml").write_text(
        rules.render(rules.alert_groups(rules.Thresholds(**changed)))
    )
    res = _promtool("test", "rules", test_file, cwd=root / "prometheus/tests")
    assert res.returncode == 1, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_promtool_unit_tests_catch_a_changed_threshold(tmp_path):
    # The alert tests bite: rules generated with another floor make them fail.
    assert "Gemma4MTPAcceptanceLow" in _bitten(tmp_path, "alerts.test.yml", acceptance_min=0.1)


@pytest.mark.parametrize(
    ("changed", "alert"),
    [
        ({"state_stale_s": 600.0}, "Gemma4StateMetricsStale"),  # not yet firing at 25m
        ({"state_stale_s": 120.0}, "Gemma4StateMetricsStale"),  # firing already at 19m
        # The collector's own alerts (issue 55 §4): h1 down, h3 without the textfile.
        ({"state_collector_for": "10m"}, "Gemma4StateCollectorDown"),  # not yet at 11m
        ({"state_collector_for": "2m"}, "Gemma4StateTextfileMissing"),  # already at 4m
    ],
)
def test_promtool_state_alert_tests_catch_a_changed_threshold(tmp_path, changed, alert):
    assert alert in _bitten(tmp_path, "alerts.test.yml", **changed)


def test_promtool_extremes_tests_catch_a_changed_share_limit(tmp_path):
    # The healthy role (a quarter near 1) now fires.
    out = _bitten(tmp_path, "extremes.test.yml", near_one_share_max=0.2)
    assert "Gemma4MTPRepetitionSuspects" in out


@pytest.mark.parametrize(
    "changed",
    [
        {"rejected_share_max": 0.15},  # e1's sustained tenth of the traffic no longer fires
        {"rejected_share_max": 0.01},  # e3's steady 2% fires too
        {"rejected_for": "3m"},  # e1 fires by 12m, before its 15m
    ],
)
def test_promtool_rejection_tests_catch_a_changed_threshold(tmp_path, changed):
    assert "Gemma4RequestsRejected" in _bitten(tmp_path, "alerts.test.yml", **changed)


@pytest.mark.parametrize(
    ("changed", "at"),
    [
        ({"baseline_margin": 0.3}, "time: 45m"),  # the sustained 25-point drop no longer fires
        ({"baseline_for": "10m"}, "time: 20m"),  # it fires early, and so does the short drop
        ({"min_draft_tokens_per_s": 0.1}, 'instance="e4"'),  # the barely drafting one fires
    ],
)
def test_promtool_baseline_tests_catch_a_changed_threshold(tmp_path, changed, at):
    out = _bitten(tmp_path, "baseline.test.yml", **changed)
    assert "Gemma4AcceptanceBelowBaseline" in out and at in out


# --- metric existence -----------------------------------------------------------------------


def _known() -> set[str]:
    known = metric_check.exposition_names(CAPTURE.read_text())
    known |= metric_check.registry_names(agent_metrics.build_registry())
    known |= metric_check.registry_names(state_metrics.build_registry())
    return known


def test_every_metric_used_exists_in_vllm_or_the_agent_or_the_state_metrics():
    used = metric_check.used_metrics()
    assert "vllm:spec_decode_num_draft_tokens_total" in used
    assert "gemma4_agent_call_acceptance_bucket" in used
    assert "gemma4_appliance_image_info" in used
    assert metric_check.missing(_known()) == {}
    assert metric_check.undefined_recorded() == set()


def test_metric_check_reports_a_name_nothing_exports():
    known = _known() - {"vllm:kv_cache_usage_perc"}
    miss = metric_check.missing(known)
    assert list(miss) == ["vllm:kv_cache_usage_perc"]
    assert any("KV cache usage" in w for w in miss["vllm:kv_cache_usage_perc"])
    assert any("Gemma4KVCacheNearFull" in w for w in miss["vllm:kv_cache_usage_perc"])


def test_names_match_the_agent_contract():
    exported = metric_check.registry_names(agent_metrics.build_registry())
    for sel in (names.AGENT_ACCEPTANCE, names.AGENT_TOKENS_PER_STEP, names.AGENT_DURATION):
        assert sel.metric + "_bucket" in exported
    for sel in (names.AGENT_DRAFTED, names.AGENT_ACCEPTED, names.AGENT_CALLS, names.AGENT_ERRORS):
        assert sel.metric in exported


# --- state metrics --------------------------------------------------------------------------


def test_state_textfile_round_trips_and_is_written_atomically(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    path = tmp_path / "state" / "appliance.prom"
    states = [
        state_metrics.InstanceState(
            "31b",
            "gemma4-vllm:0.21.0-mtp",
            "0.21.0",
            True,
            {("cutover", "ok"): 2, ("rollback", "ok"): 1},
            1_790_000_000.0,
        ),
        state_metrics.InstanceState("e4b", "gemma4-vllm:pre-mtp", "0.19.0", False),
    ]
    state_metrics.write_textfile(path, states)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(path.read_text())
        for s in f.samples
    }
    assert (
        samples[
            (
                "gemma4_appliance_image_info",
                (
                    ("gpus", ""),  # the instance's device set: none given in these states
                    ("image", "gemma4-vllm:0.21.0-mtp"),
                    ("instance", "31b"),
                    ("mtp", "true"),
                    ("vllm_version", "0.21.0"),
                ),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "gemma4_appliance_image_info",
                (
                    ("gpus", ""),
                    ("image", "gemma4-vllm:pre-mtp"),
                    ("instance", "e4b"),
                    ("mtp", "false"),
                    ("vllm_version", "0.19.0"),
                ),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "gemma4_appliance_cutover_events_total",
                (("instance", "31b"), ("kind", "rollback"), ("outcome", "ok")),
            )
        ]
        == 1
    )
    assert (
        samples[("gemma4_appliance_last_cutover_timestamp_seconds", (("instance", "31b"),))]
        == 1_790_000_000.0
    )
    # Rewriting replaces the file whole and leaves no temp file for node_exporter to read.
    state_metrics.write_textfile(path, states[1:])
    assert "31b" not in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["appliance.prom"]


@pytest.mark.parametrize(
    "bad",
    [
        {"path": "x.txt", "events": {}},
        {"path": "x.prom", "events": {("cutover", "maybe"): 1}},
        {"path": "x.prom", "events": {("upgrade", "ok"): 1}},
    ],
)
def test_state_textfile_rejects_bad_input(tmp_path, bad):
    s = state_metrics.InstanceState("i", "img", "0.32.0", True, bad["events"])
    with pytest.raises(UsageError):
        state_metrics.write_textfile(tmp_path / bad["path"], [s])


# --- Grafana schema -------------------------------------------------------------------------

TS_PRELUDE = """import type { AnnotationQuery, Dashboard, DataQuery } from '@grafana/schema';
// The Prometheus plugin's own annotation fields (grafana-prometheus), not in @grafana/schema.
interface PromQuery extends DataQuery { expr: string; interval?: string }
interface PromAnnotation extends AnnotationQuery<PromQuery> {
  tagKeys?: string; textFormat?: string; titleFormat?: string; useValueForTime?: boolean;
}
"""


def _tsc(schema_dir: Path, boards: dict[str, dict], tmp_path: Path) -> subprocess.CompletedProcess:
    src = tmp_path / "src"
    src.mkdir()
    for name, board in boards.items():
        board = dict(board)
        annotations = board.pop("annotations")["list"]
        builtin = [a for a in annotations if a.get("builtIn")]
        prom = [a for a in annotations if not a.get("builtIn")]
        # Object literals with declared types: excess-property and literal-type checks apply.
        (src / f"{name}.ts").write_text(
            TS_PRELUDE
            + f"const builtin: AnnotationQuery[] = {json.dumps(builtin, indent=2)};\n"
            + f"const prom: PromAnnotation[] = {json.dumps(prom, indent=2)};\n"
            + "export const dashboard: Dashboard = {\n"
            + "  annotations: { list: [...builtin, ...prom] },\n"
            + json.dumps(board, indent=2)[1:]
            + ";\n"
        )
    (tmp_path / "tsconfig.json").write_text(
        json.dumps(
            {
                "compilerOptions": {
                    "strict": True,
                    "noEmit": True,
                    "module": "esnext",
                    "moduleResolution": "bundler",
                    "target": "es2022",
                    "skipLibCheck": True,
                    "typeRoots": [],
                    "baseUrl": ".",
                    "paths": {"*": [str(schema_dir / "node_modules" / "*")]},
                },
                "include": ["src/*.ts"],
            }
        )
    )
    return subprocess.run(
        [
            "node",
            str(schema_dir / "node_modules/typescript/bin/tsc"),
            "-p",
            str(tmp_path / "tsconfig.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )


def test_dashboards_match_grafana_schema_types(grafana_schema, tmp_path):
    boards = {
        f.removesuffix(".json").replace("-", "_"): json.loads(
            (ROOT / "grafana/dashboards" / f).read_text()
        )
        for f in DASHBOARDS
    }
    res = _tsc(grafana_schema, boards, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_schema_check_rejects_a_wrong_field_type(grafana_schema, tmp_path):
    board = json.loads((ROOT / "grafana/dashboards/gemma4-mtp-overview.json").read_text())
    board["panels"][1]["gridPos"]["h"] = "eight"
    board["refresh_rate"] = 5
    res = _tsc(grafana_schema, {"broken": board}, tmp_path)
    assert res.returncode != 0
    assert "gridPos" in res.stdout or "'string' is not assignable" in res.stdout, res.stdout


# --- provisioning and the compose stack ------------------------------------------------------


def test_grafana_provisioning_points_at_the_generated_dashboards():
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    prom = next(d for d in ds["datasources"] if d["type"] == "prometheus")
    assert prom["uid"] == "prometheus" and prom["url"].startswith("http://127.0.0.1:")
    boards = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/gemma4.yml").read_text())
    path = boards["providers"][0]["options"]["path"]
    compose = yaml.safe_load((ROOT / "deploy/observability/compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + path + ":ro") and "grafana/dashboards" in m for m in mounts), mounts


def test_compose_pins_images_and_binds_loopback():
    compose = yaml.safe_load((ROOT / "deploy/observability/compose.yaml").read_text())
    services = compose["services"]
    assert {"prometheus", "grafana", "otel-collector", "jaeger"} <= set(services)
    for name, svc in services.items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[-1]
        assert ":" in image and tag != "latest" and any(c.isdigit() for c in tag), (name, image)
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    text = (ROOT / "deploy/observability/compose.yaml").read_text()
    text += (ROOT / "deploy/observability/otel-collector.yaml").read_text()
    text += (ROOT / "deploy/observability/jaeger.yaml").read_text()
    assert "0.0.0.0" not in text


def test_grafana_admin_password_comes_from_a_file_not_a_default():
    compose = yaml.safe_load((ROOT / "deploy/observability/compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    # Grafana's admin/admin works until someone changes it: the stack never starts that way.
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["secrets"] == ["grafana_admin_password"]
    secret = compose["secrets"]["grafana_admin_password"]["file"]
    assert secret.startswith("/etc/gemma4-vllm/")
