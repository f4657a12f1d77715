"""From a bare host to a monitored, gated service with the appliance alone.

One machine booted with real systemd (tests/plugins/nspawn.py) that has Debian's packages and
nothing of the appliance: the operator's path of the README's "On a GPU host" section, with the
CPU profile in place of the GPU one, every command run INSIDE the machine as root, with `--root`
left at `/`:

1. the wheel (built from this checkout, tests/test_artifact.py) installed with Debian's
   `python3 -m venv` and its pip, the command linked to /usr/local/bin;
2. `appliance host check` for the GPU profile names what this host lacks (the NVIDIA driver);
3. `appliance install` of the CPU profile (which runs the host check) and the exact `next:`
   line it prints, `systemctl daemon-reload && systemctl enable --now ...`;
4. a generation through the instance's own port, with its key;
5. Debian's node_exporter with the state file linked into its own textfile directory (the
   README's way, which keeps Debian's directory), and a real Prometheus (on the host,
   as a central server would be) scraping the engine through the file_sd list `install` keeps
   and the state metrics the timer's service writes;
6. `appliance cutover` to another tag of the MTP image, the state metrics showing it;
7. `appliance uninstall --purge`, after which the machine's /etc, /usr/local and /var/lib hold
   exactly what they held before `appliance install`.

What stands in for something real, and why: no package index is reachable from these machines,
so pip installs the wheel with `--no-index --no-deps`, and the declared dependencies are copied
from the suite's environment (same Debian, same Python 3.11; tests/test_packaging.py proves that
set is the whole of what the package imports) into a folder bound in outside /tmp: wherever the
suite's venv lies, the units (PrivateTmp=yes) see them as they would see a host's own venv.
Docker is the host's engine, bound in (nspawn.py). The cutover runs without the output canary:
its gate is tested on the shared instance (tests/test_cutover_systemd.py) and costs a canary run
on a second engine here.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from plugins import nspawn
from plugins.systemd_instance import MTP_IMAGE, START_TIMEOUT
from test_artifact import build_wheel
from test_packaging import dependency_links

from appliance import units
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.host.layout import Layout
from appliance.observability import scrape
from appliance.observability.names import DEBIAN_TEXTFILE_DIR

pytestmark = [pytest.mark.systemd, pytest.mark.docker, pytest.mark.engine]

VLLM_CACHE = nspawn.vllm_cache_dir("barehost")
NAME = "bare"
PROFILE = "cpu-tiny-mtp"
GPU_PROFILE = "l4x4-31b-mtp"
VENV = "/opt/gemma4-appliance"
ARTIFACT = "/srv/artifact"
# Outside /tmp: the state service runs with PrivateTmp=.
DEPENDENCIES = "/srv/dependencies"
TEXTFILE_DIR = "/var/lib/gemma4-appliance/metrics"
NODE_EXPORTER = "prometheus-node-exporter.service"


@dataclass
class BareHost:
    machine: nspawn.Machine
    port: int  # the instance's
    node_exporter: int
    model_dir: Path

    def appliance(self, *args: str, timeout: float = 900):
        """``appliance ARGS`` inside the machine, as root, as an operator types it."""
        return self.machine.run("appliance", *args, check=False, timeout=timeout)

    def sh(self, line: str, timeout: float = 900):
        return self.machine.run("sh", "-c", line, check=False, timeout=timeout)


@pytest.fixture(scope="module")
def bare_host(appliance_images, tmp_path_factory) -> Iterator[BareHost]:
    """The machine, with the artifact and its dependencies in reach and nothing installed."""
    assert MTP_IMAGE in appliance_images["cpu-mtp"].tags
    tmp = tmp_path_factory.mktemp("bare-host")
    wheel = build_wheel(tmp)
    dependencies = dependency_links(tmp / "site", copy=True)
    model_dir = devmodel.cached("copy").root
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    binds = [
        (str(wheel.parent), ARTIFACT),
        (str(dependencies), DEPENDENCIES),
        (str(model_dir), str(model_dir)),
        (str(VLLM_CACHE), str(VLLM_CACHE)),
    ]
    host = BareHost(None, free_port(), free_port(), model_dir)  # type: ignore[arg-type]
    with nspawn.boot("gemma4-barehost", binds=binds, unmask=[NODE_EXPORTER]) as m:
        host.machine = m
        # What an operator does once (README, Monitoring): the state file linked into
        # node_exporter's textfile directory, which keeps Debian's default; node_exporter on
        # loopback. The link waits for the file the state timer writes.
        m.run("ln", "-s", f"{TEXTFILE_DIR}/gemma4_appliance.prom", f"{DEBIAN_TEXTFILE_DIR}/")
        m.write(
            "/etc/default/prometheus-node-exporter",
            f'ARGS="--web.listen-address=127.0.0.1:{host.node_exporter}"\n',
        )
        m.systemctl("restart", NODE_EXPORTER)
        m.run("python3", "-m", "venv", VENV)
        m.run(
            f"{VENV}/bin/pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            f"{ARTIFACT}/{wheel.name}",
        )
        purelib = m.run(
            f"{VENV}/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        ).stdout.strip()
        m.write(f"{purelib}/dependencies.pth", f"{DEPENDENCIES}\n")
        m.run("ln", "-s", f"{VENV}/bin/appliance", "/usr/local/bin/appliance")
        try:
            yield host
        finally:
            m.systemctl("stop", units.unit_name(NAME), check=False, timeout=180)
            # The container runs on the host's engine: none may outlive the machine.
            subprocess.run(
                ["docker", "rm", "--force", units.container_name(NAME)],
                capture_output=True,
                check=False,
            )


def _chat(host: BareHost, key: str) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{host.port}/v1/chat/completions",
        json={
            "model": "gemma4-tiny",
            "messages": [{"role": "user", "content": "a bare host"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _sel(metric: str, **labels: str) -> str:
    """A PromQL selector of ``metric`` for this instance and ``labels``."""
    pairs = {"instance": NAME, **labels}
    return metric + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in pairs.items()) + "}"


def _until(what: str, probe, timeout: float = 120.0):
    """Poll ``probe`` until it returns something truthy (Prometheus scrapes every second)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}")
        time.sleep(1)


def test_a_bare_host_becomes_a_monitored_gated_service_and_is_left_as_found(
    bare_host: BareHost, prometheus_server
):
    host, m = bare_host, bare_host.machine
    assert host.appliance("--version").returncode == 0  # the wheel's command, on PATH

    # What this host lacks for the GPU profile, read-only: the driver, named with its fix.
    check = host.appliance("host", "check", "--profile", GPU_PROFILE, "--json")
    assert check.returncode == 1, check.stdout + check.stderr
    found = {f["name"]: f for f in json.loads(check.stdout)["findings"]}
    assert found["nvidia.driver"]["status"] == "blocker"
    assert "nvidia-smi not found" in found["nvidia.driver"]["message"]
    assert found["systemd"]["status"] == "ok" and found["user"]["status"] == "ok"
    before = m.files()

    # Install (the host check runs first, here for the CPU profile) and the line it prints.
    install = host.appliance(
        "instance", "install", NAME, "--profile", PROFILE, "--image", MTP_IMAGE,
        "--port", str(host.port), "--model-dir", str(host.model_dir),
        "--vllm-cache-dir", str(VLLM_CACHE),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    [nxt] = [ln for ln in install.stdout.splitlines() if ln.startswith("next: ")]
    line = nxt.removeprefix("next: ")
    assert line == (
        f"systemctl daemon-reload && systemctl enable --now {units.unit_name(NAME)} "
        f"{units.STATE_UNIT}.timer"
    )
    enabled = host.sh(line, timeout=START_TIMEOUT)
    assert enabled.returncode == 0, enabled.stdout + enabled.stderr
    m.wait_active(units.unit_name(NAME), timeout=START_TIMEOUT)

    key = Layout(m.root).api_key_file(NAME).read_text().strip()
    resp = _chat(host, key)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8

    # The state metrics: what the timer runs, twice now rather than waiting for its minutes. The
    # second run replaces the file the first wrote, as every tick after the first does: the
    # unit's seccomp filter refused the chown the writer made to keep that file's owner, so
    # every tick but the first failed (seen only when the timer had fired before this start).
    assert m.systemctl("is-enabled", f"{units.STATE_UNIT}.timer").stdout.strip() == "enabled"
    for tick in ("first", "second"):
        state = m.systemctl("start", f"{units.STATE_UNIT}.service", check=False, timeout=120)
        assert state.returncode == 0, (tick, m.journal(f"{units.STATE_UNIT}.service"))
    targets = scrape.ScrapeTargets(
        engine_files=(str(m.root / "etc/gemma4-vllm/prometheus/engines.json"),),
        agent=(),
        state=(f"127.0.0.1:{host.node_exporter}",),
        alertmanagers=(),
        scrape_interval="1s",
        rule_files=(),
    )
    prom = prometheus_server(scrape.render(targets))
    active = _sel("gemma4_appliance_unit_state", state="active") + " == 1"
    _until("the unit active in Prometheus", lambda: prom.query(active))
    image = _sel("gemma4_appliance_image_info")
    [info] = _until("the image", lambda: prom.query(image))
    assert info["metric"]["image"] == MTP_IMAGE, info
    # The engine, found through the file_sd list install keeps, labelled with the instance.
    drafts = _sel("vllm:spec_decode_num_draft_tokens_total") + " > 0"
    _until("the engine's MTP counters", lambda: prom.query(drafts))

    # A cutover, gated, as an operator runs it; Prometheus sees it. To the same engine by its ID
    # (what a rollback writes once the tag it recorded has moved): VLLM_IMAGE=sha256:...
    image_id = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", MTP_IMAGE],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    cut = host.appliance("cutover", NAME, image_id, "--no-canary", timeout=START_TIMEOUT)
    assert cut.returncode == 0, cut.stdout + cut.stderr
    events = _sel("gemma4_appliance_cutover_events_total", kind="cutover", outcome="ok")
    _until("the cutover", lambda: prom.query(events + " == 1"))
    now = _sel("gemma4_appliance_image_info", image=image_id)
    _until("the new image", lambda: prom.query(now))
    assert _chat(host, key).status_code == 200
    assert specdecode.parse(httpx.get(f"http://127.0.0.1:{host.port}/metrics").text).speculative

    # Uninstall --purge: the engine gone, the timer off, the trees as before install.
    gone = host.appliance("instance", "uninstall", NAME, "--purge")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert m.is_active(units.unit_name(NAME)) in ("inactive", "unknown")
    assert m.is_active(f"{units.STATE_UNIT}.timer") == "inactive"
    ps = host.sh(
        f"docker ps -a --filter name=^{units.container_name(NAME)}$ --format '{{{{.ID}}}}'"
    )
    assert ps.stdout.strip() == "", ps.stdout
    left, lost = m.compare(before)
    assert (left, lost) == ([], []), f"left behind: {left}; removed: {lost}"
