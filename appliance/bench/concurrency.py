"""Bench under load: the same endpoint at several concurrency levels, one level after another.

Each level keeps N requests in flight for a bounded number of requests, after N warm-up
requests, paced and timed as ``vllm bench serve --max-concurrency N`` (request rate inf) paces
and times them: one event loop, every request queued at once behind a semaphore of N, the next
one sent as soon as one ends. Per level: output throughput (usage tokens over the level's wall
time, vLLM's benchmark duration: first request queued to last one done), TTFT, TPOT and ITL
(median and p99, :mod:`.stream`'s definitions), and the engine's acceptance, tokens per step and
per-position acceptance over that level's requests: the responses' per-request blocks when the
server sends them (exact under load), else the /metrics delta over the level (exact for the
level while nothing else uses the server). A request the engine turns away (503: its queue
bound, gotchas/queue-bound.md) counts as rejected, with the seconds it took to be told; every
figure above is over the requests that were answered.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from ..engine_api import specdecode
from ..engine_api.vllm_client import VLLMClient, bearer, generate_streamed
from ..errors import OverloadedError
from . import schedule, stats, vllm_names
from .prompts import Prompt
from .runner import BenchConfig, Endpoint, Progress, RunRecord, parse_distinct_ints
from .stream import StreamResult


def parse_levels(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``: distinct, 1..1024, in the order given."""
    return parse_distinct_ints(text, "--concurrency", "1,4,16", 1024)


def _summary(values: list[float]) -> dict | None:
    """Median and p99 (and n) of ``values``; ``None`` when empty."""
    if not values:
        return None
    return {
        "n": len(values),
        "median": stats.percentile(values, 50),
        "p99": stats.percentile(values, 99),
    }


@dataclass
class LevelResult:
    """One concurrency level: its answered requests, wall time, the counters' movement over it
    and the seconds each rejected request took to be turned away (503)."""

    concurrency: int
    records: list[RunRecord]
    wall_s: float
    counters: specdecode.Delta
    rejected_s: list[float] = field(default_factory=list)

    def spec(self) -> tuple[specdecode.Delta | None, str]:
        """The level's speculative figures and their source (``request`` or ``counters``)."""
        if self.records and all(r.spec_source == "request" for r in self.records):
            return specdecode.summed([r.spec for r in self.records]), "request"
        if self.counters.status == "ok":
            return self.counters, "counters"
        return None, self.counters.status

    def predicted_lengths(self) -> tuple[float, ...] | None:
        """Tokens per step at every k' <= k from this level's run at k: per request when the
        requests carry their own figures, else from the level's summed per-position rates."""
        spec, source = self.spec()
        if source == "request":
            predicted = schedule.predicted_lengths_of([r.spec for r in self.records])
            if predicted is not None:
                return predicted
        if spec is not None and spec.per_position:
            return schedule.predicted_lengths(spec.per_position)
        return None

    def tpot_median_s(self) -> float | None:
        """The level's median TPOT (vLLM's definition, per request)."""
        s = _summary([r.tpot_s for r in self.records if r.tpot_s is not None])
        return None if s is None else s["median"]

    def to_dict(self) -> dict:
        rs = self.records
        tokens = sum(r.output_tokens for r in rs)
        spec, source = self.spec()
        figures = (spec or specdecode.Delta("absent")).to_dict()
        figures.pop("status")
        predicted = self.predicted_lengths()
        return {
            "concurrency": self.concurrency,
            "requests": len(rs),
            "rejected": len(self.rejected_s),
            "time_to_rejection_s": _summary(self.rejected_s),
            "output_tokens": tokens,
            "prompt_tokens": None
            if any(r.prompt_tokens is None for r in rs)
            else sum(r.prompt_tokens for r in rs),
            "wall_s": self.wall_s,
            "output_throughput_tps": tokens / self.wall_s if self.wall_s > 0 else None,
            "ttft_s": _summary([r.ttft_s for r in rs]),
            "tpot_s": _summary([r.tpot_s for r in rs if r.tpot_s is not None]),
            "itl_s": _summary([x for r in rs for x in r.itl_s]),
            "spec_source": source,
            **figures,
            "predicted_tokens_per_step": None if predicted is None else list(predicted),
            "counters_over_level": self.counters.to_dict(),
            "vllm_bench_serve": vllm_names.fields(rs, spec, self.wall_s),
        }


@dataclass
class ConcurrencyResult:
    endpoint: Endpoint
    levels: list[LevelResult]

    def to_dict(self) -> dict:
        return {
            "endpoint": self.endpoint.to_dict(),
            "levels": [lv.to_dict() for lv in self.levels],
        }


def _work(config: BenchConfig, requests: int) -> list[tuple[str, Prompt, int]]:
    """The level's ``requests`` requests in order, cycling over every (prompt set, prompt,
    max_tokens)."""
    items = [
        (pset.name, prompt, mt)
        for pset in config.prompt_sets
        for prompt in pset.prompts
        for mt in config.max_tokens
    ]
    return list(itertools.islice(itertools.cycle(items), requests))


def run_level(
    ep: Endpoint,
    config: BenchConfig,
    concurrency: int,
    requests: int,
    progress: Progress | None = None,
) -> LevelResult:
    """``concurrency`` warm-up requests at once, then ``requests`` with that many in flight."""
    return asyncio.run(_level(ep, config, concurrency, requests, progress))


async def _level(
    ep: Endpoint,
    config: BenchConfig,
    concurrency: int,
    requests: int,
    progress: Progress | None,
) -> LevelResult:
    """The level on one event loop, paced as ``vllm bench serve --max-concurrency N`` paces it
    (request rate inf): every request is queued at once behind a semaphore of N, so the next one
    starts as soon as one ends. One HTTP client serves the warm-up and the level, so its set-up
    and its N connections are paid before the clock starts; the level's wall time runs from
    queueing the first request to the end of the last, as vLLM's benchmark duration does."""
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    slots = asyncio.Semaphore(concurrency)
    http = httpx.AsyncClient(
        base_url=ep.url, headers=bearer(ep.api_key), timeout=timeout, limits=limits
    )

    async def send(prompt: Prompt, max_tokens: int) -> StreamResult | OverloadedError:
        async with slots:
            try:
                gen = await generate_streamed(
                    http,
                    ep.model,
                    prompt.messages,
                    max_tokens,
                    temperature=config.temperature,
                    seed=config.seed,
                    timeout=timeout,
                )
            except OverloadedError as exc:  # turned away: counted, not a failed run
                return exc
        return StreamResult.from_generation(gen)

    async def measure(
        index: int, pset: str, prompt: Prompt, max_tokens: int
    ) -> RunRecord | OverloadedError:
        res = await send(prompt, max_tokens)
        if isinstance(res, OverloadedError):
            if progress:
                progress(1)
            return res
        d = res.request_spec
        source = "request" if d is not None else ("shared" if ep.speculative else "absent")
        if progress:
            progress(1)
        return RunRecord.of((ep.label, pset, prompt.id, max_tokens, index), res, source, d)

    async with http:
        if config.warmups:
            first = config.prompt_sets[0].prompts[0]
            warm = min(config.max_tokens)
            await asyncio.gather(*(send(first, warm) for _ in range(concurrency)))
        with VLLMClient(ep.url, timeout=30.0, api_key=ep.api_key) as observer:
            before = observer.snapshot()  # nothing in flight: blocking the loop costs nothing
            start = time.perf_counter()
            jobs = [measure(i, *item) for i, item in enumerate(_work(config, requests), 1)]
            done = list(await asyncio.gather(*jobs))
            wall = time.perf_counter() - start
            after = observer.snapshot()
    records = [r for r in done if isinstance(r, RunRecord)]
    rejected = [r.seconds for r in done if isinstance(r, OverloadedError)]
    return LevelResult(concurrency, records, wall, specdecode.delta(before, after), rejected)


def run_concurrency(
    ep: Endpoint,
    config: BenchConfig,
    levels: list[int],
    requests: int | None = None,
    progress: Progress | None = None,
    on_level: Callable[[int], None] | None = None,
) -> ConcurrencyResult:
    """Every level in turn; ``requests`` per level (default: 4 per slot, at least every prompt
    once)."""
    out = []
    for n in levels:
        if on_level:
            on_level(n)
        count = requests or max(4 * n, config.measured_requests)
        out.append(run_level(ep, config, n, count, progress))
    return ConcurrencyResult(ep, out)
