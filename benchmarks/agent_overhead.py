"""What the telemetry agent adds to a call, against the bare OpenAI client on the same engine.

For each attribution path (per-request metrics on; off, so ``/metrics`` counters) it sends the
same plain chat call, interleaved in rotating order, through:

- the bare client;
- the agent: the proxy (``instrument(client)``) and the zero-code instrumentor (the SDK's class
  patched), each beside the other;
- the seed's method: a full ``/metrics`` scrape and parse before and after the bare call.

A block of pairs then sends the Anthropic SDK's ``messages.create`` (vLLM's ``/v1/messages``,
which carries no per-request block: always the counters path, on either engine) bare and
through ``AnthropicInstrumentor``, alternating: the counters path's caller-visible cost.

and prints, side by side, the bare median and, for the other two, the median and p99 of the
time added to the bare call of the same round, the ``/metrics`` reads per call (all of them, and
those on the caller's own thread) and the share of calls with exact figures. Interleaving puts
other calls between two agent calls, which is foreign traffic to the agent's proof, so a second
block sends agent calls back to back (against bare calls back to back): the cost and exactness
of sequential calls. A third block takes the engine out of the difference: each call's
client-side time (its wall time less its time on the wire, timed in the OpenAI client's
transport), agent less bare, per round, printed beside the same difference between two bare
calls of the round (the floor: what the measurement reads when there is nothing to find) and
the time spent inside the agent's own steps on the caller's thread (its direct cost).
Figures, not assertions:

    .venv/bin/python benchmarks/agent_overhead.py --calls 200
    .venv/bin/python benchmarks/agent_overhead.py --counters-url http://127.0.0.1:8000  # reuse
    .venv/bin/python benchmarks/agent_overhead.py --cpu-only --stand-in   # no engine, seconds

The CPU block (issue 56's goals: caller-thread CPU under 0.2 ms a call on both paths, the
counters path's background CPU under 0.4 ms, every figure exact) times each agent call's CPU on
the caller's thread (``time.thread_time`` around the call, less the same around the SDK's own
``create`` beneath the agent) and the CPU of the agent's own thread over the block, per call.
Agent calls go back to back with ``--gap-ms`` of sleep between (the engine's time, so the
caller's thread is cold as under a real engine), then with a bare call between each; first a
floor row, the same measure around a pass-through in the agent's place (what the caller's
figure reads when there is nothing to find: a thread just back from its sleep pays for its own
timing), and above the table the host's speed (``host_speed.py``): cold figures move with the
host. It runs on the engines above, or with ``--stand-in`` on an in-process server that
answers as vLLM 0.32 does (a chat completion with the per-request block, or without it and
``/metrics/`` counters that move by exactly each call's figures): the caller's and the agent's
threads do what they do against an engine, the server's CPU is on threads of its own, outside
both figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import http.server
import json
import statistics
import threading
import time
import urllib.parse
from pathlib import Path

import anthropic
import host_speed  # beside this script: run as a file, its folder is on the path
import httpx
import openai
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from appliance import agent, profiles
from appliance.agent import calls, patch, responses
from appliance.agent import metrics as agent_metrics
from appliance.agent.instrumentor import AnthropicInstrumentor, OpenAIInstrumentor
from appliance.agent.server import server_for
from appliance.engine import local
from appliance.engine_api import specdecode


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class WireClock(httpx.HTTPTransport):
    """The OpenAI client's transport, timing the wire: the request sent and the response read
    (the engine's work included). A call's client-side time is its wall time less this: what
    the client, and the agent around it, spend of the caller's time, without the engine's
    jitter, which in an end-to-end difference is larger than the agent's cost."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        t0 = time.perf_counter()
        response = super().handle_request(request)
        self.seconds += time.perf_counter() - t0
        response.stream = _TimedStream(response.stream, self)
        return response


class _TimedStream(httpx.SyncByteStream):
    """A response body whose reads count as time on the wire of ``clock``."""

    def __init__(self, inner: httpx.SyncByteStream, clock: WireClock) -> None:
        self.inner, self.clock = inner, clock

    def __iter__(self):
        it = iter(self.inner)
        while True:
            t = time.perf_counter()
            chunk = next(it, None)
            self.clock.seconds += time.perf_counter() - t
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        self.inner.close()


# The agent's steps on the caller's thread, as the package defines them (before any Bench wraps).
_AGENT_STEPS = {name: getattr(calls.Call, name) for name in ("start", "on_response", "finish")}


class Bench:
    """The three ways of calling one engine, with the agent's reads counted."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.kw = {
            "model": "gemma4-tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        self.wire = {"bare": WireClock(), "agent": WireClock(), "zero": WireClock()}
        self.bare = openai.OpenAI(
            base_url=url + "/v1",
            api_key="unused",
            http_client=httpx.Client(transport=self.wire["bare"]),
        )
        self.records: list[agent.CallRecord] = []
        self.traced = agent.instrument(
            openai.OpenAI(
                base_url=url + "/v1",
                api_key="unused",
                http_client=httpx.Client(transport=self.wire["agent"]),
            ),
            role="bench",
            config=agent.AgentConfig(),
            tracer_provider=TracerProvider(),
            registry=CollectorRegistry(),
            on_call=self.records.append,
        )
        # Zero-code: the SDK's classes patched by the instrumentor (the same settings); the bare
        # and seed calls then reach the unpatched method (wrapt's __wrapped__).
        self.plain = openai.OpenAI(
            base_url=url + "/v1",
            api_key="unused",
            http_client=httpx.Client(transport=self.wire["zero"]),
        )
        if OpenAIInstrumentor().is_instrumented_by_opentelemetry:
            OpenAIInstrumentor().uninstrument()  # an earlier Bench's settings
        OpenAIInstrumentor().instrument(
            role="bench",
            config=agent.AgentConfig(),
            tracer_provider=TracerProvider(),
            registry=CollectorRegistry(),
            on_call=self.records.append,
        )
        # The Anthropic SDK, bare (the patched class's __wrapped__) and through the instrumentor.
        self.mkw = {
            "model": "gemma4-tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "extra_body": {"temperature": 0},  # the SDK 2.x names none: vLLM reads the extras
        }
        self.anth = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        self.anth_records: list[agent.CallRecord] = []
        # The same traced call with its /metrics read switched off: what the read itself costs.
        # Its own server state (another spelling of the host): its calls, which read nothing,
        # must not count as this process's calls in the counters path's window.
        self.no_read = calls.Settings.for_base(
            url,
            agent.AgentConfig(attribution="off", metrics_url=url.replace("127.0.0.1", "localhost")),
            TracerProvider(),
            agent_metrics.for_registry(CollectorRegistry()),
            "bench",
            None,
        )
        if AnthropicInstrumentor().is_instrumented_by_opentelemetry:
            AnthropicInstrumentor().uninstrument()
        AnthropicInstrumentor().instrument(
            role="bench",
            config=agent.AgentConfig(),
            tracer_provider=TracerProvider(),
            registry=CollectorRegistry(),
            on_call=self.anth_records.append,
        )
        self.http = httpx.Client(timeout=5.0)
        self.url = url
        server = server_for(url + specdecode.SNAPSHOT_PATH)
        self.reads = 0
        self.caller_reads = 0  # reads on the caller's own thread (on its path)
        real_read = server.read
        caller = threading.current_thread()

        def counted(*args, **kwargs):
            self.reads += 1
            self.caller_reads += threading.current_thread() is caller
            return real_read(*args, **kwargs)

        server.read = counted  # counts the agent's /metrics reads; the reads stay real
        # The agent's own steps on the caller's thread (start, reading the response, finish),
        # timed around the real methods: its direct cost, without the OpenAI client's.
        self.inside: list[float] = []
        self.inside_no_read: list[float] = []
        self._inside_call = 0.0
        for name, method in _AGENT_STEPS.items():  # from the originals: one wrapper per Bench
            setattr(calls.Call, name, self._timing(method, caller))

    def _timing(self, method, caller: threading.Thread):
        def timed(call, *args, **kwargs):
            if threading.current_thread() is not caller:
                return method(call, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return method(call, *args, **kwargs)
            finally:
                self._inside_call += time.perf_counter() - t0

        return timed

    def _bare_create(self) -> None:
        res = self.bare.chat.completions
        create = type(res).create
        getattr(create, "__wrapped__", create)(res, **self.kw)

    def call_bare(self) -> None:
        self._bare_create()

    def call_zero(self) -> None:
        self.plain.chat.completions.create(**self.kw)

    def call_agent(self) -> None:
        self._inside_call = 0.0
        self.traced.chat.completions.create(**self.kw)
        self.inside.append(self._inside_call)

    def call_anthropic_bare(self) -> None:
        res = self.anth.messages
        create = type(res).create
        getattr(create, "__wrapped__", create)(res, **self.mkw)

    def call_anthropic_no_read(self) -> None:
        res = self.anth.messages
        create = type(res).create
        bound = getattr(create, "__wrapped__", create).__get__(res)
        self._inside_call = 0.0
        patch.call(self.no_read, responses.MESSAGES, bound, (), self.mkw, anthropic.Stream)
        self.inside_no_read.append(self._inside_call)

    def call_anthropic(self) -> None:
        self._inside_call = 0.0
        self.anth.messages.create(**self.mkw)
        self.inside.append(self._inside_call)

    def call_seed(self) -> None:
        # The seed's agent: two full scrapes of /metrics, each parsed, around the bare call.
        specdecode.parse(self.http.get(self.url + "/metrics").text)
        self._bare_create()
        specdecode.parse(self.http.get(self.url + "/metrics").text)

    def timed(self, fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def client_side(self, who: str, fn) -> float:
        """``fn``'s wall time less its time on the wire (see :class:`WireClock`)."""
        before = self.wire[who].seconds
        took = self.timed(fn)
        return took - (self.wire[who].seconds - before)


def client_side(b: Bench, calls: int) -> dict:
    """Bare and agent calls alternating; per round, the agent's client-side time less the bare
    call's: the time the agent adds on the caller's thread. ``floor``: the same difference
    between two bare calls of the round (one more bare call each round): what this
    measurement reads when there is nothing to find, the host's own noise."""
    for _ in range(3):
        b.call_bare()
        b.call_agent()
    agent.flush(30)
    b.records.clear()
    b.inside.clear()
    added, floor = [], []
    for i in range(calls):
        # (name, whose wire clock, call): the second bare call is timed on the bare clock.
        round_ = [
            ("bare", "bare", b.call_bare),
            ("agent", "agent", b.call_agent),
            ("bare2", "bare", b.call_bare),
        ]
        order = round_[i % 3 :] + round_[: i % 3]
        took = {name: b.client_side(clock, fn) for name, clock, fn in order}
        added.append(took["agent"] - took["bare"])
        floor.append(took["bare2"] - took["bare"])
    return {
        "added": added,
        "floor": floor,
        "inside": list(b.inside),
        "exact": _exact_share(b.records),
    }


def _exact_share(records: list[agent.CallRecord]) -> float:
    agent.flush(30)
    return sum(r.figures.exact for r in records) / max(1, len(records))


def interleaved(b: Bench, calls: int) -> dict:
    for _ in range(3):  # warm the connection pools and the agent's learned state
        for fn in (b.call_bare, b.call_agent, b.call_zero, b.call_seed):
            fn()
    agent.flush(30)
    b.records.clear()
    b.reads = b.caller_reads = 0
    order = [
        ("bare", b.call_bare),
        ("agent", b.call_agent),
        ("zero", b.call_zero),
        ("seed", b.call_seed),
    ]
    bare, added = [], {"agent": [], "zero": [], "seed": []}
    for i in range(calls):
        took = {name: b.timed(fn) for name, fn in order[i % 3 :] + order[: i % 3]}
        bare.append(took["bare"])
        for name, values in added.items():
            values.append(took[name] - took["bare"])

    return {  # two agent calls a round (proxy and zero-code) share the server's reads
        "bare": bare,
        "added": added,
        "reads": b.reads / calls / 2,
        "caller_reads": b.caller_reads / calls / 2,
        "exact": _exact_share(b.records),
    }


def back_to_back(b: Bench, calls: int) -> dict:
    """Agent calls in a row against bare calls in a row (blocks of 10, alternating)."""
    agent.flush(30)
    b.records.clear()
    b.reads = b.caller_reads = 0
    bare, ours = [], []
    for _ in range(max(1, calls // 10)):
        bare += [b.timed(b.call_bare) for _ in range(10)]
        ours += [b.timed(b.call_agent) for _ in range(10)]
    n = len(ours)
    diffs = [o - statistics.median(bare) for o in ours]
    return {
        "bare": bare,
        "added": diffs,
        "reads": b.reads / n,
        "caller_reads": b.caller_reads / n,
        "exact": _exact_share(b.records),
    }


def anthropic_rounds(b: Bench, calls: int) -> dict:
    """Bare and instrumented ``messages.create``, and the instrumented call with its read off,
    in rotating order: the counters path's caller-visible time, agent less the bare call of the
    same round, beside the same without the ``/metrics`` read (the read's share)."""
    for _ in range(3):
        b.call_anthropic_bare()
        b.call_anthropic()
        b.call_anthropic_no_read()
    agent.flush(30)
    b.anth_records.clear()
    b.inside.clear()
    b.inside_no_read.clear()
    b.reads = b.caller_reads = 0
    order = [
        ("bare", b.call_anthropic_bare),
        ("agent", b.call_anthropic),
        ("no read", b.call_anthropic_no_read),
    ]
    bare, added, no_read = [], [], []
    for i in range(calls):
        took = {name: b.timed(fn) for name, fn in order[i % 3 :] + order[: i % 3]}
        bare.append(took["bare"])
        added.append(took["agent"] - took["bare"])
        no_read.append(took["no read"] - took["bare"])
    return {
        "bare": bare,
        "added": added,
        "no_read": no_read,
        "inside": list(b.inside),
        "inside_no_read": list(b.inside_no_read),
        "reads": b.reads / calls,
        "caller_reads": b.caller_reads / calls,
        "exact": _exact_share(b.anth_records),
    }


# -- caller-thread and background CPU per call ------------------------------------------------

_STEP = {"drafts": 3, "draft_tokens": 6, "accepted": 5, "per_pos": (3, 2), "tokens": 8}


class StandIn:
    """An in-process HTTP server answering as vLLM 0.32 does, for the CPU block without an
    engine: ``/v1/chat/completions`` (with the per-request block when ``per_request``),
    ``/version``, and ``/metrics/`` (``name[]`` filtered, from the real capture in tests/data)
    whose counters move by exactly each call's figures (``_STEP``)."""

    CAPTURE = Path(__file__).resolve().parents[1] / "tests/data/metrics-vllm-0.32-mtp.txt"

    def __init__(self, per_request: bool) -> None:
        self.per_request = per_request
        self.calls = 0
        self.lock = threading.Lock()
        self.page = self.CAPTURE.read_text().splitlines()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/version"):
                    return self._send(b'{"version":"0.32.0"}', "application/json")
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                self._send(stand_in.metrics(query.get("name[]", [])).encode(), "text/plain")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send(json.dumps(stand_in.chat()).encode(), "application/json")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def chat(self) -> dict:
        with self.lock:
            self.calls += 1
        body = {
            "id": f"chatcmpl-{self.calls}",
            "object": "chat.completion",
            "created": 1796000000,
            "model": "gemma4-tiny",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi " * 8, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 9, "total_tokens": 17, "completion_tokens": 8},
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        if self.per_request:
            body["metrics"] = {
                "speculative_decoding": {
                    "num_spec_steps": _STEP["drafts"],
                    "num_draft_tokens": _STEP["draft_tokens"],
                    "num_accepted_draft_tokens": _STEP["accepted"],
                    "num_spec_tokens": 2,
                    "per_step_accepted": [2, 2, 1],
                    "per_step_drafted": [2, 2, 2],
                }
            }
        return body

    def metrics(self, names: list[str]) -> str:
        with self.lock:
            n = self.calls
        values = {
            "vllm:spec_decode_num_drafts_total{": n * _STEP["drafts"],
            "vllm:spec_decode_num_draft_tokens_total{": n * _STEP["draft_tokens"],
            "vllm:spec_decode_num_accepted_tokens_total{": n * _STEP["accepted"],
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",'
            'model_name="gemma4-tiny",position="0"}': n * _STEP["per_pos"][0],
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",'
            'model_name="gemma4-tiny",position="1"}': n * _STEP["per_pos"][1],
            "vllm:generation_tokens_total{": n * _STEP["tokens"],
            'vllm:request_success_total{engine="0",finished_reason="length"': n,
            "vllm:num_requests_running{": 0,
        }
        # prometheus_client's filter keeps the samples named, by their exact names (a counter's
        # _created series is not its _total's): for the agent's series the page is vLLM 0.32's,
        # 29 lines and 2.2 KB (it was 57 lines and 4 KB with every family's _created series).
        out = []
        for line in self.page:
            name = line.split(" ", 3)[2] if line.startswith("#") else line.split("{", 1)[0]
            if names and name not in names:
                continue
            for prefix, value in values.items():
                if line.startswith(prefix):
                    line = f"{line.rsplit(' ', 1)[0]} {float(value)}"
            out.append(line)
        return "\n".join(out) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SDKTime:
    """Thread CPU spent inside the SDK's own ``create`` beneath the agent (on this thread)."""

    def __init__(self, resource) -> None:
        self.ns = 0
        inner = resource.create

        def create(*args, **kwargs):
            t0 = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - t0

        resource.create = create  # the proxy calls the resource's create: this one


def _agent_threads_cpu_ns() -> int:
    """CPU of the agent's own threads (named ``appliance-agent*``) so far."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith("appliance-agent") and t.ident is not None:
            with contextlib.suppress(OSError):
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
    return total


def cpu_per_call(url: str, calls: int, gap_s: float, max_tokens: int) -> dict:
    """Caller-thread CPU of each agent call (its own share), the agent threads' CPU per call,
    and the share of exact figures: agent calls back to back (``gap_s`` apart), then with a
    bare call between each."""
    kw = {
        "model": "gemma4-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    records: list[agent.CallRecord] = []
    raw = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    sdk = SDKTime(raw.chat.completions)
    traced = agent.instrument(
        raw,
        role="bench",
        tracer_provider=TracerProvider(),
        registry=CollectorRegistry(),
        on_call=records.append,
    )
    bare = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = {"floor": _floor(url, calls, gap_s, kw)}
    for regime, between in (("back to back", False), ("a bare call between", True)):
        for _ in range(5):  # warm: connections, the agent's learned state
            traced.chat.completions.create(**kw)
        agent.flush(30)
        records.clear()
        # A full collection now, not inside the block: the process's first one (the imports'
        # objects, ~150 ms here) otherwise lands on whichever thread allocates then, and on
        # the agent's thread it added ~0.8 ms to one row's background CPU per call.
        gc.collect()
        caller: list[float] = []
        bg0 = _agent_threads_cpu_ns()
        for _ in range(calls):
            if between:
                bare.chat.completions.create(**kw)
            caller.append(_own_ms(traced.chat.completions.create, sdk, gap_s, kw))
        agent.flush(30)
        background = (_agent_threads_cpu_ns() - bg0) / 1e6 / calls
        out[regime] = {
            "caller": caller,
            "background": background,
            "exact": sum(r.figures.exact for r in records) / max(1, len(records)),
            "sources": sorted({r.figures.source for r in records}),
        }
    return out


def _floor(url: str, calls: int, gap_s: float, kw: dict) -> list[float]:
    """The same measure with a pass-through in the agent's place: what the caller's figure
    reads when there is nothing to find (timing a thread just back from its sleep costs CPU of
    its own, a cold cache's)."""
    raw = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    sdk = SDKTime(raw.chat.completions)
    create = raw.chat.completions.create
    floor = []
    for _ in range(5):
        create(**kw)
    gc.collect()
    for _ in range(calls):
        floor.append(_own_ms(create, sdk, gap_s, kw))
    return floor


def _own_ms(create, sdk: SDKTime, gap_s: float, kw: dict) -> float:
    """After ``gap_s`` of sleep, one ``create``'s caller-thread CPU less the SDK's own, in ms."""
    time.sleep(gap_s)
    sdk.ns = 0
    t0 = time.thread_time_ns()
    create(**kw)
    return (time.thread_time_ns() - t0 - sdk.ns) / 1e6


def print_cpu(rows: list[tuple[str, dict]]) -> None:
    print()
    print(f"host speed: {host_speed.reference_seconds():.2f} s for the reference loop")
    print("agent CPU per call, ms: caller's thread (median, p10-p90) and the agent's thread")
    print(
        f"{'path':<20} {'regime':<22} {'caller med':>10} {'p10-p90':>13} {'background':>10} "
        f"{'exact':>6}  sources"
    )
    for path, result in rows:
        floor = result["floor"]
        spread = f"{_pct(floor, 0.1):.3f}-{_pct(floor, 0.9):.3f}"
        label = "floor: pass-through"
        print(f"{path:<20} {label:<22} {statistics.median(floor):>10.3f} {spread:>13}")
        for regime, r in result.items():
            if regime == "floor":
                continue
            c = r["caller"]
            spread = f"{_pct(c, 0.1):.3f}-{_pct(c, 0.9):.3f}"
            print(
                f"{path:<20} {regime:<22} {statistics.median(c):>10.3f} {spread:>13} "
                f"{r['background']:>10.3f} {r['exact']:>6.0%}  {','.join(r['sources'])}"
            )


@contextlib.contextmanager
def _engine(url: str | None, prof):
    if url:
        yield url
        return
    with local.serve(prof, drafter="copy", timeout=900) as eng:
        yield eng.url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--per-request-url", help="a running engine with per-request metrics on")
    ap.add_argument("--counters-url", help="a running engine with per-request metrics off")
    ap.add_argument(
        "--engines",
        default="per-request,counters",
        help="which engines, comma-separated: per-request (chat's block; Anthropic's counters) "
        "and counters (per-request metrics off)",
    )
    ap.add_argument("--gap-ms", type=float, default=25.0, help="CPU block: sleep between calls")
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU block")
    ap.add_argument(
        "--stand-in", action="store_true", help="CPU block on an in-process vLLM stand-in"
    )
    args = ap.parse_args()
    if args.stand_in:
        rows = []
        for name, per_request in (("per-request metrics", True), ("/metrics counters", False)):
            server = StandIn(per_request)
            try:
                rows.append(
                    (name, cpu_per_call(server.url, args.calls, args.gap_ms / 1e3, args.max_tokens))
                )
            finally:
                server.close()
        print(f"stand-in server, {args.calls} calls a regime, {args.gap_ms:g} ms apart")
        print_cpu(rows)
        return
    base = profiles.get("cpu-tiny-mtp")
    wanted = {"per-request": "per-request metrics", "counters": "/metrics counters"}
    args.engines = {wanted[e.strip()] for e in args.engines.split(",")}
    paths = {
        "per-request metrics": (args.per_request_url, base),
        "/metrics counters": (
            args.counters_url,
            dataclasses.replace(base, per_request_spec_decode_metrics=None),
        ),
    }
    ms = 1e3
    print(f"{args.calls} rounds, {args.max_tokens} tokens per call, medians and p99 in ms")
    print(
        f"{'path':<20} {'run':<26} {'bare med':>8} {'added med':>9} {'added p99':>9} "
        f"{'reads/call':>10} {'on caller':>9} {'exact':>6}"
    )
    summary = []
    cpu_rows: list[tuple[str, dict]] = []
    for name, (url, prof) in paths.items():
        if name not in args.engines:
            continue
        with _engine(url, prof) as u:
            if args.cpu_only:
                cpu_rows.append(
                    (name, cpu_per_call(u, args.calls, args.gap_ms / 1e3, args.max_tokens))
                )
                continue
            b = Bench(u, args.max_tokens)
            r = interleaved(b, args.calls)
            bare_med = statistics.median(r["bare"]) * ms
            for who, label in (
                ("agent", "agent, interleaved"),
                ("zero", "zero-code, interleaved"),
                ("seed", "seed: 2 full scrapes+parse"),
            ):
                d = r["added"][who]
                ours = who != "seed"
                reads = f"{r['reads']:.2f}" if ours else "2 (full)"
                on_caller = f"{r['caller_reads']:.2f}" if ours else "2 (full)"
                exact = f"{r['exact']:.0%}" if ours else "-"
                print(
                    f"{name:<20} {label:<26} {bare_med:>8.2f} {statistics.median(d) * ms:>9.2f}"
                    f" {_pct(d, 0.99) * ms:>9.2f} {reads:>10} {on_caller:>9} {exact:>6}"
                )
            s = back_to_back(b, args.calls)
            print(
                f"{name:<20} {'agent, back to back':<26} "
                f"{statistics.median(s['bare']) * ms:>8.2f} "
                f"{statistics.median(s['added']) * ms:>9.2f} {_pct(s['added'], 0.99) * ms:>9.2f} "
                f"{s['reads']:>10.2f} {s['caller_reads']:>9.2f} {s['exact']:>6.0%}"
            )
            c = client_side(b, args.calls)
            for label, d, exact in (
                ("agent, client side only", c["added"], f"{c['exact']:.0%}"),
                ("  floor: bare less bare", c["floor"], "-"),
                ("  inside the agent's steps", c["inside"], "-"),
            ):
                print(
                    f"{name:<20} {label:<26} {'-':>8} {statistics.median(d) * ms:>9.3f}"
                    f" {_pct(d, 0.99) * ms:>9.3f} {'':>10} {'':>9} {exact:>6}"
                )
            a = anthropic_rounds(b, args.calls)
            print(
                f"{name:<20} {'anthropic, interleaved':<26} "
                f"{statistics.median(a['bare']) * ms:>8.2f} "
                f"{statistics.median(a['added']) * ms:>9.2f} {_pct(a['added'], 0.99) * ms:>9.2f} "
                f"{a['reads']:>10.2f} {a['caller_reads']:>9.2f} {a['exact']:>6.0%}"
            )
            for label, d in (
                ("  the same, read off", a["no_read"]),
                ("  inside the agent steps", a["inside"]),
                ("  inside, read off", a["inside_no_read"]),
            ):
                print(
                    f"{name:<20} {label:<26} {'-':>8} {statistics.median(d) * ms:>9.3f}"
                    f" {_pct(d, 0.99) * ms:>9.3f} {'':>10} {'':>9} {'-':>6}"
                )
            cpu_rows.append((name, cpu_per_call(u, args.calls, args.gap_ms / 1e3, args.max_tokens)))
            summary += [
                (name, "proxy (OpenAI chat)", r["bare"], r["added"]["agent"]),
                (name, "instrumentor (OpenAI chat)", r["bare"], r["added"]["zero"]),
                (name, "instrumentor (Anthropic)", a["bare"], a["added"]),
                (name, "  the same, read off", a["bare"], a["no_read"]),
            ]
    print_cpu(cpu_rows)
    if args.cpu_only:
        return
    print()
    print("caller-visible wall time, agent less bare (same round), ms")
    print(f"{'engine':<20} {'path':<28} {'bare med':>8} {'added med':>9} {'added p99':>9}")
    for engine, label, bare, d in summary:
        print(
            f"{engine:<20} {label:<28} {statistics.median(bare) * ms:>8.2f}"
            f" {statistics.median(d) * ms:>9.2f} {_pct(d, 0.99) * ms:>9.2f}"
        )


if __name__ == "__main__":
    main()
