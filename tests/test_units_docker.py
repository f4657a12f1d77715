"""The rendered serve script against the real Docker engine: labels decide the MTP flags.

``print`` runs everything ``run`` does except the final exec (label reading included), so the
docker command line it prints is the one the unit would run. The images are small labelled
imports (tests/plugins/units.py); the real engine under systemd is the nspawn tier's job.
"""

from __future__ import annotations

import http.server
import os
import shlex
import subprocess
import threading
from pathlib import Path

import pytest

from appliance import units
from appliance.engine.local import free_port

pytestmark = pytest.mark.docker

INSTANCE = f"unittest-{os.getpid()}"


@pytest.fixture
def script(tmp_path) -> Path:
    units.render_to("cpu-tiny-mtp", INSTANCE, tmp_path, units.Options(port=free_port()))
    return tmp_path / units.paths(INSTANCE).script


def serve(script: Path, tmp_path: Path, command: str, image: str, timeout: float = 60):
    env = {
        "PATH": os.environ["PATH"],
        "VLLM_IMAGE": image,
        "MODEL_DIR": str(tmp_path),
        "VLLM_CACHE_DIR": str(tmp_path / "cache"),
    }
    return subprocess.run(
        [str(script), command],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def argv(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def test_an_mtp_image_gets_the_speculative_config(script, tmp_path, serve_images):
    proc = serve(script, tmp_path, "print", serve_images["mtp-0.32"])
    args = argv(proc)
    assert args[:2] == ["docker", "run"] and "--pull" in args
    image_at = args.index(serve_images["mtp-0.32"])
    served = args[image_at + 1 :]
    assert served[0] == "/models/target"
    assert "--speculative-config" in served
    assert served[served.index("--speculative-config") + 1] == (
        '{"method":"mtp","model":"/models/drafter","num_speculative_tokens":2}'
    )
    assert served[-2:] == ["--per-request-spec-decode-metrics", "detailed"]
    assert "serving with Gemma 4 MTP speculative decoding (k=2)" in proc.stderr
    assert f"{tmp_path}:/models:ro" in args and "--gpus" not in args


def test_per_request_metrics_only_from_vllm_0_32(script, tmp_path, serve_images):
    args = argv(serve(script, tmp_path, "print", serve_images["mtp-0.21"]))
    assert "--speculative-config" in args
    assert "--per-request-spec-decode-metrics" not in args


@pytest.mark.parametrize("tag", ["pre-mtp", "nolabels"])
def test_an_image_without_the_mtp_label_is_served_without_speculative_decoding(
    script, tmp_path, serve_images, tag
):
    proc = serve(script, tmp_path, "print", serve_images[tag])
    args = argv(proc)
    assert "--speculative-config" not in args
    assert "--per-request-spec-decode-metrics" not in args
    assert args[-1] == "--enforce-eager"  # the profile's own flags are all still there
    assert "serving without speculative decoding" in proc.stderr


def test_a_missing_image_is_a_configuration_error(script, tmp_path, serve_images):
    proc = serve(script, tmp_path, "print", "gemma4-units-test:does-not-exist")
    assert proc.returncode == 78  # RestartPreventExitStatus: no restart loop
    assert "is not on this host (the unit never pulls)" in proc.stderr


@pytest.mark.parametrize("image", ["", "x;id", "a b", "$(id)"])
def test_an_invalid_image_is_a_configuration_error(script, tmp_path, image):
    proc = serve(script, tmp_path, "run", image)
    assert proc.returncode == 78 and proc.stdout == ""
    assert "VLLM_IMAGE" in proc.stderr


def test_a_bad_path_in_the_env_file_is_a_configuration_error(script, tmp_path, serve_images):
    env = {
        "PATH": os.environ["PATH"],
        "VLLM_IMAGE": serve_images["mtp-0.32"],
        "MODEL_DIR": "/tmp/a b",
        "VLLM_CACHE_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [str(script), "print"], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 78 and "MODEL_DIR=/tmp/a b" in proc.stderr


def test_remove_clears_a_leftover_container(script, tmp_path, serve_images):
    name = units.container_name(INSTANCE)
    subprocess.run(
        ["docker", "create", "--name", name, serve_images["nolabels"], "/none"],
        check=True,
        capture_output=True,
    )
    try:
        assert serve(script, tmp_path, "remove", "").returncode == 0
        gone = subprocess.run(
            ["docker", "container", "inspect", name], capture_output=True, check=False
        )
        assert gone.returncode != 0
        # Nothing to remove is fine too.
        assert serve(script, tmp_path, "remove", "").returncode == 0
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)


def test_wait_healthy_returns_once_health_answers_200(tmp_path):
    port = free_port()
    units.render_to("cpu-tiny", INSTANCE, tmp_path, units.Options(port=port))
    script = tmp_path / units.paths(INSTANCE).script
    seen: list[str] = []

    # A stand-in /health, on purpose: a real loading vLLM cannot be made to answer a given
    # sequence (503, 503, 200) on demand, and this checks the script's polling of exactly that.
    # wait-healthy against a real engine loading is covered by the nspawn unit tests
    # (test_units_systemd.py), where the installed unit starts one.
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            seen.append(self.path)
            # The first answers are "not ready yet", as a loading engine's are.
            self.send_response(200 if len(seen) > 2 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        proc = serve(script, tmp_path, "wait-healthy", "", timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr
    assert seen == ["/health"] * 3
    assert f"vLLM healthy on 127.0.0.1:{port}" in proc.stderr
