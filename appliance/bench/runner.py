"""Run benchmarks: one endpoint, or an MTP endpoint paired with its baseline.

Every endpoint is first probed (:mod:`appliance.engine_api.probe`: the same MTP verdict doctor and
the cutover gates give), and every measured request is a probe too: counters read, one streamed
generation, counters read. Requests run one at a time, so the counter delta is exactly that
request's figure unless another client loads the server (then ``shared``); the response's
per-request block wins when the server sends one (source ``request``). The rule is
:func:`appliance.engine_api.specdecode.attribute`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from ..engine_api import probe, specdecode
from ..engine_api.vllm_client import VLLMClient
from ..errors import EngineError, NotVLLMError, UsageError
from ..judge import acceptance
from . import schedule, stats, vllm_names
from .prompts import Prompt, PromptSet
from .stream import StreamResult

Progress = Callable[[int], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to run against each endpoint."""

    prompt_sets: tuple[PromptSet, ...]
    max_tokens: tuple[int, ...] = (64,)
    runs: int = 3
    warmups: int = 1
    temperature: float = 0.0
    seed: int | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.prompt_sets:
            raise UsageError("no prompt sets to run")
        if self.runs < 1:
            raise UsageError("--runs must be at least 1")
        if self.warmups < 0:
            raise UsageError("--warmups cannot be negative")
        if not self.max_tokens or min(self.max_tokens) < 2:
            # TPOT needs at least two output tokens.
            raise UsageError("--max-tokens values must be at least 2")

    @property
    def measured_requests(self) -> int:
        prompts = sum(len(s.prompts) for s in self.prompt_sets)
        return prompts * len(self.max_tokens) * self.runs

    def to_dict(self) -> dict:
        return {
            "prompt_sets": {s.name: [p.id for p in s.prompts] for s in self.prompt_sets},
            "max_tokens": list(self.max_tokens),
            "runs": self.runs,
            "warmups": self.warmups,
            "temperature": self.temperature,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Endpoint:
    """A vLLM server checked to be reachable and to be vLLM."""

    label: str
    url: str
    model: str
    max_model_len: int | None
    vllm_version: str
    speculative: bool  # the server exposes speculative-decoding counters
    api_key: str | None = field(default=None, repr=False, compare=False)  # never in artifacts
    mtp: probe.Probe | None = field(default=None, repr=False, compare=False)  # the verdict

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("api_key")
        d["mtp"] = (
            None if self.mtp is None else {"summary": self.mtp.summary(), **self.mtp.evidence()}
        )
        return d


def parse_distinct_ints(text: str, option: str, example: str, top: int) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``: distinct integers 1..``top``, in the order given."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UsageError(f"{option} wants integers like {example}, not {text!r}") from exc
    if not values or any(v < 1 or v > top for v in values) or len(set(values)) != len(values):
        raise UsageError(f"{option} wants distinct integers 1..{top}, not {text!r}")
    return values


def open_endpoint(url: str, label: str, api_key: str | None = None) -> Endpoint:
    """Check ``url`` is a reachable vLLM server, read what it serves and probe MTP on it (the
    probe's one generation); raises EngineError when any of it fails.

    ``api_key`` is sent on every ``/v1`` call to this endpoint (vLLM's ``--api-key``).
    """
    with VLLMClient(url, api_key=api_key) as client:
        if not client.health():
            raise EngineError(f"{client.base_url}/health is not 200", fix="is the engine ready?")
        version = client.version()
        models = client.models()
        if not models:
            raise NotVLLMError(f"{client.base_url} serves no model")
        p = probe.run(client, models[0].id, timeout=300.0).raise_for_failure()
        return Endpoint(
            label,
            client.base_url,
            models[0].id,
            models[0].max_model_len,
            version,
            p.state != "absent",
            api_key,
            p,
        )


@dataclass
class RunRecord:
    """One measured request and what speculative decoding did for it."""

    label: str
    prompt_set: str
    prompt_id: str
    max_tokens: int
    run: int
    ttft_s: float
    tpot_s: float | None
    e2el_s: float
    itl_s: list[float]
    output_tokens: int  # usage.completion_tokens
    prompt_tokens: int | None
    chunks: int
    output_tps: float
    output_sha256: str
    spec_source: str  # specdecode.attribute's: request | counters | shared | absent | unknown
    spec_status: str = "absent"  # the figures' Delta status: ok | absent | reset
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted: int | None = None
    accepted_per_pos: list[int] | None = None
    text: str = field(default="", repr=False)

    @property
    def spec(self) -> specdecode.Delta:
        """The run's figures as a Delta (whose properties are the one place of every ratio)."""
        pos = None if self.accepted_per_pos is None else tuple(self.accepted_per_pos)
        return specdecode.Delta(
            self.spec_status, self.drafts, self.draft_tokens, self.accepted, pos
        )

    @classmethod
    def of(
        cls,
        where: tuple[str, str, str, int, int],
        res: StreamResult,
        source: str,
        d: specdecode.Delta | None,
    ) -> RunRecord:
        """A record of one streamed request: ``where`` is (label, prompt set, prompt id,
        max_tokens, run); ``d`` its figures (``None``: none of its own, status from ``source``)."""
        label, pset, prompt_id, max_tokens, run = where
        return cls(
            label=label,
            prompt_set=pset,
            prompt_id=prompt_id,
            max_tokens=max_tokens,
            run=run,
            ttft_s=res.ttft_s,
            tpot_s=res.tpot_s,
            e2el_s=res.e2el_s,
            itl_s=res.itl_s,
            output_tokens=res.output_tokens,
            prompt_tokens=res.prompt_tokens,
            chunks=res.chunks,
            output_tps=res.output_tps,
            output_sha256=hashlib.sha256(res.text.encode()).hexdigest(),
            spec_source=source,
            spec_status=d.status if d is not None else ("ok" if source == "shared" else "absent"),
            drafts=None if d is None else d.drafts,
            draft_tokens=None if d is None else d.draft_tokens,
            accepted=None if d is None else d.accepted,
            accepted_per_pos=None
            if d is None or d.accepted_per_pos is None
            else list(d.accepted_per_pos),
            text=res.text,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("text")
        d["tokens_per_step"] = self.spec.tokens_per_step
        d["acceptance"] = self.spec.acceptance
        return d


class _Measurer:
    """Sends requests to one endpoint and records them."""

    def __init__(self, ep: Endpoint, config: BenchConfig) -> None:
        self.ep = ep
        self.config = config
        self.observer = VLLMClient(ep.url, timeout=30.0, api_key=ep.api_key)
        self.timeout = httpx.Timeout(config.timeout_s, connect=10.0)

    def close(self) -> None:
        self.observer.close()

    def send(self, prompt: Prompt, max_tokens: int):
        return self.observer.generate(
            self.ep.model,
            prompt.messages,
            max_tokens,
            temperature=self.config.temperature,
            seed=self.config.seed,
            stream=True,
            timeout=self.timeout,
        )

    def measure(self, pset: str, prompt: Prompt, max_tokens: int, run: int) -> RunRecord:
        p = probe.observe(self.observer, self.ep.model, lambda: self.send(prompt, max_tokens))
        res = StreamResult.from_generation(p.generation)
        where = (self.ep.label, pset, prompt.id, max_tokens, run)
        return RunRecord.of(where, res, p.source, p.figures)

    def warm_up(self, progress: Progress | None) -> None:
        first = self.config.prompt_sets[0].prompts[0]
        for _ in range(self.config.warmups):
            self.send(first, min(self.config.max_tokens))
            if progress:
                progress(1)


@dataclass
class EndpointResult:
    """Every measured run against one endpoint, plus the counters' movement over all of them."""

    endpoint: Endpoint
    records: list[RunRecord]
    counters: specdecode.Delta  # /metrics delta from before the first to after the last run

    def spec_totals(self) -> dict:
        """Per-run figures summed (per-request metrics or per-run counter deltas)."""
        total = specdecode.summed([r.spec for r in self.records])
        figures = (total or specdecode.Delta("absent")).to_dict()
        figures.pop("status")
        if total is None and self.records and all(r.spec_source == "absent" for r in self.records):
            # Without speculative decoding every engine step yields exactly one token.
            figures["tokens_per_step"] = 1.0
        # Tokens per step that a run at each k' <= k would measure, from this run's positions.
        predicted = schedule.predicted_lengths_of([r.spec for r in self.records])
        figures["predicted_tokens_per_step"] = None if predicted is None else list(predicted)
        return {"sources": sorted({r.spec_source for r in self.records}), **figures}

    def groups(self) -> list[dict]:
        """Per (prompt set, max_tokens): summaries of TTFT, TPOT, ITL, output tok/s, spec."""
        keys = sorted(
            {(r.prompt_set, r.max_tokens) for r in self.records}, key=lambda k: (k[0], k[1])
        )
        out = []
        for pset, mt in keys:
            rs = [r for r in self.records if (r.prompt_set, r.max_tokens) == (pset, mt)]
            sub = EndpointResult(self.endpoint, rs, specdecode.Delta("absent"))
            out.append(
                {
                    "prompt_set": pset,
                    "max_tokens": mt,
                    "runs": len(rs),
                    "ttft_s": _sd(stats.summarise([r.ttft_s for r in rs])),
                    "tpot_s": _sd(stats.summarise([r.tpot_s for r in rs if r.tpot_s is not None])),
                    "itl_s": _sd(stats.summarise([x for r in rs for x in r.itl_s])),
                    "output_tps": _sd(stats.summarise([r.output_tps for r in rs])),
                    "output_tokens": sum(r.output_tokens for r in rs),
                    "spec": sub.spec_totals(),
                    "vllm_bench_serve": sub.vllm_fields(),
                }
            )
        return out

    def vllm_fields(self) -> dict:
        """The run under ``vllm bench serve``'s names: no duration (one request at a time,
        /metrics read between them), so no throughput; the speculative figures as in
        :meth:`spec_totals`."""
        return vllm_names.fields(self.records, specdecode.summed([r.spec for r in self.records]))

    def to_dict(self) -> dict:
        return {
            "endpoint": self.endpoint.to_dict(),
            "counters_over_run": self.counters.to_dict(),
            "spec_totals": self.spec_totals(),
            "groups": self.groups(),
            "vllm_bench_serve": self.vllm_fields(),
            "runs": [r.to_dict() for r in self.records],
        }


def _sd(s: stats.Summary | None) -> dict | None:
    return s.to_dict() if s else None


def _items(config: BenchConfig):
    for pset in config.prompt_sets:
        for prompt in pset.prompts:
            for mt in config.max_tokens:
                for run in range(1, config.runs + 1):
                    yield pset.name, prompt, mt, run


def run_endpoint(
    ep: Endpoint, config: BenchConfig, progress: Progress | None = None
) -> EndpointResult:
    """Warm up, then run every (prompt, max_tokens, run) against ``ep`` in turn."""
    m = _Measurer(ep, config)
    try:
        m.warm_up(progress)
        start = m.observer.snapshot()
        records = []
        for pset, prompt, mt, run in _items(config):
            records.append(m.measure(pset, prompt, mt, run))
            if progress:
                progress(1)
        return EndpointResult(ep, records, specdecode.delta(start, m.observer.snapshot()))
    finally:
        m.close()


@dataclass
class PairedResult:
    """MTP and baseline runs of the same requests, with parity, speedup and, where the baseline
    drafts too (an older MTP image), the MTP side's acceptance judged against it."""

    mtp: EndpointResult
    baseline: EndpointResult
    temperature: float
    tolerance: acceptance.Tolerance = field(default_factory=acceptance.Tolerance)

    def pairs(self) -> list[tuple[RunRecord, RunRecord]]:
        return list(zip(self.mtp.records, self.baseline.records, strict=True))

    def parity(self) -> dict:
        """Output equality per pair; only meaningful (``checked``) at temperature 0."""
        if self.temperature != 0:
            return {
                "checked": False,
                "reason": "temperature > 0: outputs are samples",
                "equal": None,
                "differ": None,
                "differing": [],
            }
        differing = [
            f"{m.prompt_set}/{m.prompt_id}/max{m.max_tokens}/run{m.run}"
            for m, b in self.pairs()
            if m.text != b.text
        ]
        return {
            "checked": True,
            "reason": None,
            "equal": len(self.pairs()) - len(differing),
            "differ": len(differing),
            "differing": differing,
        }

    def speedup(self) -> dict:
        """Paired speedups with 95% CIs: end-to-end output tok/s and TPOT (baseline / MTP)."""
        tps = [m.output_tps / b.output_tps for m, b in self.pairs() if b.output_tps > 0]
        tpot = [b.tpot_s / m.tpot_s for m, b in self.pairs() if m.tpot_s and b.tpot_s]
        s1, s2 = stats.paired_speedup(tps), stats.paired_speedup(tpot)
        return {"output_tps": s1.to_dict() if s1 else None, "tpot": s2.to_dict() if s2 else None}

    def acceptance_change(self) -> acceptance.Change | None:
        """Per request, the MTP side's drafting against the baseline's; None when the baseline
        does not draft (MTP against no MTP: nothing to compare)."""
        return acceptance.change(((b.spec, m.spec) for m, b in self.pairs()), "requests")

    def acceptance_failures(self) -> tuple[str, ...]:
        """The drafting regressions beyond ``tolerance``, as the canary and the soak judge them."""
        change = self.acceptance_change()
        return () if change is None else change.failures(self.tolerance)

    def to_dict(self) -> dict:
        change = self.acceptance_change()
        return {
            "mtp": self.mtp.to_dict(),
            "baseline": self.baseline.to_dict(),
            "parity": self.parity(),
            "speedup": self.speedup(),
            "acceptance": None
            if change is None
            else {**change.figures(), "failures": list(self.acceptance_failures())},
        }


def run_paired(
    mtp: Endpoint,
    baseline: Endpoint,
    config: BenchConfig,
    progress: Progress | None = None,
    tolerance: acceptance.Tolerance | None = None,
) -> PairedResult:
    """Interleave MTP and baseline request by request, alternating which goes first.

    Interleaving spreads any drift of the host (thermal, other load) over both sides; the
    servers are separate, so neither's counters see the other's requests.
    """
    if mtp.model != baseline.model:
        raise UsageError(f"the endpoints serve different models ({mtp.model} vs {baseline.model})")
    mm, bm = _Measurer(mtp, config), _Measurer(baseline, config)
    try:
        mm.warm_up(progress)
        bm.warm_up(progress)
        m0, b0 = mm.observer.snapshot(), bm.observer.snapshot()
        mrec, brec = [], []
        for i, (pset, prompt, mt, run) in enumerate(_items(config)):
            order = (mm, bm) if i % 2 == 0 else (bm, mm)
            for who in order:
                rec = who.measure(pset, prompt, mt, run)
                (mrec if who is mm else brec).append(rec)
                if progress:
                    progress(1)
        m_end, b_end = mm.observer.snapshot(), bm.observer.snapshot()
    finally:
        mm.close()
        bm.close()
    return PairedResult(
        EndpointResult(mtp, mrec, specdecode.delta(m0, m_end)),
        EndpointResult(baseline, brec, specdecode.delta(b0, b_end)),
        config.temperature,
        tolerance or acceptance.Tolerance(),
    )
