"""``bench --concurrency``'s client against ``vllm bench serve``'s: output tok/s and TPOT per level.

Two servers, chosen with ``--server``:

- ``stand-in`` (default): a server whose pace is fixed, not vLLM. On the CPU engine the two
  tools' output tok/s per level wander with the host's load (a shared 2-core host moved one
  level's ratio from 0.5 to 2.0 between runs), which hides what the clients themselves cost.
  Every request streams ``--chunks`` chunks of 2 tokens, ``--gap-ms`` apart, then the usage
  chunk, so a level's duration has a floor (requests / N waves x chunks x gap) and anything
  above it is the client's (and the host's).
- ``engine``: the real CPU engine (cpu-tiny-mtp, copy drafter), started here. Per level the
  appliance runs just before and just after vLLM's tool, and its figure is the mean of the two
  (bracketing cancels a load that drifts steadily); the engine's busy-polling processes run at
  a lower priority meanwhile, for both tools alike. 16 requests of 160 tokens make levels of
  0.6-2.6 s: at 8 of 32 the clients' per-request constants dominate (gotchas/benchmarking-mtp.md).
  The suite checks the counts of one short level (tests/test_bench_engine.py); this prints
  the agreement.

Per level it prints both durations and the ratio of output tok/s (appliance / vLLM), with the
floor (stand-in) or the ratio of median TPOT (engine). Figures, not assertions:

    .venv/bin/python benchmarks/bench_client_vs_vllm.py --concurrency 1,4 --requests 8
    .venv/bin/python benchmarks/bench_client_vs_vllm.py --server engine --requests 16
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from appliance.bench import concurrency, prompts, runner
from appliance.engine import devmodel, local
from appliance.engine.local import OFFLINE_ENV, engine_command

MODEL = "gemma4-tiny"


def _server(chunks: int, gap_s: float) -> http.server.ThreadingHTTPServer:
    """The stand-in: /metrics with one vLLM series, and a paced SSE chat completion."""

    class Paced(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn does

        def log_message(self, *args):
            pass

        def do_GET(self):
            body = f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            token = {"choices": [{"delta": {"content": "ab"}, "finish_reason": None}]}
            usage = {"choices": [], "usage": {"completion_tokens": 2 * chunks, "prompt_tokens": 5}}
            for i in range(chunks + 2):
                if i < chunks:
                    time.sleep(gap_s)
                data = json.dumps(token if i < chunks else usage) if i <= chunks else "[DONE]"
                event = f"data: {data}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Paced)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _vllm(url: str, data: Path, n: int, out_len: int, c: int, tmp: Path) -> dict:
    """``vllm bench serve --max-concurrency c`` of the installed vLLM, its result record."""
    args = ["bench", "serve", "--backend", "openai-chat", "--base-url", url]
    args += ["--endpoint", "/v1/chat/completions", "--model", MODEL]
    args += ["--tokenizer", str(devmodel.cached().root / "target"), "--dataset-name", "custom"]
    args += ["--dataset-path", str(data), "--custom-output-len", str(out_len)]
    args += ["--skip-chat-template", "--num-prompts", str(n), "--max-concurrency", str(c)]
    args += ["--disable-shuffle", "--temperature", "0", "--num-warmups", "1", "--disable-tqdm"]
    args += ["--save-result", "--result-dir", str(tmp), "--result-filename", "vllm.json"]
    subprocess.run(
        engine_command(args),
        check=True,
        capture_output=True,
        env={**os.environ, **OFFLINE_ENV},
        cwd=tmp,
    )
    return json.loads((tmp / "vllm.json").read_text())


@contextlib.contextmanager
def _engine_yields_cpu(engine: local.LocalEngine):
    """Lower the priority of the engine's core and worker processes (every thread) meanwhile.

    On 2 cores they busy-poll while generating and can starve vLLM's API server and the clients
    for a whole request, so the stream arrives in one burst. Both tools measure the same server
    under the same priorities; the priorities are restored afterwards.
    """
    tids = []
    for pid in engine.pids() - {engine.process.pid}:  # the API server keeps its priority
        with contextlib.suppress(OSError):
            tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 15)
    try:
        yield
    finally:
        for tid in tids:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, 0)


def _stand_in(a, levels, config, data, out_len, tmp) -> None:
    srv = _server(a.chunks, a.gap_ms / 1000)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    ep = runner.Endpoint("stand-in", url, MODEL, None, "stand-in", False)
    for c in levels:
        floor = -(-a.requests // c) * a.chunks * a.gap_ms / 1000
        ours = concurrency.run_level(ep, config, c, a.requests)
        theirs = _vllm(url, data, a.requests, out_len, c, tmp)
        ratio = ours.to_dict()["output_throughput_tps"] / theirs["output_throughput"]
        print(
            f"concurrency {c}: duration appliance {ours.wall_s:.3f} s, vllm "
            f"{theirs['duration']:.3f} s, floor {floor:.3f} s; output tok/s appliance/vllm "
            f"{ratio:.2f}"
        )
    srv.shutdown()


def _engine(a, levels, config, data, out_len, tmp) -> None:
    with local.serve("cpu-tiny-mtp", timeout=900) as engine, _engine_yields_cpu(engine):
        ep = runner.open_endpoint(engine.url, "mtp")
        for c in levels:
            before = concurrency.run_level(ep, config, c, a.requests).to_dict()
            theirs = _vllm(engine.url, data, a.requests, out_len, c, tmp)
            after = concurrency.run_level(ep, config, c, a.requests).to_dict()
            ours = [lv["output_throughput_tps"] for lv in (before, after)]
            tps = (ours[0] + ours[1]) / 2 / theirs["output_throughput"]
            tpot = (before["tpot_s"]["median"] + after["tpot_s"]["median"]) / 2 * 1000
            print(
                f"concurrency {c}: output tok/s appliance/vllm {tps:.2f} (appliance before/after "
                f"{ours[0]:.1f}/{ours[1]:.1f}, vllm {theirs['output_throughput']:.1f}), median "
                f"TPOT appliance/vllm {tpot / theirs['median_tpot_ms']:.2f}, durations appliance "
                f"{before['wall_s']:.2f}/{after['wall_s']:.2f} s, vllm {theirs['duration']:.2f} s"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("stand-in", "engine"), default="stand-in")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=16, help="stand-in: chunks per answer")
    ap.add_argument("--gap-ms", type=float, default=10.0, help="stand-in: between chunks")
    ap.add_argument("--max-tokens", type=int, default=160, help="engine: tokens per answer")
    a = ap.parse_args()
    levels = concurrency.parse_levels(a.concurrency)
    out_len = 2 * a.chunks if a.server == "stand-in" else a.max_tokens
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "prose.jsonl"
        texts = [p.text for p in prompts.shipped("prose").prompts] * 4
        data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        config = runner.BenchConfig((prompts.load_file(data),), (out_len,))
        run = _stand_in if a.server == "stand-in" else _engine
        run(a, levels, config, data, out_len, tmp)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
