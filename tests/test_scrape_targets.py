"""The engines Prometheus scrapes come from the installed instances ("the reference host
is watched"): `appliance install` and `uninstall` keep a file_sd targets file, and the shipped
prometheus.yml reads it. Real promtool and a real Prometheus."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from pathlib import Path

import httpx
from plugins.cli import invoke
from test_observability import _promtool

from appliance import units
from appliance.observability import file_sd, generate

REFERENCE_PORT = 8050  # l4x4-31b-mtp, the reference 4xL4 host


def _cli(*args: str) -> None:
    invoke(list(args))


def _config_dir(tmp_path: Path, host_root: Path) -> Path:
    """The shipped prometheus.yml next to the host's targets directory, as compose mounts it."""
    conf = tmp_path / "prometheus"
    conf.mkdir()
    (conf / "prometheus.yml").write_text(generate.outputs()["prometheus/prometheus.yml"])
    (conf / "targets").symlink_to(host_root / file_sd.TARGETS_DIR.lstrip("/"))
    return conf


def test_install_lists_every_instance_on_its_own_port_and_promtool_accepts_it(tmp_path):
    host = tmp_path / "host"
    _cli("instance", "install", "-p", "l4x4-31b-mtp", "31b", "--root", str(host))
    _cli("instance", "install", "-p", "cpu-tiny-mtp", "tiny", "--port", "8123", "--root", str(host))
    groups = json.loads(units.writer.scrape_targets_file(host).read_text())
    assert groups == [
        {
            "targets": [f"127.0.0.1:{REFERENCE_PORT}"],
            "labels": {"instance": "31b", "profile": "l4x4-31b-mtp"},
        },
        {"targets": ["127.0.0.1:8123"], "labels": {"instance": "tiny", "profile": "cpu-tiny-mtp"}},
    ]
    res = _promtool("check", "config", "prometheus.yml", cwd=_config_dir(tmp_path, host))
    assert res.returncode == 0 and "WARNING" not in res.stdout + res.stderr, res.stdout + res.stderr
    # Re-install changes nothing; the last uninstall removes the file.
    assert not units.install(None, "tiny", root=host).changed
    _cli("instance", "uninstall", "tiny", "--root", str(host))
    assert [
        g["labels"]["instance"]
        for g in json.loads(units.writer.scrape_targets_file(host).read_text())
    ] == ["31b"]
    _cli("instance", "uninstall", "31b", "--root", str(host))
    assert not units.writer.scrape_targets_file(host).exists()


def test_an_unreadable_instance_is_left_out_with_a_warning(tmp_path):
    units.install("cpu-tiny-mtp", "good", root=tmp_path)
    env = tmp_path / "etc/gemma4-vllm/bad.env"
    env.write_text("VLLM_IMAGE=a\n# note \\\nVLLM_IMAGE=b\n")  # ambiguous: refused by the parser
    result = units.install("cpu-tiny-mtp", "good", root=tmp_path)
    assert [w.split(":")[0] for w in result.warnings] == [
        "instance bad left out of the scrape targets"
    ]
    groups = json.loads(units.writer.scrape_targets_file(tmp_path).read_text())
    assert [g["labels"]["instance"] for g in groups] == ["good"]


class _Exporter(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"# TYPE stand_in gauge\nstand_in 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_prometheus_scrapes_the_port_install_wrote(tmp_path, prometheus_server):
    # No 31B engine on this machine: a stand-in exporter answers on the port the reference
    # profile's instance was installed on, so "up" proves Prometheus scraped the address install
    # wrote, through the shipped config. A free port, given to install: the reference profile's
    # own 8050 may be another program's on this machine (seen in a full run).
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host = tmp_path / "host"
        _cli(
            "instance",
            "install",
            "-p",
            "l4x4-31b-mtp",
            "31b",
            "--port",
            str(port),
            "--root",
            str(host),
        )
        targets = units.writer.scrape_targets_file(host).read_text()
        config = generate.outputs()["prometheus/prometheus.yml"].replace(
            "scrape_interval: 15s", "scrape_interval: 1s"
        )
        prom = prometheus_server(config, {file_sd.CONFIG_RELATIVE: targets})
        deadline = time.monotonic() + 30
        seen: list[dict] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                seen = httpx.get(prom.url + "/api/v1/targets", timeout=5).json()["data"][
                    "activeTargets"
                ]
                if any(t["labels"]["job"] == "vllm" and t["health"] == "up" for t in seen):
                    break
            time.sleep(0.5)
        engines = [t for t in seen if t["labels"]["job"] == "vllm"]
        assert [(t["scrapeUrl"], t["labels"]["instance"], t["health"]) for t in engines] == [
            (f"http://127.0.0.1:{port}/metrics", "31b", "up")
        ], engines
        assert prom.query('up{job="vllm",instance="31b",profile="l4x4-31b-mtp"}')
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
