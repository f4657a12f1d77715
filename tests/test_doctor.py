"""doctor: against the real CPU engines, a dead port, a real non-vLLM server, instance files."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from click.testing import CliRunner

from appliance import doctor
from appliance.cli import cli
from appliance.engine.local import free_port


@pytest.fixture()
def plain_http_server():
    """A real HTTP server that is not vLLM (Python's http.server on 127.0.0.1)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep the CLI's captured output clean
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _doctor(*args: str):
    res = CliRunner().invoke(cli, ["doctor", "--json", *args])
    return res, json.loads(res.output)


def _check(body: dict, name: str) -> dict:
    return next(c for c in body["checks"] if c["name"] == name)


def test_nothing_listening_fails_with_reason():
    res, body = _doctor("--url", f"http://127.0.0.1:{free_port()}")
    assert res.exit_code == 1 and body["ok"] is False
    c = _check(body, "engine.reachable")
    assert c["status"] == "fail" and "cannot reach" in c["summary"]


def test_non_vllm_server_fails_with_reason(plain_http_server):
    res, body = _doctor("--url", plain_http_server)
    assert res.exit_code == 1
    c = _check(body, "engine.reachable")
    assert c["status"] == "fail"
    assert "answered 404" in c["summary"] and "not a vLLM server" in c["summary"]
    assert c["evidence"]["status"] == 404


def test_instance_files_under_root(tmp_path):
    env_dir = tmp_path / "etc/gemma4-vllm"
    env_dir.mkdir(parents=True)
    (env_dir / "a.env").write_text('# chosen image\nVLLM_IMAGE="gemma4-vllm:0.32.0-mtp"\n')
    (env_dir / "b.env").write_text("OTHER=1\n")
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    (unit_dir / "gemma4-vllm@.service").write_text("[Service]\n")
    dead = f"http://127.0.0.1:{free_port()}"
    a = doctor.run(dead, instance="a", root=tmp_path)
    assert a.get("instance.unit").status == "ok"
    env = a.get("instance.env")
    assert env.status == "ok" and env.summary == "VLLM_IMAGE=gemma4-vllm:0.32.0-mtp"
    # No container of that name: either Docker says so (fail: the env names an image) or
    # Docker is not reachable here (warn, with the error as evidence).
    ctr = a.get("instance.container")
    assert (ctr.status, ctr.summary) == ("fail", "no container gemma4-vllm-a") or \
        (ctr.status == "warn" and ctr.evidence["error"])
    b = doctor.run(dead, instance="b", root=tmp_path)
    assert b.get("instance.env").status == "fail"
    c = doctor.run(dead, instance="c", root=tmp_path / "nothing")
    assert c.get("instance.env").status == "warn" and c.get("instance.unit").status == "warn"


def test_gpu_profile_on_cpu_host_fails():
    r = doctor.run(f"http://127.0.0.1:{free_port()}", profile=__import__(
        "appliance.profiles", fromlist=["get"]).get("l4x4-31b-mtp"))
    gpu = r.get("host.gpus")
    if doctor.visible_gpus() is None:
        assert gpu.status == "fail" and "none visible" in gpu.summary
    else:
        assert gpu.status in ("ok", "warn", "fail") and gpu.evidence["visible"]


@pytest.mark.engine
def test_mtp_active_on_copy_drafter_engine(mtp_engine):
    res, body = _doctor("--url", mtp_engine.url, "--profile", "cpu-tiny-mtp")
    assert res.exit_code == 0, res.output
    c = _check(body, "mtp.counters")
    assert c["status"] == "ok" and c["evidence"]["state"] == "active"
    assert c["evidence"]["tokens_per_step"] > 1.5
    assert _check(body, "mtp.per_request_metrics")["status"] == "ok"
    assert _check(body, "vllm.version")["evidence"]["server"] == "0.32.0"
    assert _check(body, "model.served")["status"] == "ok"


@pytest.mark.engine
def test_mtp_absent_on_baseline(baseline_engine):
    res, body = _doctor("--url", baseline_engine.url, "--profile", "cpu-tiny")
    assert res.exit_code == 0, res.output
    c = _check(body, "mtp.counters")
    assert c["evidence"]["state"] == "absent" and c["status"] == "ok"
    # Pointed at the baseline while expecting MTP: a failure that names the reason.
    res, body = _doctor("--url", baseline_engine.url, "--profile", "cpu-tiny-mtp")
    assert res.exit_code == 1
    c = _check(body, "mtp.counters")
    assert c["status"] == "fail" and "MTP absent" in c["summary"]
    # Without a profile absence is only a warning.
    res, body = _doctor("--url", baseline_engine.url)
    assert res.exit_code == 0 and _check(body, "mtp.counters")["status"] == "warn"


@pytest.mark.engine
def test_counters_only_engine_has_no_per_request_metrics(mtp_counters_engine):
    r = doctor.run(mtp_counters_engine.url, profile=None)
    assert r.get("mtp.counters").evidence["state"] == "active"
    pr = r.get("mtp.per_request_metrics")
    assert pr.status == "ok" and "not available" in pr.summary
