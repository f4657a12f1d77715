"""Alerts reach somebody, and Grafana can read its password: the plane's wiring, with the real
binaries (Debian's Prometheus, Alertmanager and amtool; setpriv for the uids).

No engine: the alert is Gemma4InstanceFailed, from the state metrics of a failed unit, which the
appliance's own registry serves (as node_exporter's textfile collector would serve the file).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import start_http_server

from appliance.engine.local import free_port
from appliance.observability import generate, scrape, state_metrics

ROOT = Path(__file__).resolve().parents[1]
ALERTMANAGER = os.environ.get("APPLIANCE_ALERTMANAGER", "/usr/bin/prometheus-alertmanager")
AMTOOL = os.environ.get("APPLIANCE_AMTOOL", "/usr/bin/amtool")
SHIPPED = ROOT / "prometheus" / "alertmanager.yml"
COMPOSE = ROOT / "deploy" / "observability" / "compose.yaml"
GOTCHA = ROOT / "gotchas" / "grafana-admin-password.md"


def _require(path: str) -> None:
    if not Path(path).exists():
        pytest.fail(f"{path} missing: run scripts/setup-system.sh (apt prometheus-alertmanager)")


def test_the_shipped_alertmanager_config_is_valid_and_prometheus_sends_to_it():
    _require(AMTOOL)
    res = subprocess.run(
        [AMTOOL, "check-config", str(SHIPPED)], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    prom = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    [am] = prom["alerting"]["alertmanagers"]
    assert am["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]
    service = yaml.safe_load(COMPOSE.read_text())["services"]["alertmanager"]
    assert "--web.listen-address=127.0.0.1:9093" in service["command"]
    # Unset, Alertmanager gossips on every interface, port 9094.
    assert "--cluster.listen-address=" in service["command"]
    assert (
        "../../prometheus/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro"
        in (service["volumes"])
    )


class _Receiver(http.server.BaseHTTPRequestHandler):
    """Alertmanager's webhook payloads, kept in ``server.payloads``."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.payloads.append((self.path, json.loads(body)))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args) -> None:
        pass


@contextlib.contextmanager
def _receiver() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    server.payloads = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _alertmanager(config: dict, workdir: Path) -> Iterator[str]:
    _require(ALERTMANAGER)
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = workdir / "alertmanager.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                ALERTMANAGER,
                f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: _ready(url), 30, lambda: log_path.read_text()[-2000:], proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200
    return False


def _poll(cond, timeout: float, why, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"exited: {why()}")
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {why()}")
        time.sleep(0.2)


def test_a_failed_unit_pages_the_operator_through_the_shipped_route(prometheus_server, tmp_path):
    """The whole path an alert takes: the state metrics of a failed unit, scraped by the shipped
    scrape config, Gemma4InstanceFailed from the shipped rules, Prometheus' `alerting:` section,
    Alertmanager with the shipped routes, the receiver."""
    # The shipped file, but the receiver is this test's own webhook, and the 30 s group_wait
    # (which only batches the first notification) would only make the test wait.
    config = yaml.safe_load(SHIPPED.read_text())
    config["route"]["group_wait"] = "1s"
    state = state_metrics.InstanceState(
        "31b",
        "gemma4-vllm:0.32.0-mtp",
        "0.32.0",
        True,
        unit=state_metrics.UnitStatus("failed", "failed", "start-limit-hit", 3),
    )
    state_port = free_port()
    state_srv, _ = start_http_server(
        state_port, addr="127.0.0.1", registry=state_metrics.build_registry([state])
    )
    try:
        with _receiver() as hook:
            [receiver] = config["receivers"]
            [webhook] = receiver["webhook_configs"]
            webhook["url"] = f"http://127.0.0.1:{hook.server_port}/gemma4-alerts"
            with _alertmanager(config, tmp_path) as am:
                prom_config = scrape.render(
                    scrape.ScrapeTargets(
                        engine_files=(),
                        agent=(),
                        state=(f"127.0.0.1:{state_port}",),
                        alertmanagers=(am,),
                        scrape_interval="1s",
                        evaluation_interval="1s",
                    )
                )
                rules = {
                    p.removeprefix("prometheus/"): t
                    for p, t in generate.outputs().items()
                    if p.startswith("prometheus/rules/")
                }
                prom = prometheus_server(prom_config, rules)
                _poll(lambda: hook.payloads, 90, lambda: prom.log_path.read_text()[-2000:])
    finally:
        state_srv.shutdown()
    path, payload = hook.payloads[0]
    assert path == "/gemma4-alerts"
    assert payload["receiver"] == "operator" and payload["status"] == "firing", payload
    [alert] = payload["alerts"]
    labels = alert["labels"]
    assert (labels["alertname"], labels["instance"], labels["severity"]) == (
        "Gemma4InstanceFailed",
        "31b",
        "critical",
    ), labels
    assert labels["result"] == "start-limit-hit"
    assert alert["annotations"]["summary"] == "Instance 31b failed (start-limit-hit)"
    assert "appliance rollback 31b" in alert["annotations"]["description"]


def _install_line() -> list[str]:
    """The `install` command the gotcha tells the operator to run, as words."""
    [line] = [ln for ln in GOTCHA.read_text().splitlines() if ln.startswith("install ")]
    return line.split()


def _reads(uid: int, gid: int, path: Path) -> bool:
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) missing"
    argv = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "cat", str(path)]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def test_grafana_reads_its_password_file_made_as_the_gotcha_says():
    """Grafana's image runs as uid 472 in group 0 and a Compose file secret keeps the host
    file's owner and mode: the file the gotcha makes must be readable by 472:0 and by no other
    unprivileged user. The gotcha used to say 0600, which Grafana cannot read (checked too)."""
    if os.geteuid() != 0:
        pytest.fail("needs root: it creates root-owned files and reads them as other uids")
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    assert grafana["user"] == "472:0"
    uid, gid = (int(x) for x in grafana["user"].split(":"))
    # Under /tmp, not pytest's 0700 tmp_path: uid 472 must be able to reach the file.
    where = Path(tempfile.mkdtemp(prefix="appliance-grafana-"))
    try:
        where.chmod(0o755)
        words = _install_line()
        assert words[-1] == "/etc/gemma4-vllm/grafana-admin-password", words
        path = where / "grafana-admin-password"
        subprocess.run([*words[:-1], str(path)], check=True)
        path.write_text("s3cret\n")
        assert _reads(uid, gid, path), "Grafana (472:0) cannot read the password file"
        assert path.stat().st_mode & 0o777 == 0o440, oct(path.stat().st_mode)
        assert not _reads(65534, 65534, path), "nobody can read the password file"
        assert not _reads(uid, 472, path), "uid 472 outside group 0 can read it"
        path.chmod(0o600)  # the old advice
        assert not _reads(uid, gid, path)
    finally:
        shutil.rmtree(where, ignore_errors=True)
