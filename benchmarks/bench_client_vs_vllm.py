"""``bench --concurrency``'s client against ``vllm bench serve``'s, on a server whose pace is fixed.

On the CPU engine the two tools' output tok/s per level wander with the host's load (a shared
2-core host moved one level's ratio from 0.5 to 2.0 between runs), which hides what the clients
themselves cost. Here the server is a stand-in, not vLLM: every request streams ``--chunks``
chunks of 2 tokens, ``--gap-ms`` apart, then the usage chunk, so a level's duration has a floor
(requests / N waves x chunks x gap) and anything above it is the client's (and the host's).
Per level it prints both durations, the floor, and the ratio of output tok/s (appliance / vLLM),
the figure the engine test prints against the real engine. Figures, not assertions:

    .venv/bin/python benchmarks/bench_client_vs_vllm.py --concurrency 1,4 --requests 8
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from appliance import devmodel
from appliance.bench import concurrency, prompts, runner
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    a = ap.parse_args()
    levels = concurrency.parse_levels(a.concurrency)
    srv = _server(a.chunks, a.gap_ms / 1000)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    out_len = 2 * a.chunks
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "prose.jsonl"
        texts = [p.text for p in prompts.shipped("prose").prompts]
        data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        config = runner.BenchConfig((prompts.load_file(data),), (out_len,))
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
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
