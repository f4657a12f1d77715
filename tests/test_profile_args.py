"""A profile turns into the exact `vllm serve` argument list (issue: foundation)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from appliance import profiles
from appliance.errors import UsageError


def test_reference_profile_gives_the_exact_argument_list():
    args = profiles.get("l4x4-31b-mtp").serve_args()
    assert args == [
        "google/gemma-4-31B-it",
        "--served-model-name",
        "gemma-4-31b-it",
        "--host",
        "127.0.0.1",
        "--port",
        "8050",
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "4",
        "--max-model-len",
        "32768",
        "--max-num-batched-tokens",
        "4096",
        "--max-num-seqs",
        "1",
        "--gpu-memory-utilization",
        "0.92",
        "--speculative-config",
        '{"method":"mtp","model":"google/gemma-4-31B-it-assistant","num_speculative_tokens":2}',
        "--per-request-spec-decode-metrics",
        "detailed",
    ]


def test_baseline_is_the_reference_without_speculation():
    mtp = profiles.get("l4x4-31b-mtp").serve_args()
    base = profiles.get("l4x4-31b").serve_args()
    assert base == mtp[: mtp.index("--speculative-config")]
    assert profiles.get("l4x4-31b-mtp").serve_args(speculative=False) == base


def test_cpu_mtp_profile_fills_in_the_tiny_model_and_asks_for_per_request_metrics():
    args = profiles.get("cpu-tiny-mtp").serve_args(devmodel="/m", port=9000)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "model": "/m/drafter", "num_speculative_tokens": 2}
    assert args[0] == "/m/target" and args[args.index("--port") + 1] == "9000"
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    assert "--speculative-config" not in profiles.get("cpu-tiny").serve_args(devmodel="/m")


def test_the_queue_bound_comes_from_the_sequences_unless_stated():
    prof = dataclasses.replace(profiles.get("l4x4-31b-mtp"), max_num_seqs=None)
    # No max_num_seqs: vLLM picks one by the device it finds, so no bound is derived.
    assert prof.max_num_seqs is None and prof.queue_bound is None and prof.queue_args() == []
    seqs = dataclasses.replace(prof, max_num_seqs=48)
    assert seqs.queue_bound == profiles.QUEUE_PER_SEQUENCE * 48 == 96
    assert seqs.queue_args() == ["--max-num-queued-reqs", "96"]
    stated = dataclasses.replace(seqs, max_num_queued_reqs=200)
    assert stated.queue_args() == ["--max-num-queued-reqs", "200"]
    # Apart from the serve arguments, as the MTP flags: an older vLLM refuses the flag.
    assert "--max-num-queued-reqs" not in stated.serve_args()


def test_profiles_show_prints_the_bound_with_the_command(cli_run):
    res = cli_run(["profiles", "show", "rtx5090x2-31b-fp8-mtp", "--json"])
    assert json.loads(res.stdout)["argv"][-2:] == ["--max-num-queued-reqs", "2"]


def test_a_queue_bound_below_one_is_refused_naming_the_field():
    with pytest.raises(UsageError) as err:
        profiles.from_dict(
            {"name": "x", "description": "d", "model": "m", "served_model_name": "s"}
            | {"max_num_queued_reqs": 0},
            "x.toml",
        )
    assert str(err.value).startswith("x.toml: max_num_queued_reqs = 0: ")


def test_cpu_profile_without_model_dir_is_a_usage_error():
    with pytest.raises(UsageError, match="tiny dev model"):
        profiles.get("cpu-tiny-mtp").serve_args()


def test_unknown_field_in_a_profile_file_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        'name = "x"\ndescription = "d"\nmodel = "m"\nserved_model_name = "s"\n'
        "max_num_batched_token = 4096\n"
    )
    with pytest.raises(UsageError, match="unknown field.*max_num_batched_token"):
        profiles.load_file(path)


def test_every_shipped_profile_file_loads():
    names = profiles.all_profiles()
    assert {"cpu-tiny-mtp", "cpu-tiny", "l4x4-31b-mtp", "l4x4-31b"} <= set(names)
    for prof in names.values():
        assert prof.serve_args(devmodel="/m")[0]


# --- the engine container's privileges and media fetching (least privilege) -------------------


def _container_args(name: str) -> tuple[list[str], list[str]]:
    """(serve records, docker records) of the args file ``appliance install`` writes."""
    from appliance.units import engine_args

    args = engine_args.serve_args(profiles.get(name), [])
    return list(args.serve), list(args.docker)


def _opt(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@pytest.mark.parametrize("name", sorted(profiles.all_profiles()))
def test_every_profile_runs_its_container_without_privileges(name):
    prof = profiles.get(name)
    serve, docker = _container_args(name)
    assert _opt(docker, "--cap-drop") == ["ALL"]
    assert "--cap-add" not in docker and "--privileged" not in docker
    assert _opt(docker, "--security-opt") == ["no-new-privileges"]
    assert "--init" in docker
    assert int(_opt(docker, "--pids-limit")[0]) > 0
    assert "--ulimit" not in docker  # see CONTAINER_LIMITS: above dockerd's limit, no start
    # Shared memory: a private /dev/shm, except the GPU tensor-parallel profiles (NCCL).
    tp_gpu = prof.hardware.device == "cuda" and prof.tensor_parallel_size > 1
    assert _opt(docker, "--ipc") == (["host"] if tp_gpu else [])
    assert len(_opt(docker, "--shm-size")) == (0 if tp_gpu else 1)
    # No media URL is fetched: one allowed domain that never resolves, and no redirects.
    (domains,) = _opt(serve, "--allowed-media-domains")
    assert domains.endswith(".invalid") and "," not in domains
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS=0" in _opt(docker, "--env")


class _CountingServer:
    """A loopback-only HTTP service that counts the requests it gets (a PNG for any GET)."""

    PNG = bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6300010000050001"
        "0d0a2db40000000049454e44ae426082"
    )

    def __enter__(self):
        import http.server
        import threading

        outer = self
        self.requests: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(outer.PNG)))
                self.end_headers()
                self.wfile.write(outer.PNG)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/secret.png"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_vllm_refuses_to_fetch_media_from_loopback_with_the_profiles_arguments():
    """vLLM's own media fetcher (the real 0.32 code in .venv), configured from the args file's
    --allowed-media-domains, refuses a URL on a loopback service, which sees no request. The
    tiny CPU model is text-only, so the engine refuses any image before fetching it: this is
    where the flag's effect can be seen (the systemd tier checks the flag reaches the engine)."""
    from vllm.multimodal.media.connector import MediaConnector

    serve, _docker = _container_args("cpu-tiny-mtp")
    (domains,) = _opt(serve, "--allowed-media-domains")
    with _CountingServer() as srv:
        # Without the restriction vLLM fetches it: the test can fail.
        image = MediaConnector().fetch_image(srv.url)
        assert image.size == (1, 1) and srv.requests == ["/secret.png"]
        srv.requests.clear()
        guarded = MediaConnector(allowed_media_domains=domains.split(","))
        with pytest.raises(ValueError, match="allowed domains"):
            guarded.fetch_image(srv.url)
        with pytest.raises(ValueError, match="allowed domains"):
            guarded.fetch_image(srv.url.replace("127.0.0.1", "localhost"))
        assert srv.requests == []
