"""Record what one endpoint answers to the canary set, greedily, and save it as JSON.

A record keeps, per case, the answer's text, its output token ids, ``usage.completion_tokens``,
whether its check passed, and the seconds it took; and, for the whole run, the engine's vLLM
version (``/version``), the image (when the caller knows it), the settings and the time taken.
Cases run one at a time (concurrency 1): batching changes numerics on a GPU, and the canary
compares like with like. With ``batched``, the set then runs a second time with every case sent
at once, so the engine decodes them in one batch (``Record.batched``): a defect that mixes
answers across the sequences of a batch (vLLM #46088, ``--kv-cache-dtype auto`` with MTP) shows
only there, and :func:`appliance.canary.compare.batched` judges those answers against the same
engine's answers alone. A prompt the engine turns away at its queue bound (503: it is serving
other clients) is sent again within the canary's bound (:mod:`appliance.engine_api.shed`), and the
record says how many were (``Record.shed``).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import records
from ..engine_api import shed, specdecode
from ..engine_api.vllm_client import Generation, VLLMClient
from ..errors import EngineError, UsageError
from ..fsutil import write_atomic
from .cases import CanarySet, Case

FORMAT = "appliance-canary-record/1"
DEFAULT_MAX_TOKENS = 64
DEFAULT_SEED = 0
# The whole set, one prompt at a time: a 31B model answers the 14 shipped prompts in about a
# minute; five is a hung engine, not a slow one.
DEFAULT_WITHIN_S = 300.0
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    """How the set was run: greedy, with a fixed seed and a fixed output length."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = DEFAULT_SEED
    temperature: float = 0.0  # the canary is greedy by definition; kept so a record says so

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise UsageError(f"canary max_tokens must be at least 1, not {self.max_tokens}")
        if self.temperature != 0.0:
            raise UsageError("the canary runs at temperature 0 only (greedy, comparable)")


@dataclass(frozen=True)
class SpecFigures:
    """How one answer was made: the speculative decoding behind it. ``source`` is ``request``
    (the response's own block, vLLM 0.32 with per-request metrics) or ``counters`` (the
    engine's counters around the case; exact, as the canary runs one prompt at a time)."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]
    source: str

    @property
    def acceptance(self) -> float | None:
        return specdecode.acceptance(self.accepted, self.draft_tokens)

    @property
    def tokens_per_step(self) -> float | None:
        return specdecode.tokens_per_step(self.accepted, self.drafts)

    @property
    def delta(self) -> specdecode.Delta:
        """The figures as a counter movement, for the arithmetic and judgements that take one."""
        return specdecode.Delta(
            "ok", self.drafts, self.draft_tokens, self.accepted, self.accepted_per_pos
        )

    @classmethod
    def of(cls, delta: specdecode.Delta | None, source: str) -> SpecFigures | None:
        """The figures of a usable delta, else None (no speculative decoding, a reset)."""
        if delta is None or delta.status != "ok" or delta.drafts is None:
            return None
        return cls(
            delta.drafts,
            delta.draft_tokens or 0,
            delta.accepted or 0,
            tuple(delta.accepted_per_pos or ()),
            source,
        )


@dataclass(frozen=True)
class Output:
    """One case's answer. ``passed`` is None for a case without a check; ``spec`` None when the
    engine drafts nothing (no MTP) or the record is older than the figures."""

    id: str
    kind: str
    text: str
    token_ids: tuple[int, ...] | None
    completion_tokens: int
    finish_reason: str | None
    seconds: float
    passed: bool | None = None
    spec: SpecFigures | None = None


@dataclass(frozen=True)
class Record:
    """One run of the canary set against one endpoint."""

    url: str
    model: str
    vllm_version: str
    settings: Settings
    set_digest: str
    sources: tuple[str, ...]
    started: float
    seconds: float
    outputs: tuple[Output, ...]
    image: str | None = None
    profile: str | None = None
    # The batched pass: every case again, sent at once (empty: not run; older records).
    batched: tuple[Output, ...] = ()
    # Prompts the engine turned away at its queue bound and the canary sent again.
    shed: int = 0
    format: str = field(default=FORMAT)

    @property
    def tasks(self) -> int:
        return sum(o.passed is not None for o in self.outputs)

    @property
    def passed(self) -> int:
        return sum(o.passed is True for o in self.outputs)

    @property
    def pass_rate(self) -> float | None:
        """Share of checked cases that passed; None when the set has no checks."""
        return self.passed / self.tasks if self.tasks else None

    @property
    def seconds_per_prompt(self) -> float:
        return self.seconds / len(self.outputs) if self.outputs else 0.0

    def cost(self) -> str:
        """One line: what the run cost."""
        return (
            f"canary: {len(self.outputs)} prompts in {self.seconds:.1f} s "
            f"({self.seconds_per_prompt:.2f} s per prompt, max_tokens {self.settings.max_tokens}) "
            f"on vLLM {self.vllm_version}"
            + (f"; {shed.said(self.shed, 'prompt')} and sent again" if self.shed else "")
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def figures(self) -> dict:
        """The run without its answers (those are the record's file): what ``canary record
        --json`` prints beside the file it wrote."""
        facts = {k: v for k, v in self.to_dict().items() if k not in ("outputs", "batched")}
        return {**facts, "prompts": len(self.outputs), "tasks": self.tasks, "passed": self.passed}


def served_model(url: str, api_key: str | None = None) -> str:
    """The one model ``url`` serves; a UsageError when it serves several (name one)."""
    with VLLMClient(url, api_key=api_key) as c:
        ids = [m.id for m in c.models()]
    if len(ids) != 1:
        raise UsageError(
            f"{url} serves {len(ids)} models ({', '.join(ids) or 'none'})",
            fix="name the one to check with --model",
        )
    return ids[0]


def run(
    cset: CanarySet,
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    settings: Settings = Settings(),
    image: str | None = None,
    profile: str | None = None,
    progress: Progress | None = None,
    within: float = DEFAULT_WITHIN_S,
    batched: bool = False,
    at_once: int | None = None,
) -> Record:
    """Run every case of ``cset`` against ``url`` greedily and return the record; with
    ``batched``, then every case again at once (at most ``at_once`` in flight: the profile's
    ``max_num_seqs``, the most the engine batches). A prompt turned away at the queue bound is
    sent again; an EngineError when the whole takes longer than ``within`` seconds."""
    deadline = time.monotonic() + within
    with VLLMClient(url, api_key=api_key) as c:
        version = c.version()
        served = [m.id for m in c.models()]
    if model not in served:
        raise EngineError(
            f"{url} does not serve model {model!r} (it serves {', '.join(served) or 'nothing'})"
        )
    started = time.time()
    t0 = time.perf_counter()
    outputs = []
    per_request = False  # once the engine sends its own figures, no counters are read
    tally = shed.Tally("prompt", note=(lambda m: progress(f"  {m}")) if progress else None)
    with VLLMClient(url, api_key=api_key, timeout=within) as client:
        for case in cset.cases:
            if deadline <= time.monotonic():
                raise _too_slow(within, len(outputs), len(cset.cases), tally)
            try:
                ans, counters = _answer(
                    client, model, case, settings, deadline, tally, counted=not per_request
                )
            except shed.TurnedAway as out:
                raise _too_slow(within, len(outputs), len(cset.cases), tally, out) from None
            except EngineError:
                if time.monotonic() >= deadline:  # the request ran into the bound
                    raise _too_slow(within, len(outputs), len(cset.cases), tally) from None
                raise
            spec = SpecFigures.of(ans.spec, "request")
            per_request = per_request or spec is not None
            if spec is None and counters is not None and (now := _counters(client)) is not None:
                spec = SpecFigures.of(specdecode.delta(counters, now), "counters")
            outputs.append(_output(case, ans, spec))
            if progress:
                mark = {True: "pass", False: "fail", None: "-"}[outputs[-1].passed]
                progress(
                    f"  {case.id}: {ans.completion_tokens} tokens, {ans.seconds:.2f} s, {mark}"
                )
    together: tuple[Output, ...] = ()
    if batched:
        if progress:
            progress(f"  all {len(cset.cases)} prompts at once (the batched pass)")
        together = _together(cset, url, model, api_key, settings, deadline, within, at_once, tally)
    return Record(
        url=client.base_url,
        model=model,
        vllm_version=version,
        settings=settings,
        set_digest=cset.digest(),
        sources=cset.sources,
        started=started,
        seconds=round(time.perf_counter() - t0, 3),
        outputs=tuple(outputs),
        image=image,
        profile=profile,
        batched=together,
        shed=tally.shed,
    )


def _together(
    cset: CanarySet,
    url: str,
    model: str,
    api_key: str | None,
    settings: Settings,
    deadline: float,
    within: float,
    at_once: int | None,
    tally: shed.Tally,
) -> tuple[Output, ...]:
    """Every case sent at once (``at_once`` at most in flight), answered in one batch; one
    turned away at the queue bound (the batch's own excess, or other traffic) is sent again,
    counted in ``tally``."""
    cases = cset.cases
    workers = max(1, min(len(cases), at_once or len(cases)))

    def ask(case):
        own = shed.Tally("prompt")  # each thread its own backoff; the counts add up below
        try:
            if deadline <= time.monotonic():
                raise too_slow()
            return shed.retry(
                lambda: _ask(client, model, case, settings, deadline - time.monotonic()),
                deadline,
                own,
            )
        except shed.TurnedAway as out:
            raise too_slow(f": {out.message}") from None
        finally:
            with lock:
                tally.shed += own.shed

    def too_slow(why: str = "") -> EngineError:
        return EngineError(
            f"the canary's batched pass did not finish within {within:.0f} s{why}",
            fix="raise --canary-timeout, or find out why the engine answers so slowly",
        )

    lock = threading.Lock()

    with (
        VLLMClient(url, api_key=api_key, timeout=within) as client,
        concurrent.futures.ThreadPoolExecutor(workers) as pool,
    ):
        answers = list(pool.map(ask, cases))
    # Only the response's own figures: the counters hold the whole batch's drafts.
    return tuple(
        _output(case, ans, SpecFigures.of(ans.spec, "request"))
        for case, ans in zip(cases, answers, strict=True)
    )


def _answer(
    client: VLLMClient,
    model: str,
    case: Case,
    settings: Settings,
    deadline: float,
    tally: shed.Tally,
    *,
    counted: bool,
) -> tuple[Generation, specdecode.Snapshot | None]:
    """One case's answer, asked again while the engine turns it away at its queue bound, and
    (``counted``) the counters read just before the try it answered: around the answer, not
    around the waits."""

    def attempt():
        counters = _counters(client) if counted else None
        return _ask(client, model, case, settings, deadline - time.monotonic()), counters

    return shed.retry(attempt, deadline, tally)


def _ask(client: VLLMClient, model: str, case: Case, settings: Settings, left: float) -> Generation:
    """One case's greedy answer, with its token ids, within ``left`` seconds."""
    return client.generate(
        model,
        list(case.messages),
        settings.max_tokens,
        temperature=0.0,
        seed=settings.seed,
        token_ids=True,
        timeout=left,
    )


def _output(case: Case, ans: Generation, spec: SpecFigures | None) -> Output:
    """A case's answer as the record keeps it, its check judged."""
    return Output(
        id=case.id,
        kind=case.kind,
        text=ans.text,
        token_ids=ans.token_ids,
        completion_tokens=ans.completion_tokens,
        finish_reason=ans.finish_reason,
        seconds=ans.seconds,
        passed=case.check.passes(ans.text) if case.check is not None else None,
        spec=spec,
    )


def _counters(client: VLLMClient) -> specdecode.Snapshot | None:
    """The engine's speculative-decoding counters now; None when they cannot be read (the
    answers are the canary's first job: their figures are a second one)."""
    try:
        return client.snapshot()
    except EngineError:
        return None


def _too_slow(
    within: float,
    answered: int,
    cases: int,
    tally: shed.Tally,
    turned: shed.TurnedAway | None = None,
) -> EngineError:
    what = (
        f"the canary did not finish within {within:.0f} s ({answered} of {cases} prompts answered)"
    )
    if turned is not None:
        what += f": {turned.message}"
    elif tally.shed:
        what += f"; {tally.summary()}"
    return EngineError(
        what, fix="raise --canary-timeout, or find out why the engine answers so slowly"
    )


def save(record: Record, path: Path | str) -> Path:
    """Write ``record`` as JSON, atomically (a reader never sees half a record), owner-only:
    it holds the model's answers to the operator's prompts."""
    body = json.dumps(record.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return write_atomic(path, body, mode=0o600)


def load(path: Path | str) -> Record:
    """Read a record written by :func:`save`; anything else is a UsageError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise UsageError(f"canary record {path} does not exist") from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"cannot read canary record {path}: {exc}") from exc
    return from_dict(data, f"{path} is not a canary record")


def from_dict(data: dict, where: str = "canary record") -> Record:
    """A :class:`Record` from its JSON form; anything else is a UsageError naming ``where`` and
    the field (the check is pydantic's, strict: see :mod:`appliance.records`)."""
    fix = "write one with `appliance canary record`"
    record = records.from_dict(Record, records.require(data, "format", FORMAT, where, fix), where)
    if not record.outputs:
        raise UsageError(f"{where}: outputs: none", fix=fix)
    return record
