"""Fixtures for the observability tests: a real Prometheus on 127.0.0.1 and Grafana's schema types.

``prometheus_server`` starts ``/usr/bin/prometheus`` (apt; scripts/setup-system.sh installs it)
with a temp config and data dir and kills it at the end. ``grafana_schema`` installs the npm
``@grafana/schema`` types and TypeScript (pinned) into a cache dir outside the repo when absent;
the tests that need it fail, never skip, when that is impossible.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance.engine.local import free_port

from .docker_engine import machine_lock

PROMETHEUS = os.environ.get("APPLIANCE_PROMETHEUS", "/usr/bin/prometheus")
PROMTOOL = os.environ.get("APPLIANCE_PROMTOOL", "/usr/bin/promtool")
GRAFANA_SCHEMA_VERSION = "13.2.3"
TYPESCRIPT_VERSION = "5.9.3"


@dataclass
class Prometheus:
    """A running Prometheus: its URL and an instant-query helper."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Evaluate ``expr`` through the HTTP API; the result vector (or matrix) as JSON."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=10)
        body = r.json()
        assert body.get("status") == "success", (expr, body)
        return body["data"]["result"]

    def targets_up(self) -> dict[str, str]:
        """job -> health of each active target."""
        r = httpx.get(self.url + "/api/v1/targets", timeout=10).json()
        return {t["labels"]["job"]: t["health"] for t in r["data"]["activeTargets"]}


@pytest.fixture
def prometheus_server() -> Iterator[Callable[..., Prometheus]]:
    """Factory: ``start(config_yaml, {relative_path: text}, [flag, ...])`` -> a running
    :class:`Prometheus` (the flags are added to its command line)."""
    if not Path(PROMETHEUS).exists():
        pytest.fail(f"{PROMETHEUS} missing: run scripts/setup-system.sh (apt prometheus)")
    started: list[Prometheus] = []
    tmp = Path(tempfile.mkdtemp(prefix="appliance-prom-"))

    def start(
        config: str, files: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> Prometheus:
        conf_dir = tmp / f"conf{len(started)}"
        conf_dir.mkdir()
        (conf_dir / "prometheus.yml").write_text(config)
        for rel, text in (files or {}).items():
            (conf_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (conf_dir / rel).write_text(text)
        port = free_port()
        log_path = tmp / f"prometheus{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={conf_dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / f'data{len(started)}'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
        started.append(prom)
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(prom.url + "/-/ready", timeout=1).status_code == 200:
                    return prom
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    yield start
    for prom in started:
        prom.process.terminate()
        try:
            prom.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.process.kill()
            prom.process.wait(timeout=5)
    shutil.rmtree(tmp, ignore_errors=True)


def _schema_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return (
        base
        / "gemma4-appliance"
        / f"grafana-schema-{GRAFANA_SCHEMA_VERSION}-ts{TYPESCRIPT_VERSION}"
    )


def ensure_grafana_schema() -> Path:
    """A directory whose node_modules hold @grafana/schema and typescript, pinned exactly
    (installed once per machine; tests/prefetch.py may have done it already)."""
    d = _schema_dir()
    tsc = d / "node_modules" / "typescript" / "bin" / "tsc"
    types = d / "node_modules" / "@grafana" / "schema" / "package.json"
    if tsc.exists() and types.exists():
        return d
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "npm missing: the dashboard schema check needs node + npm (apt nodejs npm)"
        )
    d.mkdir(parents=True, exist_ok=True)
    with machine_lock("grafana-schema"):
        if tsc.exists() and types.exists():
            return d
        res = subprocess.run(
            [
                npm,
                "install",
                "--no-audit",
                "--no-fund",
                "--no-save",
                "--prefix",
                str(d),
                f"@grafana/schema@{GRAFANA_SCHEMA_VERSION}",
                f"typescript@{TYPESCRIPT_VERSION}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if res.returncode != 0 or not tsc.exists():
        raise RuntimeError(
            f"npm install of @grafana/schema failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
    return d


@pytest.fixture(scope="session")
def grafana_schema() -> Path:
    """A directory whose node_modules hold @grafana/schema and typescript, pinned exactly."""
    try:
        return ensure_grafana_schema()
    except RuntimeError as exc:
        pytest.fail(str(exc))
