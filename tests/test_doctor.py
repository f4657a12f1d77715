"""doctor: against the real CPU engines, a dead port, a real non-vLLM server, instance files."""

from __future__ import annotations

import json
import shutil

import pytest
from plugins.cli import invoke
from plugins.http_servers import API_KEY, Route

import docker
from appliance import doctor, profiles
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.hostcheck.nvidia import gpu_findings


def _doctor(*args: str, env: dict | None = None):
    # VLLM_API_KEY from the caller's shell must not leak into a test that means "no key".
    res = invoke(
        ["instance", "doctor", "--json", *args],
        env={"VLLM_API_KEY": None, **(env or {})},
        code=None,
    )
    return res, json.loads(res.output)


def _check(body: dict, name: str) -> dict | None:
    return next((c for c in body["checks"] if c["name"] == name), None)


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


def _instance_root(tmp_path):
    env_dir = tmp_path / "etc/gemma4-vllm"
    env_dir.mkdir(parents=True)
    (env_dir / "a.env").write_text(
        '# chosen image\nVLLM_IMAGE="gemma4-vllm:0.32.0-mtp"\nAPPLIANCE_PROFILE=cpu-tiny-mtp\n'
        "VLLM_HOST=127.0.0.1\nVLLM_PORT=8000\nMODEL_DIR=/models/tiny\n"
    )
    (env_dir / "b.env").write_text("OTHER=1\n")
    # An env file too incomplete for the instance record (an older install's): a check, no crash.
    (env_dir / "p.env").write_text('VLLM_IMAGE="gemma4-vllm:0.32.0-mtp"\n')
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    (unit_dir / "gemma4-vllm@.service").write_text("[Service]\n")
    return tmp_path


def _dead_docker():
    # A real Docker client aimed at a socket nothing listens on (version pinned so that
    # constructing it does not already connect): how doctor sees a host whose daemon is down.
    return docker.DockerClient(
        base_url="unix:///nonexistent/docker.sock", version="1.43", timeout=2
    )


def test_models_check_of_an_instance_under_root(tmp_path):
    # a.env: cpu-tiny-mtp, MODEL_DIR=/models/tiny, i.e. ROOT/models/tiny under --root.
    root = _instance_root(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    check = doctor.run(dead, instance="a", root=root, docker_client=_dead_docker()).get(
        "instance.models"
    )
    assert check.status == "fail"
    assert check.summary.startswith(
        f"models not ready: target {root}/models/tiny/target: directory missing"
    )
    assert "fix: appliance dev devmodel DIR" in check.summary
    model_dir = root / "models/tiny"
    shutil.copytree(devmodel.cached("copy").root, model_dir)
    check = doctor.run(dead, instance="a", root=root, docker_client=_dead_docker()).get(
        "instance.models"
    )
    assert check.status == "ok", check
    assert check.summary.startswith(f"models ok: target {model_dir}/target (6 files")
    assert check.evidence["full_check"] == "appliance models verify a"
    (model_dir / "drafter/model.safetensors").write_bytes(b"\x08")  # truncated to 1 byte
    report = doctor.run(dead, instance="a", root=root, docker_client=_dead_docker())
    check = report.get("instance.models")
    assert check.status == "fail" and not report.ok
    assert (
        f"drafter {model_dir}/drafter: file model.safetensors is truncated (1 bytes)"
        in check.summary
    )


def test_instance_files_under_root(tmp_path):
    root = _instance_root(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    a = doctor.run(dead, instance="a", root=root, docker_client=_dead_docker())
    assert a.get("instance.unit").status == "ok"
    env = a.get("instance.env")
    assert env.status == "ok" and env.summary == "VLLM_IMAGE=gemma4-vllm:0.32.0-mtp"
    ctr = a.get("instance.container")
    assert (ctr.status, ctr.summary) == ("warn", "cannot ask Docker")
    assert (
        "nonexistent/docker.sock" in ctr.evidence["error"]
        or "No such file" in ctr.evidence["error"]
    ), ctr.evidence
    b = doctor.run(dead, instance="b", root=root, docker_client=_dead_docker())
    assert b.get("instance.env").status == "fail"
    p = doctor.run(dead, instance="p", root=root, docker_client=_dead_docker())
    env = p.get("instance.env")
    assert (env.status, env.evidence["image"]) == ("fail", "gemma4-vllm:0.32.0-mtp")
    assert env.summary.startswith("incomplete env file: APPLIANCE_PROFILE is not set in ")
    assert p.get("instance.models") is None  # no record to tell which models
    c = doctor.run(dead, instance="c", root=tmp_path / "nothing", docker_client=_dead_docker())
    assert c.get("instance.env").status == "warn" and c.get("instance.unit").status == "warn"


@pytest.mark.docker
def test_instance_without_container_fails_on_real_docker(tmp_path, docker_engine):
    root = _instance_root(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    # The env file names an image, the real daemon has no such container: a failure.
    ctr = doctor.run(dead, instance="a", root=root, docker_client=docker_engine).get(
        "instance.container"
    )
    assert (ctr.status, ctr.summary) == ("fail", "no container gemma4-vllm-a")
    # No env file and no container: the instance is simply not set up here (a warning).
    ctr = doctor.run(dead, instance="c", root=root, docker_client=docker_engine).get(
        "instance.container"
    )
    assert (ctr.status, ctr.summary) == ("warn", "no container gemma4-vllm-c")


def test_invalid_instance_name_is_a_one_line_usage_error(tmp_path, cli_run):
    for args in (["--instance", "../x"], ["--instance", "../x", "--api-key-file", "/dev/null"]):
        res = cli_run(
            [
                "instance",
                "doctor",
                "--url",
                f"http://127.0.0.1:{free_port()}",
                "--root",
                str(tmp_path),
                *args,
            ],
            code=2,
        )
        assert (
            res.output == "Error: invalid instance name '../x' (use letters, digits, '-' "
            "and '_' (at most 64), starting with a letter or digit)\n"
        )


def test_api_key_file_problems_are_usage_errors(tmp_path, cli_run):
    url = f"http://127.0.0.1:{free_port()}"
    res = cli_run(
        ["instance", "doctor", "--url", url, "--api-key-file", str(tmp_path / "missing")], code=2
    )
    assert res.output.startswith("Error: API key file ")
    assert res.output.endswith("missing does not exist\n")
    (tmp_path / "empty").write_text(" \r\n")
    res = cli_run(
        ["instance", "doctor", "--url", url, "--api-key-file", str(tmp_path / "empty")], code=2
    )
    # The one key-file rule (appliance.host.apikey): whitespace and CRLF are not a key.
    assert f"{tmp_path / 'empty'} is empty (" in res.output
    assert len(res.output.splitlines()) == 1
    (tmp_path / "k").write_text("abc\n")
    res = cli_run(
        [
            "instance",
            "doctor",
            "--url",
            url,
            "--api-key",
            "abc",
            "--api-key-file",
            str(tmp_path / "k"),
        ],
        code=2,
    )
    assert "not both" in res.output


def test_help_never_shows_the_key(cli_run):
    res = cli_run(["instance", "doctor", "--help"], env={"VLLM_API_KEY": "s3cret-value"})
    assert "VLLM_API_KEY" in res.output
    assert "s3cret-value" not in res.output


def test_unreadable_metrics_is_a_failed_check_not_an_error(routed_http_server):
    # A fake vLLM: a real vLLM always serves /metrics, but behind a proxy that forwards only
    # /health and /v1 (or a server too loaded to answer in time) /metrics fails like this.
    url = routed_http_server(
        {
            "/health": Route(200, b""),
            "/version": Route(200, b'{"version": "0.32.0"}'),
            "/v1/models": Route(200, b'{"data": [{"id": "gemma4-tiny", "max_model_len": 512}]}'),
            "/metrics": Route(503, b"upstream unavailable", "text/plain"),
            "/metrics/": Route(503, b"upstream unavailable", "text/plain"),
        }
    )
    res, body = _doctor("--url", url)
    assert res.exit_code == 1 and body["ok"] is False
    c = _check(body, "mtp.counters")
    assert c["status"] == "fail"
    ev = c["evidence"]
    assert (ev["state"], ev["stage"]) == ("unreadable", "before")
    assert f"{url}/metrics" in ev["error"] and "answered 503" in ev["error"]
    assert c["summary"] == f"cannot read /metrics: {ev['error']}"
    assert _check(body, "engine.vllm") is None
    assert _check(body, "engine.reachable")["status"] == "ok"


def test_gpu_profile_on_cpu_host_fails():
    """Doctor's GPU check is the host check's (appliance/hostcheck/nvidia.py), on this host."""
    prof = profiles.get("l4x4-31b-mtp")  # needs 4x NVIDIA L4
    gpu = doctor.run(f"http://127.0.0.1:{free_port()}", profile=prof).get("host.gpus")
    findings = gpu_findings(prof)
    assert gpu.evidence["findings"] == [f.line() for f in findings]
    blockers = [f for f in findings if f.status == "blocker"]
    if blockers:  # this machine has no GPU: nvidia-smi is missing
        assert (gpu.status, gpu.summary) == ("fail", blockers[0].message)
    else:
        assert gpu.status in ("ok", "warn")


@pytest.mark.engine
def test_mtp_active_on_copy_drafter_engine(mtp_engine):
    res, body = _doctor("--url", mtp_engine.url, "--profile", "cpu-tiny-mtp")
    assert res.exit_code == 0, res.output
    c = _check(body, "mtp.counters")
    assert c["status"] == "ok" and c["evidence"]["state"] == "active"
    assert c["evidence"]["tokens_per_step"] > 1.5
    assert c["evidence"]["draft_tokens"] >= c["evidence"]["accepted"] > 0
    assert c["evidence"]["source"] == "request" and "drafted" not in c["evidence"]
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


@pytest.mark.engine
def test_api_key_engine_needs_the_key(api_key_engine, tmp_path):
    url = api_key_engine.url
    res, body = _doctor("--url", url, "--profile", "cpu-tiny-mtp")
    assert res.exit_code == 1
    c = _check(body, "engine.vllm")
    assert c["status"] == "fail"
    assert "/v1/models answered 401: the API key is missing or wrong" in c["summary"]
    assert c["evidence"]["api_key"] == "none sent"
    assert _check(body, "engine.reachable")["status"] == "ok"  # /health needs no key

    key_file = tmp_path / "k.api-key"
    key_file.write_text(f"  {API_KEY}\r\n")  # the one rule: surrounding whitespace, CRLF
    res, body = _doctor("--url", url, "--profile", "cpu-tiny-mtp", "--api-key-file", str(key_file))
    assert res.exit_code == 0, res.output
    assert _check(body, "mtp.counters")["evidence"]["state"] == "active"
    assert API_KEY not in res.output

    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-key\n")
    res, body = _doctor("--url", url, "--api-key-file", str(wrong))
    c = _check(body, "engine.vllm")
    assert res.exit_code == 1 and "401" in c["summary"]
    assert c["evidence"]["api_key"] == f"sent (from file {wrong})"

    res, body = _doctor("--url", url, "--no-generate", env={"VLLM_API_KEY": API_KEY})
    assert res.exit_code == 0, res.output
    assert API_KEY not in res.output


@pytest.mark.engine
def test_instance_key_file_under_root_is_used(api_key_engine, tmp_path):
    from appliance.host.layout import Layout

    key = Layout(tmp_path).api_key_file("tiny")
    key.parent.mkdir(parents=True)
    key.write_text(API_KEY + "\n")
    key.chmod(0o600)
    res, body = _doctor(
        "--url", api_key_engine.url, "--instance", "tiny", "--root", str(tmp_path), "--no-generate"
    )
    assert res.exit_code == 0 and _check(body, "model.served")["status"] == "ok", res.output
    assert _check(body, "mtp.counters")["status"] == "ok"
    assert API_KEY not in res.output


@pytest.mark.parametrize(
    ("server", "label", "status", "summary"),
    [
        ("0.32.0rc1+cpu", "0.32.0", "ok", "vLLM 0.32.0rc1+cpu"),
        ("0.32.0", "0.21.0", "fail", "server says vLLM 0.32.0, image label says 0.21.0"),
        ("0.19.0", None, "fail", "vLLM 0.19.0 is older than cpu-tiny-mtp needs (0.32.0)"),
        ("dev", None, "fail", "the server's vLLM version 'dev' is unreadable"),
    ],
)
def test_the_version_check_reads_versions_one_way(server, label, status, summary):
    from appliance.doctor.engine import version_check

    c = version_check(server, profiles.get("cpu-tiny-mtp"), label)
    assert (c.status, c.summary) == (status, summary)
