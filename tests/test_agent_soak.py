"""The agent under load against real engines it starts itself, restarted in the middle.

About 1,500 calls mixing sync and async, streamed and plain, 12 in flight, ~10% of the streams
cancelled mid-stream (a real ``task.cancel()``) and ~5% abandoned unread. The first engine has
no per-request metrics (the /metrics path: windows, reads, the exactness proof); it is stopped
while calls are in flight and replaced, on the same port, by one with per-request metrics on (the
agent must notice the switch). Checks: every call's span ended exactly once; results are the
SDK's own; no window left behind (sequential calls are exact); exact figures never exceed the
counters' movement and equal it when every call was exact; on the per-request engine each exact
call equals its response's own block; RSS flat over 1,000 calls; no exception from the agent.

Marked ``soak`` (and ``engine``) so the fast tiers can skip it: ``-m "not soak"``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import random
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from plugins.engine_idle import idle
from prometheus_client import CollectorRegistry

from appliance import agent, profiles
from appliance.agent.server import server_for
from appliance.engine import local
from appliance.engine_api import specdecode
from appliance.engine_api.vllm_client import VLLMClient

pytestmark = [pytest.mark.engine, pytest.mark.soak]

MODEL = "gemma4-tiny"
IN_FLIGHT = 12  # 6 threads of sync calls + 6 concurrent async calls
RSS_BOUND_MIB = 32  # growth allowed over 1,000 calls (spans, records and pools are not kept)


class Ends(SpanProcessor):
    """Counts span ends per span id without keeping the spans (memory stays the agent's)."""

    def __init__(self) -> None:
        self.ended: dict[int, int] = {}
        self.lock = threading.Lock()

    def on_end(self, span) -> None:
        with self.lock:
            sid = span.context.span_id
            self.ended[sid] = self.ended.get(sid, 0) + 1


class AgentLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclasses.dataclass
class Storm:
    """Drives the calls and keeps only what the checks need.

    ``instrumented(client, role)`` wraps a bare client; each run gets fresh clients for its role
    (the role is the phase; an async client's pool belongs to the event loop of its run).
    """

    instrumented: Callable
    url: str
    sync: openai.OpenAI | None = None
    aclient: openai.AsyncOpenAI | None = None
    blocks: dict[str, specdecode.Delta] = dataclasses.field(default_factory=dict)
    calls: int = 0
    failures: list[BaseException] = dataclasses.field(default_factory=list)
    odd: list[str] = dataclasses.field(default_factory=list)
    # The HTTP responses of the streams dropped unread: the SDK never closes them (their
    # connections stay open), so each run closes its own once its calls are done.
    unread: list[httpx.Response] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def _kw(self, i: int, stream: bool) -> dict:
        kw = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"call {i}: the sea"}],
            "max_tokens": 4 + i % 9,
            "temperature": 0,
        }
        if stream:
            kw |= {"stream": True, "stream_options": {"include_usage": True}}
        return kw

    def _count(self, failure: BaseException | None = None) -> None:
        with self.lock:
            self.calls += 1
            if failure is not None:
                self.failures.append(failure)

    def _check_plain(self, resp, kw) -> None:
        if not isinstance(resp, openai.types.chat.ChatCompletion):
            self.odd.append(f"result is {type(resp)}")
        elif resp.usage.completion_tokens > kw["max_tokens"]:
            self.odd.append("usage beyond max_tokens")
        block = specdecode.from_response_metrics(resp.model_extra)
        if block is not None:
            self.blocks[resp.id] = block

    def _check_chunks(self, chunks, kw) -> None:
        if not chunks or chunks[-1].usage is None:
            self.odd.append("stream without its usage chunk")
            return
        block = specdecode.from_response_metrics(chunks[-1].model_extra)
        if block is not None:
            self.blocks[chunks[-1].id] = block

    # -- sync -----------------------------------------------------------------------------------
    def sync_call(self, i: int) -> None:
        kind = i % 20
        try:
            if kind == 7:  # abandoned unread (5%)
                s = self.sync.chat.completions.create(**self._kw(i, True))
                if not isinstance(s, openai.Stream):
                    self.odd.append(f"stream is {type(s)}")
                self.unread.append(s.response)
                del s
            elif kind % 2:
                kw = self._kw(i, True)
                self._check_chunks(list(self.sync.chat.completions.create(**kw)), kw)
            else:
                kw = self._kw(i, False)
                self._check_plain(self.sync.chat.completions.create(**kw), kw)
            self._count()
        except (openai.APIError, httpx.HTTPError) as exc:  # the restart: the SDK's own errors
            self._count(exc)

    # -- async ----------------------------------------------------------------------------------
    async def async_call(self, i: int) -> None:
        kind = i % 20
        try:
            if kind in (3, 13):  # cancelled mid-stream (10% of all calls), a real cancel
                await self._cancelled(i)
                return
            if kind % 2:
                kw = self._kw(i, True)
                s = await self.aclient.chat.completions.create(**kw)
                self._check_chunks([c async for c in s], kw)
            else:
                kw = self._kw(i, False)
                self._check_plain(await self.aclient.chat.completions.create(**kw), kw)
            self._count()
        except (openai.APIError, httpx.HTTPError) as exc:
            self._count(exc)

    async def _cancelled(self, i: int) -> None:
        first = asyncio.Event()

        async def read() -> None:
            kw = self._kw(i, True) | {"max_tokens": 48}
            s = await self.aclient.chat.completions.create(**kw)
            chunks = []
            async for c in s:
                chunks.append(c)
                first.set()
            self._check_chunks(chunks, kw)  # it ended before the cancel landed

        task = asyncio.create_task(read())
        waiter = asyncio.create_task(first.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError as exc:
            self._count(exc)
        except (openai.APIError, httpx.HTTPError) as exc:
            self._count(exc)
        else:
            self._count()  # it finished before the cancel landed

    def use(self, role: str) -> None:
        self.sync = self.instrumented(
            openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0), role
        )

    def run(self, role: str, indices: range, on_progress=None) -> None:
        """Half the calls on 6 threads (sync), half on one event loop, 6 at a time (async)."""
        self.use(role)
        # Sync: the plain even calls and the abandoned ones (i % 20 == 7, 5%); async: the rest,
        # with the cancelled ones (i % 20 in (3, 13), 10%).
        sync_i = [i for i in indices if (i % 2 == 0 and i % 20 not in (3, 13)) or i % 20 == 7]
        async_i = [i for i in indices if i not in set(sync_i)]
        crashed: list[BaseException] = []

        async def run_async() -> None:
            self.aclient = self.instrumented(
                openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0), role
            )
            sem = asyncio.Semaphore(IN_FLIGHT // 2)

            async def one(i):
                async with sem:
                    await self.async_call(i)
                    if on_progress:
                        on_progress()

            await asyncio.gather(*(one(i) for i in async_i))
            await self.aclient.close()

        def loop() -> None:
            try:
                asyncio.run(run_async())
            except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
                crashed.append(exc)

        loop_thread = threading.Thread(target=loop)
        loop_thread.start()
        with ThreadPoolExecutor(IN_FLIGHT // 2) as pool:
            for _ in pool.map(lambda i: (self.sync_call(i), on_progress and on_progress()), sync_i):
                pass
        loop_thread.join()
        # The streams dropped unread end in the engine once their connections close.
        while self.unread:
            self.unread.pop().close()
        if crashed:
            raise crashed[0]


def _movement(before, after, model=MODEL) -> specdecode.Delta:
    return specdecode.delta(before, after, model)


def _sum(records, field: str) -> int:
    return sum(getattr(r.figures, field) or 0 for r in records if r.figures.exact)


def test_soak_restart_cancel_abandon(tmp_path):
    random.seed(13)
    port = local.free_port()
    base = profiles.get("cpu-tiny-mtp")
    counters_profile = dataclasses.replace(base, per_request_spec_decode_metrics=None)
    url = f"http://127.0.0.1:{port}"

    ends = Ends()
    provider = TracerProvider()
    provider.add_span_processor(ends)
    registry = CollectorRegistry()
    records: list[agent.CallRecord] = []
    log = AgentLog()
    logging.getLogger("appliance.agent").addHandler(log)
    logging.getLogger("appliance.agent").setLevel(logging.DEBUG)
    cfg = agent.AgentConfig(snapshot_timeout=1.0, failure_cooldown=0.5)  # a loaded 2-core box

    def instrumented(client, role):
        return agent.instrument(
            client,
            role=role,
            config=cfg,
            tracer_provider=provider,
            registry=registry,
            on_call=records.append,
        )

    storm = Storm(instrumented, url)
    server = server_for(url + specdecode.SNAPSHOT_PATH)
    started = time.monotonic()
    try:
        engine1 = local.serve(counters_profile, port=port, timeout=900)
        eng = engine1.__enter__()
        try:
            # 1. The /metrics path under load.
            with VLLMClient(url) as obs:
                b0 = obs.snapshot()
                storm.run("storm-a", range(250))
                assert agent.flush(60)
                a0 = obs.snapshot()
                storm_a = [r for r in records if r.role == "storm-a"]
                moved = _movement(b0, a0)
                # Exact figures never exceed the counters' movement over the run.
                for f in ("drafts", "draft_tokens", "accepted"):
                    assert _sum(storm_a, f) <= getattr(moved, f)
                # 2. No window left behind: sequential calls are exact again and add up, once
                # the engine has ended what the storm's cancelled and dropped streams left
                # running (the agent's windows are all closed already; the engine's requests
                # end a moment later, and one still running makes a call `shared`, rightly).
                assert server.in_flight() == 0
                b1 = idle(obs)
                storm.use("sequential")
                for i in range(3):  # each after the previous one's figures are known
                    storm.sync.chat.completions.create(**storm._kw(i, False))
                    assert agent.flush(30)
                assert agent.flush(30)
                seq = [r for r in records if r.role == "sequential"]
                assert [r.figures.source for r in seq] == ["counters"] * 3
                d = _movement(b1, obs.snapshot())
                assert (_sum(seq, "drafts"), _sum(seq, "draft_tokens"), _sum(seq, "accepted")) == (
                    d.drafts,
                    d.draft_tokens,
                    d.accepted,
                )
            # 3. The engine stops while calls are in flight.
            done = 0
            stopper = threading.Event()

            def progress():
                nonlocal done
                done += 1
                if done == 60:
                    stopper.set()

            stop_thread = threading.Thread(target=lambda: (stopper.wait(), eng.stop(grace=5)))
            stop_thread.start()
            storm.run("restart", range(250, 400), on_progress=progress)
            stopper.set()
            stop_thread.join()
        finally:
            engine1.__exit__(None, None, None)
        restart_failures = len(storm.failures)

        # 4. The replacement, on the same port, sends per-request figures.
        with local.serve(base, port=port, timeout=900), VLLMClient(url) as obs:
            storm.run("storm-b0", range(400, 500))
            assert agent.flush(60)
            gc.collect()
            rss0 = _rss_mib()
            b2 = obs.snapshot()
            storm.run("storm-b", range(500, 1500))
            assert agent.flush(60)
            a2 = obs.snapshot()
            gc.collect()
            rss1 = _rss_mib()
    finally:
        logging.getLogger("appliance.agent").removeHandler(log)
    took = time.monotonic() - started

    def errors(kind):
        return registry.get_sample_value("gemma4_agent_errors_total", {"kind": kind}) or 0

    def calls_total(**labels):
        return sum(
            s.value
            for fam in registry.collect()
            for s in fam.samples
            if s.name == "gemma4_agent_calls_total"
            and all(s.labels.get(k) == v for k, v in labels.items())
        )

    storm_b = [r for r in records if r.role == "storm-b"]
    sources = {
        s: sum(r.figures.source == s for r in records) for s in {r.figures.source for r in records}
    }
    error_counts = {
        s.labels["kind"]: s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name == "gemma4_agent_errors_total"
    }
    print(
        f"\nsoak: {storm.calls} calls in {took:.0f} s, {len(storm.failures)} failed at the "
        f"caller ({restart_failures} around the restart), sources "
        f"{sorted(sources.items())}; "
        f"RSS {rss0:.1f} -> {rss1:.1f} MiB over 1,000 calls (+{rss1 - rss0:.1f}, bound "
        f"{RSS_BOUND_MIB}); agent errors "
        f"{error_counts}"
    )

    # Every call's span ended exactly once, and every call reached on_call.
    assert storm.calls + 3 == len(records) == len(ends.ended) == 1503
    assert set(ends.ended.values()) == {1}
    assert storm.odd == []  # the caller's results are the SDK's own
    # No exception from the agent: callers saw only the SDK's errors and their own cancels.
    assert all(
        isinstance(e, (openai.APIError, httpx.HTTPError, asyncio.CancelledError))
        for e in storm.failures
    )
    assert errors("internal") == 0 and errors("on_call") == 0
    assert not [r for r in log.records if r.levelno >= logging.WARNING or r.exc_info]
    # The agent counted what happened: every failure the callers saw is an error call.
    assert calls_total(outcome="error") == len(storm.failures)
    assert restart_failures > 0  # the stop really landed on calls in flight
    assert 60 <= sum(r.figures.status == "abandoned" for r in records) <= 75  # 5% of 1,500
    assert server.in_flight() == 0
    # On the per-request engine every exact call equals its response's own block...
    assert server.per_request is True
    exact_b = [r for r in storm_b if r.figures.exact]
    assert {r.figures.source for r in exact_b} == {"request"}
    # Every call that completed (not cancelled, not abandoned) is exact there.
    assert [
        r
        for r in storm_b
        if r.outcome == "ok" and r.figures.status != "abandoned" and not r.figures.exact
    ] == []
    assert len(exact_b) >= 800
    for r in exact_b:
        block = storm.blocks[r.response_id]
        assert (r.figures.drafts, r.figures.draft_tokens, r.figures.accepted) == (
            block.drafts,
            block.draft_tokens,
            block.accepted,
        )
    # ...and the exact calls of the measured stretch never exceed the counters' movement
    # (cancelled and abandoned streams drafted too, without exact figures).
    moved = _movement(b2, a2)
    for f in ("drafts", "draft_tokens", "accepted"):
        assert 0 < _sum(storm_b, f) <= getattr(moved, f)
    # Memory is flat.
    assert rss1 - rss0 < RSS_BOUND_MIB
