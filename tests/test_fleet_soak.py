"""The canary's soak and the fleet's Prometheus targets, through their library and CLI (fast).

The /metrics pages are vLLM 0.32's exposition format (the series and labels it writes); the
integration with real hosts and a real engine is tests/test_fleet.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from appliance.errors import UsageError
from appliance.fleet import hosts, soak

MODEL = 'model_name="gemma4-tiny"'
CHAT = "/v1/chat/completions"
CAPTURE = Path(__file__).parent / "data" / "metrics-vllm-0.32-mtp.txt"


def page(
    drafts: float | None,
    draft_tokens: float = 0,
    accepted: float = 0,
    ok: float = 0,
    errors: float = 0,
    created: float = 1700000000.0,
) -> str:
    """A vLLM /metrics page: running gauge, spec-decode counters (unless ``drafts`` is None),
    and the API's answer counts by status class."""
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0",{MODEL}}} 0.0',
        "# TYPE http_requests_total counter",
        f'http_requests_total{{handler="{CHAT}",method="POST",status="2xx"}} {ok}',
        f'http_requests_total{{handler="{CHAT}",method="POST",status="5xx"}} {errors}',
        # Not an API answer: never counted.
        'http_requests_total{handler="/metrics",method="GET",status="2xx"} 99.0',
    ]
    if drafts is not None:
        lines += [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f'vllm:spec_decode_num_drafts_total{{engine="0",{MODEL}}} {drafts}',
            "# TYPE vllm:spec_decode_num_drafts_created gauge",
            f'vllm:spec_decode_num_drafts_created{{engine="0",{MODEL}}} {created}',
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",{MODEL}}} {draft_tokens}',
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",{MODEL}}} {accepted}',
        ]
    return "\n".join(lines) + "\n"


def test_parse_counts_api_answers_and_spec_counters():
    r = soak.parse(page(drafts=10, draft_tokens=20, accepted=18, ok=7, errors=1))
    assert (r.requests, r.errors) == (8, 1)
    assert (r.counters.drafts, r.counters.draft_tokens, r.counters.accepted) == (10, 20, 18)
    assert soak.parse(page(drafts=None, ok=3)).counters is None


def test_parse_reads_a_real_vllm_page():
    r = soak.parse(CAPTURE.read_text())
    assert (r.requests, r.errors) == (2, 0)  # /v1/chat/completions and /v1/models, 2xx
    assert r.counters.drafts == 21


def test_parse_rejects_a_page_that_is_not_vllms():
    with pytest.raises(Exception, match="no vLLM series"):
        soak.parse("# TYPE foo counter\nfoo_total 1\n")


def test_window_since_start_and_between_readings():
    before = soak.parse(page(drafts=10, draft_tokens=20, accepted=18, ok=5), at=100)
    w = soak.window(None, before)
    assert (w.spec.drafts, w.spec.accepted, w.requests) == (10, 18, 5)
    assert w.spec.acceptance == pytest.approx(0.9)
    assert w.spec.tokens_per_step == pytest.approx(2.8)
    after = soak.parse(page(drafts=30, draft_tokens=60, accepted=38, ok=9, errors=1), at=130)
    w2 = soak.window(before, after)
    assert (w2.spec.drafts, w2.spec.draft_tokens, w2.spec.accepted) == (20, 40, 20)
    assert (w2.requests, w2.errors, w2.seconds) == (5, 1, 30)
    assert w2.error_rate == pytest.approx(0.2)


def test_window_across_a_restart_is_reset():
    before = soak.parse(page(drafts=30, draft_tokens=60, accepted=50, ok=9))
    after = soak.parse(page(drafts=5, draft_tokens=10, accepted=9, ok=2, created=1800000000.0))
    w = soak.window(before, after)
    assert w.spec.status == "reset" and w.requests is None
    v = soak.compare(soak.window(None, before), w)
    assert not v.ok and "restarted during the soak" in v.regressions[0]


def _verdict(before_page: str, start_page: str, end_page: str, **t) -> soak.Verdict:
    before = soak.window(None, soak.parse(before_page))
    win = soak.window(soak.parse(start_page), soak.parse(end_page))
    return soak.compare(before, win, soak.Thresholds(**t))


def test_same_figures_pass():
    v = _verdict(
        page(100, 200, 180, ok=50),
        page(0, 0, 0, ok=0, created=2e9),
        page(50, 100, 88, ok=20, created=2e9),
    )
    assert v.ok, v.regressions


def test_acceptance_drop_fails():
    v = _verdict(
        page(100, 200, 180, ok=50),
        page(0, 0, 0, created=2e9),
        page(50, 100, 40, ok=20, created=2e9),
    )
    assert not v.ok
    assert "draft acceptance fell 90% -> 40% (drop 50%, tolerance 10%)" in v.regressions
    assert "tokens per step fell 2.80 -> 1.80 (by 36%, tolerance 10%)" in v.regressions


def test_a_small_drop_within_the_thresholds_passes():
    v = _verdict(
        page(100, 200, 180, ok=50),
        page(0, 0, 0, created=2e9),
        page(100, 200, 170, ok=20, created=2e9),
    )
    assert v.ok, v.regressions


def test_mtp_lost_fails_and_mtp_gained_is_a_note():
    lost = _verdict(page(100, 200, 180, ok=50), page(None, ok=0), page(None, ok=10))
    assert not lost.ok and "MTP is off after the cutover" in lost.regressions[0]
    gained = _verdict(
        page(None, ok=50), page(0, 0, 0, created=2e9), page(50, 100, 95, ok=10, created=2e9)
    )
    assert gained.ok, gained.regressions
    assert "no pre-cutover MTP figures to compare (MTP was off)" in gained.notes[0]


def test_error_rate_rise_fails():
    v = _verdict(
        page(100, 200, 180, ok=100, errors=0),
        page(0, 0, 0, created=2e9),
        page(50, 100, 90, ok=18, errors=2, created=2e9),
    )
    assert not v.ok
    assert any("error rate rose 0.000 -> 0.100" in r for r in v.regressions)


def test_no_traffic_is_not_a_pass():
    v = _verdict(page(100, 200, 180, ok=50), page(0, created=2e9), page(0, created=2e9))
    assert not v.ok
    assert any("too little traffic" in r for r in v.regressions)
    assert any("too little MTP traffic" in r for r in v.regressions)


def test_thresholds_are_checked():
    with pytest.raises(UsageError, match="max-acceptance-drop"):
        soak.Thresholds(max_acceptance_drop=2)


def test_reading_round_trips_and_bad_files_are_usage_errors(tmp_path):
    r = soak.parse(page(10, 20, 18, ok=4), at=5.0)
    assert soak.loads(soak.dumps(r)) == r
    assert soak.loads(soak.dumps(soak.parse(page(None, ok=1)))).counters is None
    with pytest.raises(UsageError, match="not a soak reading"):
        soak.loads('{"schema": 1}')
    with pytest.raises(UsageError, match="not JSON"):
        soak.loads("nope")


def _inventory(**hostvars) -> dict:
    return {
        "_meta": {"hostvars": hostvars},
        "all": {"children": ["ungrouped", "gemma4"]},
        "gemma4": {"children": ["gpu"], "hosts": ["box-a"]},
        "gpu": {"hosts": ["box-b"]},
    }


def test_targets_from_an_inventory_label_each_host():
    inv = _inventory(
        **{
            "box-a": {"ansible_host": "10.0.0.1", "appliance_instance": "31b",
                      "appliance_port": 8050, "appliance_profile": "l4x4-31b-mtp"},
            "box-b": {"ansible_host": "10.0.0.2", "appliance_instance": "31b",
                      "appliance_port": "8050", "appliance_scrape_address": "box-b.lan"},
        }
    )  # fmt: skip
    groups = hosts.targets_from_inventory(inv)
    assert groups == [
        {
            "targets": ["10.0.0.1:8050"],
            "labels": {"host": "box-a", "instance": "31b", "profile": "l4x4-31b-mtp"},
        },
        {"targets": ["box-b.lan:8050"], "labels": {"host": "box-b", "instance": "31b"}},
    ]


def test_targets_errors_name_the_host():
    with pytest.raises(UsageError, match="no _meta"):
        hosts.targets_from_inventory({"gemma4": {}})
    with pytest.raises(UsageError, match="host box-a: no appliance_port"):
        hosts.targets_from_inventory(_inventory(**{"box-a": {"appliance_instance": "a"}}))
    with pytest.raises(UsageError, match="no hosts in group 'other'"):
        hosts.targets_from_inventory(_inventory(), group="other")


def test_targets_cli_writes_a_file_promtool_accepts(tmp_path, cli_run):
    inv = _inventory(
        **{
            "box-a": {"appliance_instance": "31b", "appliance_port": 8050},
            "box-b": {"appliance_instance": "31b", "appliance_port": 8050},
        }
    )
    (tmp_path / "inv.json").write_text(json.dumps(inv))
    conf = tmp_path / "prom"
    (conf / "targets").mkdir(parents=True)
    out = conf / "targets" / "engines.json"
    cli_run(["fleet", "targets", str(tmp_path / "inv.json"), "--out", str(out)])
    assert [g["labels"]["host"] for g in json.loads(out.read_text())] == ["box-a", "box-b"]
    # The generated prometheus.yml's engine job reads targets/engines.json next to it.
    repo = Path(__file__).resolve().parents[1]
    (conf / "prometheus.yml").write_text((repo / "prometheus/prometheus.yml").read_text())
    subprocess.run(["cp", "-r", str(repo / "prometheus/rules"), str(conf)], check=True)
    ok = subprocess.run(
        ["promtool", "check", "config", str(conf / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # `check config` does not read file_sd files (a broken one passes it too): the discovery
    # itself shows what Prometheus makes of them, relabeling included.
    sd = subprocess.run(
        [
            "promtool",
            "check",
            "service-discovery",
            "--timeout=3s",
            str(conf / "prometheus.yml"),
            "vllm",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=conf,
    )
    assert sd.returncode == 0, sd.stderr
    # Sorted: promtool lists the discovered targets in no fixed order.
    found = sorted((t["labels"] for t in json.loads(sd.stdout)), key=lambda t: t["__address__"])
    assert [(t["__address__"], t["host"], t["instance"]) for t in found] == [
        ("box-a:8050", "box-a", "31b"),
        ("box-b:8050", "box-b", "31b"),
    ]
    # Same instance name on both hosts: only `host` keeps their series apart.
    series = [{k: v for k, v in t.items() if not k.startswith("__")} for t in found]
    assert series[0] != series[1]
    assert {**series[0], "host": ""} == {**series[1], "host": ""}


ANSIBLE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "ansible"


def _playbook(tmp_path: Path, playbook: str | Path, *args: str) -> subprocess.CompletedProcess:
    """The real ansible-playbook on the example inventory, its state under ``tmp_path``:
    a shipped playbook by name, or any playbook file by path."""
    import os
    import sys

    if not isinstance(playbook, Path):
        playbook = ANSIBLE_DIR / "playbooks" / f"{playbook}.yml"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
        ANSIBLE_HOME=str(tmp_path),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
    )
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            str(ANSIBLE_DIR / "inventory.example.yml"),
            *args,
            str(playbook),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ANSIBLE_DIR,
        check=False,
    )


PLAYBOOKS = sorted(p.stem for p in (ANSIBLE_DIR / "playbooks").glob("*.yml"))


def test_every_playbook_is_checked():
    assert {"install", "rollout", "rollback", "multinode-cutover"} <= set(PLAYBOOKS)


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbooks_pass_ansible_syntax_check(playbook, tmp_path):
    """The real ansible-playbook parses every shipped playbook and the role it includes (the
    group's play names its hosts: multinode_hosts has no default)."""
    proc = _playbook(tmp_path, playbook, "--syntax-check", "-e", "multinode_hosts=gemma4")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("shipped", "broken", "says"),
    [
        ("  tasks:\n", "  taks:\n", "'taks' is not a valid attribute for a Play"),
        ("tasks_from: rollback.yml", "tasks_from: rollbak.yml", "rollbak.yml"),
    ],
)
def test_the_syntax_check_rejects_a_broken_playbook(tmp_path, shipped, broken, says):
    """The check above can fail: a copy of a shipped playbook with one slip is refused."""
    text = (ANSIBLE_DIR / "playbooks" / "rollback.yml").read_text()
    assert text.count(shipped) == 1
    copy = tmp_path / "rollback.yml"
    copy.write_text(text.replace(shipped, broken))
    proc = _playbook(tmp_path, copy, "--syntax-check")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert says in proc.stdout + proc.stderr


def test_the_targets_playbook_says_it_moved_and_writes_nothing(tmp_path):
    """prometheus-targets.yml wrote ansible_host:port targets, down unless the engines listen on
    the network (gotchas/fleet-monitoring.md): kept one release to say where monitoring went."""
    engines = tmp_path / "engines.json"
    proc = _playbook(tmp_path, "prometheus-targets", "-e", f"targets_file={engines}")
    assert proc.returncode != 0
    assert "playbooks/prometheus-targets.yml moved" in proc.stdout
    assert "playbooks/monitoring.yml" in proc.stdout
    assert not engines.exists()


def test_the_monitoring_playbook_refuses_without_a_remote_write_url(tmp_path):
    """The check runs before anything is installed; the example inventory's hosts are never
    reached (the assert needs no connection)."""
    proc = _playbook(tmp_path, "monitoring", "--limit", "l4-01", "-e", "ansible_connection=local")
    assert proc.returncode != 0
    assert "set monitoring_remote_write_url" in proc.stdout


def test_scrape_config_is_an_agent_config_promtool_accepts(tmp_path, cli_run):
    """The host's agent: its loopback jobs (the engines' file_sd that `appliance install`
    keeps, node_exporter's state on --state-port), every series labelled host, remote_write."""
    out = tmp_path / "prometheus.yml"
    url = "http://10.0.0.5:9090/api/v1/write"
    argv = ["fleet", "scrape-config", "--host", "l4-01", "--remote-write", url,
            "--state-port", "9200", "--out", str(out)]  # fmt: skip
    assert cli_run(argv).output == f"wrote {out}\n"
    assert cli_run(argv).output == f"unchanged {out}\n"
    ok = subprocess.run(
        ["promtool", "check", "config", "--agent", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = out.read_text()
    assert '  external_labels:\n    host: "l4-01"\n' in text
    assert '"/etc/gemma4-vllm/prometheus/engines.json"' in text
    assert '"127.0.0.1:9200"' in text
    assert 'remote_write:\n  - url: "http://10.0.0.5:9090/api/v1/write"\n' in text
    assert "rule_files" not in text  # agent mode evaluates no rules: the central server does
    # Every scrape target is on loopback: the agent never needs an engine on the network.
    jobs = yaml.safe_load(text)["scrape_configs"]
    statics = [t for j in jobs for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert statics == ["127.0.0.1:9464", "127.0.0.1:9200"]


def test_scrape_config_json_says_whether_the_config_changed(tmp_path, cli_run):
    """The fleet role's `changed` (ecosystem review E15): install's shape, not a grep of
    `wrote `; the mode is compared too (a config left 0644 is rewritten 0600)."""
    out = tmp_path / "prometheus.yml"
    argv = ["fleet", "scrape-config", "--host", "l4-01", "--remote-write",
            "http://10.0.0.5:9090/api/v1/write", "--out", str(out), "--json"]  # fmt: skip
    first = json.loads(cli_run(argv).stdout)
    assert first == {"written": [str(out)], "unchanged": [], "changed": True}
    again = json.loads(cli_run(argv).stdout)
    assert again == {"written": [], "unchanged": [str(out)], "changed": False}
    out.chmod(0o644)
    assert json.loads(cli_run(argv).stdout)["changed"] is True
    assert out.stat().st_mode & 0o777 == 0o600
    res = cli_run(argv[:-3] + ["--json"], code=2)  # stdout would be the config itself
    assert res.stderr == "Error: --json goes with --out (add --out FILE)\n"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--remote-write", "10.0.0.5:9090"], "is not http(s)://HOST:PORT/PATH"),
        (["--remote-write", "http://x/api/v1/write", "--scrape-interval", "15"], "duration"),
        (["--remote-write", "http://x/api/v1/write", "--host", " "], "host label is empty"),
    ],
)
def test_scrape_config_refuses_what_the_agent_would_not_start_with(tmp_path, args, says, cli_run):
    out = tmp_path / "prometheus.yml"
    argv = ["fleet", "scrape-config", "--host", "l4-01", *args, "--out", str(out)]
    r = cli_run(argv, code=None)
    assert r.exit_code != 0
    assert says in r.output
    assert not out.exists()


def test_the_agent_unit_is_hardened(tmp_path):
    """The role's unit template, rendered as the role does, verified and scored by the real
    systemd-analyze (the agent needs no root: an unprivileged dynamic user)."""
    import jinja2

    template = ANSIBLE_DIR / "roles/gemma4_appliance/templates/gemma4-prometheus-agent.service.j2"
    unit = tmp_path / "gemma4-prometheus-agent.service"
    # Ansible's template module: trim_blocks on.
    unit.write_text(
        jinja2.Template(template.read_text(), keep_trailing_newline=True, trim_blocks=True).render(
            monitoring_agent_bin="/usr/bin/prometheus",
            monitoring_agent_flag="--enable-feature=agent",
            monitoring_agent_port=9095,
            monitoring_credentials=[{"name": "remote-write-password"}],
        )
    )
    # The config (0600) and the credentials reach the dynamic user through LoadCredential=.
    text = unit.read_text()
    assert "  --config.file=%d/prometheus.yml \\\n" in text
    assert (
        "LoadCredential=prometheus.yml:/etc/gemma4-prometheus-agent/prometheus.yml\n"
        "LoadCredential=remote-write-password:/etc/gemma4-prometheus-agent/remote-write-password\n"
    ) in text
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0, verify.stderr
    sec = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout)
    assert score, sec.stdout[-2000:] + sec.stderr
    assert float(score.group(1)) <= 2.5, sec.stdout


def test_state_targets_take_the_state_port_and_refuse_a_bad_one():
    inv = _inventory(
        **{
            "box-a": {"appliance_instance": "31b", "appliance_port": 8050,
                      "appliance_state_port": 9200},
            "box-b": {"appliance_instance": "31b", "appliance_port": 8050,
                      "appliance_state_port": "nine"},
        }
    )  # fmt: skip
    with pytest.raises(UsageError, match="host box-b: appliance_state_port is not a number"):
        hosts.state_targets_from_inventory(inv)
    inv["_meta"]["hostvars"]["box-b"]["appliance_state_port"] = 70000
    with pytest.raises(UsageError, match="host box-b: appliance_state_port 70000 is not a TCP"):
        hosts.state_targets_from_inventory(inv)
    del inv["_meta"]["hostvars"]["box-b"]["appliance_state_port"]
    assert hosts.state_targets_from_inventory(inv) == [
        {"targets": ["box-a:9200"], "labels": {"host": "box-a"}},
        {"targets": ["box-b:9100"], "labels": {"host": "box-b"}},
    ]
