"""A request the engine turned away at its queue bound is "try again", not a verdict.

Past ``--max-num-queued-reqs`` (or ``--max-num-queued-tokens``) vLLM answers at once with 503
"The engine is currently busy" (``QueueOverflowError`` in vllm/exceptions.py, raised by the
admission check in vllm/v1/engine/async_llm.py); a streamed request turned away after its
response started gets an error event with code 503 instead (vLLM #58192). Both reach the
appliance as :class:`~appliance.errors.OverloadedError` (:mod:`appliance.engine_api.vllm_client`).
An engine at its bound is serving, so everything that judges one (the cutover's gates and its way
back, doctor, the canary, a multi-node head's probes) asks again here: after a short backoff
(the server's ``Retry-After`` when it sends one), until the caller's own deadline, counting
what was shed; only a deadline that passes while every try is turned away fails, and says so
(:class:`TurnedAway`).

Use :func:`retry` around one call, or :meth:`Tally.again` in a loop of one's own (a probe
that re-reads its counters before each try).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import EngineError, OverloadedError

T = TypeVar("T")

# The first pause after a shed try, doubled each time up to the most: a bound frees a place as
# soon as one request in flight ends (a fraction of a second on a small model, seconds on a 31B
# one), and a few tries a second cost the engine little (turned away before they are scheduled).
# A freed place goes to whichever request arrives first: at 2 s a try, `instance doctor` lost
# every one for its 60 s to six clients retrying each 0.5 s at a bound of 2 (benchmarks/
# traffic.py); OpenAI's and Anthropic's client SDKs wait 0.5 s and more before a retry.
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 0.5
# How often a caller's note hears that its tries are still turned away.
NOTE_EVERY_S = 15.0
FIX = (
    "the engine is serving at its queue bound: allow more time, wait for less traffic, or add "
    "capacity (gotchas/queue-bound.md)"
)


class TurnedAway(EngineError):
    """Every try until the deadline was turned away at the queue bound; ``tally`` says how
    many and for how long. Not an :class:`OverloadedError`: there is no "again" left."""

    def __init__(self, tally: Tally, seconds: float) -> None:
        last = tally.last.message if tally.last is not None else "503"
        super().__init__(
            f"turned away at the queue bound for {seconds:.0f} s ({tally.summary()}): {last}",
            fix=FIX,
        )
        self.tally = tally
        self.seconds = seconds


@dataclass
class Tally:
    """The tries of one caller that the engine shed, and the rule for the next one.

    ``what`` names a try in the summary (``3 probes shed at the queue bound``); ``note``, when
    given, hears on the first shed try and then every :data:`NOTE_EVERY_S` seconds."""

    what: str = "probe"
    note: Callable[[str], None] | None = None
    shed: int = 0
    since: float | None = None  # time.monotonic() of the first shed try
    last: OverloadedError | None = None
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    _pause: float = field(default=FIRST_BACKOFF_S, init=False, repr=False)
    _noted: float | None = field(default=None, init=False, repr=False)

    def again(self, exc: OverloadedError, deadline: float) -> None:
        """Count ``exc`` and wait before the next try: the backoff, or the server's
        ``Retry-After``. :class:`TurnedAway` when that wait would reach ``deadline`` (a
        ``time.monotonic()`` value): no try is left that could still be answered in time."""
        now = time.monotonic()
        self.shed += 1
        self.last = exc
        if self.since is None:
            self.since = now
        pause = exc.retry_after if exc.retry_after is not None else self._pause
        if now + pause >= deadline:
            raise TurnedAway(self, now - self.since) from exc
        self._pause = min(2 * self._pause, MAX_BACKOFF_S)
        if self.note is not None and (self._noted is None or now - self._noted >= NOTE_EVERY_S):
            self._noted = now
            self.note(f"{self.summary()}, trying again")
        self.sleep(pause)

    def answered(self) -> None:
        """A try got through: the next shed try of this caller waits the shortest pause again
        (a caller of many calls, kept at the longest, loses each freed place to clients that
        retry sooner)."""
        self._pause = FIRST_BACKOFF_S

    def summary(self) -> str:
        """``3 probes shed at the queue bound`` (``no probe shed ...`` when none was)."""
        return said(self.shed, self.what)


def said(count: int, what: str = "probe") -> str:
    """``3 probes shed at the queue bound``: how every report says it."""
    if not count:
        return f"no {what} shed at the queue bound"
    return f"{count} {what}{'' if count == 1 else 's'} shed at the queue bound"


def noted(count: int, what: str = "probe") -> str:
    """``"; 3 probes shed at the queue bound"`` to end a line that passed; empty for none."""
    return f"; {said(count, what)}" if count else ""


def retry_after(value: str | None) -> float | None:
    """The seconds a ``Retry-After`` header asks for (its delay-seconds form); None when there
    is none, or it is a date (vLLM 0.32 sends none with its 503; a proxy or a stop may)."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def retry(call: Callable[[], T], deadline: float, tally: Tally | None = None) -> T:
    """``call()``, asked again while the engine turns it away at its queue bound
    (:class:`OverloadedError`) until ``deadline`` (``time.monotonic()``); then
    :class:`TurnedAway`. Every other error is ``call``'s own and passes at once."""
    tally = Tally() if tally is None else tally
    while True:
        try:
            answer = call()
        except OverloadedError as exc:
            tally.again(exc, deadline)
        else:
            tally.answered()
            return answer
