"""Root span contexts made ahead, on the agent's thread, for calls that start a trace.

A call with no parent span needs, before its request goes out, fresh ids, a span context, the
non-recording stand-in that is current while the SDK sends (:meth:`.calls.Call._placeholder`),
the context that holds it and its ``traceparent``. Made on the caller's thread just after it
slept through the last call, that is a fifth of the agent's CPU there (issue 56 §2); made a few
at a time on the agent's thread, with its batch of span ends, it is a small part of that batch.
The caller takes one ready (a deque's ``popleft``: no lock) and makes its own only when none is
left (a process's first calls, a burst past the pool).

Only where taking one ahead changes nothing: the SDK's own random id generator (an id generator
of another kind may encode the time, as X-Ray's does) and the SDK's default sampler, whose
decision for a root is "sampled" whenever it is taken. A forked child empties its pools: its ids
must not repeat its parent's.
"""

from __future__ import annotations

import collections
import os
import sys
import weakref

from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

# A ready root: its span context, its stand-in span, its traceparent header value, and the
# context the send runs in (the stand-in current in an empty context: a root call's).
Root = tuple[SpanContext, NonRecordingSpan, str, Context]


class RootPool:
    """Up to ``SIZE`` ready roots of one tracer (its id generator ``gen``, its flags)."""

    SIZE = 32

    def __init__(self, gen, flags: int) -> None:
        self._gen = gen
        self._flags = TraceFlags(flags)
        self._ready: collections.deque[Root] = collections.deque()
        _pools.add(self)

    def take(self) -> Root | None:
        """A ready root, or ``None`` when the pool is empty (the caller makes its own)."""
        try:
            return self._ready.popleft()
        except IndexError:
            return None

    def fill(self) -> None:
        """Top the pool up (on the agent's thread)."""
        ready, gen, flags = self._ready, self._gen, self._flags
        while len(ready) < self.SIZE:
            sc = SpanContext(gen.generate_trace_id(), gen.generate_span_id(), False, flags)
            span = NonRecordingSpan(sc)
            ready.append((sc, span, traceparent(sc), set_span_in_context(span, Context())))

    def clear(self) -> None:
        self._ready.clear()


def traceparent(sc: SpanContext) -> str:
    """``sc``'s W3C ``traceparent`` value, as the W3C propagator writes it."""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"


_pools: weakref.WeakSet[RootPool] = weakref.WeakSet()


def _after_fork() -> None:
    for pool in list(_pools):
        pool.clear()


os.register_at_fork(after_in_child=_after_fork)


def pool_for(gen, flags: int) -> RootPool | None:
    """A pool for a tracer under the SDK's default sampler whose id generator is ``gen``, or
    ``None`` where ids made ahead could differ from ids made at the call (the module's
    docstring)."""
    # The SDK is the application's to install: a tracer of another kind has no pool.
    sdk_ids = sys.modules.get("opentelemetry.sdk.trace.id_generator")
    if sdk_ids is None or type(gen) is not sdk_ids.RandomIdGenerator:
        return None
    return RootPool(gen, flags)
