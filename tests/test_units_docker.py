"""The serve script against the real Docker engine: labels decide the MTP flags.

``print`` runs everything ``run`` does except the final exec (label reading included), so the
docker command line it prints is the one the unit would run. The instance is installed under a
temporary root (``APPLIANCE_ROOT`` points the script at its files); the images are small
labelled imports (tests/plugins/units.py); the real engine under systemd is the nspawn tier's job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import shlex
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from plugins import processes
from plugins.http_servers import loading_health

from appliance import profiles, units
from appliance.engine.local import free_port
from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.serve.docker import DRAIN_S

# Containers of its own only, no session engine: either stream may run it (tests/conftest.py).
pytestmark = [pytest.mark.docker, pytest.mark.own_engines]

INSTANCE = f"unittest-{os.getpid()}"


@pytest.fixture
def script(tmp_path) -> Path:
    units.install(
        "cpu-tiny-mtp",
        INSTANCE,
        root=tmp_path,
        options=units.Options(port=free_port(), model_dir=str(tmp_path)),
    )
    return Layout(tmp_path).serve_program


def serve(script: Path, tmp_path: Path, command: str, image: str, timeout: float = 60, **env):
    """The script as the unit runs it: the env file's values in its environment, ``env`` on
    top, the instance's files under ``tmp_path``."""
    values = envfile.read(Layout(tmp_path).env_file(INSTANCE)).values
    return subprocess.run(
        [str(script), INSTANCE, command],
        env={
            **values,
            "PATH": os.environ["PATH"],
            "APPLIANCE_ROOT": str(tmp_path),
            "VLLM_IMAGE": image,
            "VLLM_CACHE_DIR": str(tmp_path / "cache"),
            **env,
        },
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
    # Last, what the image's vLLM version allows: per-call figures, then the drain on stop.
    assert served[-4:] == [
        "--per-request-spec-decode-metrics",
        "detailed",
        "--shutdown-timeout",
        str(DRAIN_S),
    ]
    assert "serving with Gemma 4 MTP speculative decoding (--speculative-config " in proc.stderr
    assert f"{tmp_path}:/models:ro" in args and "--gpus" not in args
    # The key goes by name; its value is in no argument.
    key = Layout(tmp_path).api_key_file(INSTANCE).read_text().strip()
    assert args[args.index("VLLM_API_KEY") - 1] == "--env" and key not in proc.stdout


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
    # The profile's own flags are all still there, then host and port from the env file.
    host_at = args.index("--host")
    assert "--enforce-eager" in args[:host_at] and args[host_at + 1 : host_at + 3] == [
        "127.0.0.1",
        "--port",
    ]
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
    proc = serve(script, tmp_path, "print", serve_images["mtp-0.32"], MODEL_DIR="/tmp/a b")
    assert proc.returncode == 78 and "MODEL_DIR=/tmp/a b" in proc.stderr


def test_shell_in_a_profile_reaches_docker_as_one_argument_and_never_runs(tmp_path, serve_images):
    """Profile strings are data: each token the args file holds is one docker argument,
    verbatim, and nothing in it runs (the marker files are never made)."""
    marks = [tmp_path / f"pwned-{i}" for i in range(3)]
    tokens = [f"$(touch {marks[0]})", f"`touch {marks[1]}`", f"x'; touch {marks[2]}; '\\"]
    prof = dataclasses.replace(
        profiles.get("cpu-tiny-mtp"),
        served_model_name=tokens[0],
        extra_args=tuple(tokens[1:]),
        env={"EVIL": tokens[0]},
    )
    units.install(prof, INSTANCE, root=tmp_path, options=units.Options(model_dir=str(tmp_path)))
    script = Layout(tmp_path).serve_program
    args = argv(serve(script, tmp_path, "print", serve_images["mtp-0.32"]))
    assert args[args.index("--served-model-name") + 1] == tokens[0]
    assert tokens[1] in args and tokens[2] in args and f"EVIL={tokens[0]}" in args
    assert not any(m.exists() for m in marks)


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
    units.install("cpu-tiny", INSTANCE, root=tmp_path, options=units.Options(port=port))
    script = Layout(tmp_path).serve_program
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


# When the docker client the wait starts gets its SIGTERM: as its Go runtime starts (killed by
# the signal, exit -15), or while it asks the daemon to stop the container (its own handler has
# cancelled the request, exit 143). A sweep's timing decides which.
MOMENTS = {
    "as-its-runtime-starts": lambda pid: processes.catches(pid, signal.SIGTERM),
    "while-it-asks-the-daemon": lambda pid: (
        processes.catches(pid, signal.SIGTERM) and processes.holds_socket(pid)
    ),
}


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_stop_while_waiting_stops_the_container_though_its_sigterm_reaches_the_docker_client(
    tmp_path, appliance_images, moment
):
    """A stop while the unit is `activating`: systemd sends SIGTERM to the wait, then to every
    process of the unit's cgroup, reading the cgroup again until no new process shows; the
    docker client the wait starts in answer (`docker stop`) can be one of them. Seen under
    systemd in full runs and then alone: `docker stop ... failed: exit -15`, vLLM left loading,
    the unit killed at its 90 s (Result=timeout); then, alone under load, `exit 143`: the client
    signalled once it was talking to the daemon. The sweep's timing cannot be had on demand, so
    this test signals as it would: the wait once its handler is set, then the docker client the
    wait starts, at each moment (a real SIGTERM to the real client). The container must stop."""
    port = free_port()
    units.install("cpu-tiny", INSTANCE, root=tmp_path, options=units.Options(port=port))
    name = units.container_name(INSTANCE)
    # The container stands in for the loading engine: it ends a second after the SIGTERM docker
    # stop sends, so that the client is still asking the daemon when it is signalled.
    image = appliance_images["cpu-mtp"].image_id
    loading = "trap 'sleep 1; exit 0' TERM; sleep 600 & wait"
    run = ["docker", "run", "-d", "--init", "--name", name, "--entrypoint", "sh", image]
    subprocess.run([*run, "-c", loading], check=True, capture_output=True)
    values = envfile.read(Layout(tmp_path).env_file(INSTANCE)).values
    env = {**values, "PATH": os.environ["PATH"], "APPLIANCE_ROOT": str(tmp_path)}
    argv = [str(Layout(tmp_path).serve_program), INSTANCE, "wait-healthy"]
    ready = MOMENTS[moment]
    client: list[int] = []

    def client_ready() -> bool:
        if not client:
            client.extend(processes.children(wait.pid)[:1])
        return (bool(client) and ready(client[0])) or wait.poll() is not None

    with contextlib.ExitStack() as cleanup:
        cleanup.callback(subprocess.run, ["docker", "rm", "-f", name], capture_output=True)
        cleanup.enter_context(loading_health(port))
        wait = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        cleanup.callback(lambda: wait.poll() is None and wait.kill())
        handler_set = processes.until(lambda: processes.catches(wait.pid, signal.SIGTERM), 30)
        assert handler_set, f"the wait set no SIGTERM handler: {processes.signal_state(wait.pid)}"
        wait.send_signal(signal.SIGTERM)
        if not processes.until(client_ready, 30) or wait.poll() is not None:
            state = processes.signal_state(wait.pid)
            wait.kill()
            pytest.fail(f"no docker client to signal ({state}): {wait.communicate()[1]}")
        os.kill(client[0], signal.SIGTERM)
        _, err = wait.communicate(timeout=120)
        running = subprocess.run(
            ["docker", "container", "inspect", "--format", "{{.State.Running}}", name],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    assert wait.returncode == 0, err
    assert "wait-healthy: the unit is stopping (SIGTERM), no longer waiting for vLLM" in err
    assert f"container {name} stopped after" in err, err
    assert running == "false", err
