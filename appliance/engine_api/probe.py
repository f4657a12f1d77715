"""The one answer to "is MTP working on this server, and what did it see?".

A probe reads the speculative-decoding counters (the filtered read, :meth:`VLLMClient.snapshot`),
sends one real generation (with the API key), reads the counters again, and judges:

- ``active``: speculative decoding made drafts for the generation (``accepted`` may still be 0: a
  drafter that does not fit its target);
- ``idle``: the server has the counters, but made no drafts for a real generation;
- ``absent``: the server has no speculative decoding (no counters at all, not "zero");
- ``reset``: the counters went backwards or the server was replaced between the reads;
- ``unreadable`` / ``unparsable``: ``/metrics`` could not be read / is not vLLM's;
- ``failed``: the generation itself failed (a generation turned away at the engine's queue
  bound is sent again until the probe's ``within`` passes: :mod:`appliance.engine_api.shed`);
- ``present``: counters exist, but no generation was sent (``generate=False``).

The figures are :func:`specdecode.attribute`'s: the response's per-request block when the
server sends one, else the counter delta (``shared`` when other requests ran meanwhile). Doctor,
the cutover gates and bench all judge through here, so they agree on the same engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from ..errors import EngineError, NotVLLMError, OverloadedError
from . import shed, specdecode
from .vllm_client import Generation, VLLMClient

State = Literal[
    "active", "idle", "absent", "reset", "unreadable", "unparsable", "failed", "present"
]
Stage = Literal["before", "generation", "after"]

# The figures of Delta.to_dict(), without its status.
FIGURES = tuple(k for k in specdecode.Delta("absent").to_dict() if k != "status")
PROMPT = "The appliance checks that speculative decoding works. Say hello."
MAX_TOKENS = 16
# How long a probe sends its generation again while the engine turns it away at its bound.
WITHIN_S = 60.0


@dataclass(frozen=True)
class Probe:
    """What one probe saw, and its verdict."""

    state: State
    model: str
    source: specdecode.Source | None = None  # None when nothing was attributed
    figures: specdecode.Delta | None = None  # the figures the source gives
    counters: specdecode.Delta | None = None  # the /metrics delta, whatever the source
    generation: Generation | None = None
    running: float | None = None  # the running-requests gauge at the first read
    stage: Stage | None = None  # where a failure happened
    error: str | None = None
    exc: EngineError | None = field(default=None, repr=False, compare=False)
    shed: int = 0  # generations the engine turned away at its queue bound before this one

    def raise_for_failure(self) -> Probe:
        """Raise the failure's EngineError (for callers that stop on one); else ``self``."""
        if self.exc is not None:
            raise self.exc
        return self

    @property
    def working(self) -> bool:
        """True when speculative decoding made drafts for the generation."""
        return self.state == "active"

    @property
    def per_request(self) -> bool:
        """True when the server sent the per-request speculative-decoding block."""
        return self.generation is not None and self.generation.spec is not None

    @property
    def completion_tokens(self) -> int | None:
        return self.generation.completion_tokens if self.generation else None

    def summary(self) -> str:
        """One line: the verdict and its figures (or the error)."""
        f = self.figures
        if self.state == "active":
            return (
                f"MTP active: drafts {f.drafts}, draft tokens {f.draft_tokens}, accepted "
                f"{f.accepted}, acceptance {_f(f.acceptance)}, "
                f"{_f(f.tokens_per_step)} tokens/step ({self.source})"
            )
        return {
            "idle": "MTP idle: counters present but no drafts for a real generation",
            "absent": "MTP absent: no speculative-decoding counters",
            "reset": "counters reset during the probe (server restarted?)",
            "present": "speculative-decoding counters present (no generation sent)",
        }.get(self.state) or f"{self.state}: {self.error}"

    def evidence(self) -> dict:
        """The probe's evidence for a report: verdict, figures under vLLM's names, provenance."""
        ev: dict = {"state": self.state, "model": self.model, "source": self.source}
        figures = dict.fromkeys(FIGURES) if self.figures is None else self.figures.to_dict()
        ev |= {k: figures[k] for k in FIGURES}  # the state says more than the delta's status
        ev |= {
            "completion_tokens": self.completion_tokens,
            "per_request": self.per_request,
            "other_requests_running": self.running or 0,
            "shed": self.shed,
        }
        if self.error:
            ev |= {"stage": self.stage, "error": self.error}
        return ev


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def judge(
    model: str, before: specdecode.Snapshot, gen: Generation, after: specdecode.Snapshot
) -> Probe:
    """The verdict on one generation between two counter reads."""
    counters = specdecode.attribute(before, after, model)
    att = specdecode.attribute(before, after, model, request=gen.spec) if gen.spec else counters
    f = att.delta
    if f.status == "absent":
        state: State = "absent"
    elif f.status == "reset":
        state = "reset"
    else:
        state = "active" if f.drafts else "idle"
    return Probe(state, model, att.source, f, counters.delta, gen, before.running)


def observe(client: VLLMClient, model: str, send: Callable[[], Generation]) -> Probe:
    """Read, ``send()`` one generation, read again, judge. Raises EngineError on any failure."""
    before = client.snapshot()
    gen = send()
    return judge(model, before, gen, client.snapshot())


def _failure(
    model: str,
    stage: Stage,
    exc: EngineError,
    gen: Generation | None = None,
    running: float | None = None,
    shed: int = 0,
) -> Probe:
    if stage == "generation":
        state: State = "failed"
    else:  # a page that answers but is not vLLM's is another fault than no page at all
        state = "unparsable" if isinstance(exc, NotVLLMError) else "unreadable"
    return Probe(
        state,
        model,
        generation=gen,
        running=running,
        stage=stage,
        error=str(exc),
        exc=exc,
        shed=shed,
    )


def run(
    client: VLLMClient,
    model: str,
    *,
    generate: bool = True,
    prompt: str = PROMPT,
    max_tokens: int = MAX_TOKENS,
    timeout: float | None = None,
    within: float = WITHIN_S,
    tally: shed.Tally | None = None,
) -> Probe:
    """Probe the server behind ``client`` with one greedy generation of ``model``.

    A generation turned away at the queue bound is sent again (the counters read again before
    it) until ``within`` seconds have passed, counted in ``tally`` (give one to hear its notes)
    and in :attr:`Probe.shed`. Never raises for what the server does: a failure is a verdict
    (``unreadable``, ``unparsable``, ``failed``) with the stage and the error.
    """
    deadline = time.monotonic() + within
    tally = shed.Tally() if tally is None else tally
    while True:
        try:
            before = client.snapshot()
        except EngineError as exc:
            return _failure(model, "before", exc, shed=tally.shed)
        if not generate:
            state: State = "present" if before.speculative else "absent"
            return Probe(state, model, running=before.running)
        try:
            gen = client.generate(model, prompt, max_tokens, timeout=timeout)
            tally.answered()
            break
        except OverloadedError as exc:
            try:
                tally.again(exc, deadline)
            except shed.TurnedAway as out:
                return _failure(model, "generation", out, running=before.running, shed=tally.shed)
        except EngineError as exc:
            return _failure(model, "generation", exc, running=before.running, shed=tally.shed)
    try:
        after = client.snapshot()
    except EngineError as exc:
        return _failure(model, "after", exc, gen, before.running, tally.shed)
    return replace(judge(model, before, gen, after), shed=tally.shed)
