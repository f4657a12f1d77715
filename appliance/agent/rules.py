"""Which MTP figures belong to one call, and where they came from: the rules, pure functions.

Order of preference (see adr/0006-telemetry-agent.md):

1. The response's own ``metrics.speculative_decoding`` block (vLLM >= 0.29 with
   ``--per-request-spec-decode-metrics``): exact, immune to overlap and restarts, no extra HTTP
   request. Source ``request`` (:func:`from_response`).
2. The ``/metrics`` counter delta between a reading that holds none of the call's tokens
   (:meth:`.server.Server.before`) and one taken after the call ended (:func:`from_readings`).
   Exact (source ``counters``) only when the window provably held this call alone; otherwise
   ``shared``. The proof (:func:`only_this_call`): no other call of this process overlapped it;
   exactly one request finished in the window (``vllm:request_success_total``, every finish
   reason); and the server's ``vllm:generation_tokens_total`` moved by exactly this call's own
   ``usage.completion_tokens``. Every verification step yields at least one token, so another
   request's drafts in the window would have moved that counter past the call's usage. Without
   usage (a stream without ``include_usage``), nothing may be running at either read.
3. ``absent`` when the server has no speculative decoding; ``unknown`` when the figures cannot
   be known (a read failed, or the counters reset between the reads).

Where the readings come from, and when they are taken: :mod:`.server` and :mod:`.worker`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine_api import specdecode
from ..engine_api.metrics_reader import Reading


@dataclass(frozen=True)
class Figures:
    """One call's MTP figures (vLLM's names) and their provenance."""

    source: str  # request | counters | shared | absent | unknown
    status: str  # ok | absent | reset | failed | skipped | missing | abandoned | call_failed
    shared: bool = False
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted: int | None = None
    acceptance: float | None = None
    tokens_per_step: float | None = None
    per_position: tuple[float, ...] | None = None

    @property
    def exact(self) -> bool:
        return self.source in ("request", "counters")

    @property
    def counts(self) -> specdecode.Delta:
        """The counts behind the figures, to add calls up with :func:`specdecode.summed`."""
        status = "absent" if self.drafts is None else "ok"
        return specdecode.Delta(status, self.drafts, self.draft_tokens, self.accepted)

    @classmethod
    def from_delta(cls, d: specdecode.Delta, source: str, shared: bool = False) -> Figures:
        # The ratios by specdecode's functions directly (Delta's properties add a call each).
        drafts, accepted = d.drafts, d.accepted
        return cls(
            source=source,
            status=d.status,
            shared=shared,
            drafts=drafts,
            draft_tokens=d.draft_tokens,
            accepted=accepted,
            acceptance=specdecode.acceptance(accepted, d.draft_tokens),
            tokens_per_step=specdecode.tokens_per_step(accepted, drafts),
            per_position=specdecode.per_position(d.accepted_per_pos, drafts),
        )


UNKNOWN_FAILED = Figures("unknown", "failed")
UNKNOWN_SKIPPED = Figures("unknown", "skipped")


@dataclass(eq=False)
class Timed:
    """A reading with when its request went out and when its answer was complete (monotonic).

    ``clean_from``: the reading holds no token of any request sent after this time. ``got`` (the
    page was complete) unless :meth:`.server.Server.certify` proved an earlier time.
    """

    reading: Reading
    sent: float
    got: float
    clean_from: float = 0.0

    def __post_init__(self) -> None:
        self.clean_from = self.clean_from or self.got


def from_response(extra: dict | None) -> Figures | None:
    """Exact figures from a response body's extra fields, or ``None`` when it has none."""
    d = specdecode.from_response_metrics(extra)
    return None if d is None else Figures.from_delta(d, "request")


def only_this_call(
    before: Timed, after: Timed, output_tokens: int | None, overlapped: bool
) -> bool:
    """True when the window between the two readings provably held this call alone.

    ``before`` holds none of the call's tokens and ``after`` was taken after it ended (the
    caller picks them so). See the module docstring for the rule. With usage, the running gauge
    does not matter: a request still running at either read with no token inside the window has
    no drafts inside it, and one with a token there moves the token counter past the usage.
    """
    b, a = before.reading, after.reading
    if overlapped:
        return False
    if b.finished_requests is None or a.finished_requests is None:
        return False
    if a.finished_requests - b.finished_requests != 1:
        return False
    if (
        output_tokens is not None
        and b.generation_tokens is not None
        and a.generation_tokens is not None
    ):
        # Every verification step yields tokens: any other request's drafts in the window
        # would have moved this counter past the call's own usage.
        return a.generation_tokens - b.generation_tokens == output_tokens
    # Without usage: nothing running at either read and one request finished in between.
    return b.snapshot.running == 0 and a.snapshot.running == 0


def from_readings(
    before: Timed | None,
    after: Timed | None,
    model: str | None,
    *,
    overlapped: bool,
    output_tokens: int | None,
) -> Figures:
    """Figures from the readings around a call (see the module docstring for the rules)."""
    if before is None or after is None:
        return UNKNOWN_FAILED
    alone = only_this_call(before, after, output_tokens, overlapped)
    # The one rule (specdecode.attribute), with this agent's stronger proof of being alone: it
    # already accounts for requests running at either read (only_this_call), and the request
    # running at a certified before-reading may be this very call.
    att = specdecode.attribute(
        before.reading.snapshot, after.reading.snapshot, model, overlapped=not alone, alone=alone
    )
    if att.source == "absent":
        return Figures("absent", "absent")
    if att.source == "unknown":
        return Figures("unknown", "reset")
    return Figures.from_delta(att.delta, att.source, shared=att.source == "shared")
