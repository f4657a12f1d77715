"""One instrumented call's lifecycle: window, snapshots, span, figures, metrics, record.

Every method here swallows its own failures (counted as ``gemma4_agent_errors_total``): the
caller only ever sees the bare client's result or exception. :meth:`Call.finish` runs once.
"""

from __future__ import annotations

import contextvars
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import baggage, context, propagate, trace
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from .. import __version__
from ..engine_api import specdecode
from ..engine_api.vllm_client import normalise_base_url
from . import roots, rules, spans
from .config import AgentConfig
from .metrics import AgentMetrics, OTelMetrics, otel_for
from .responses import NO_BLOCK, Reader
from .rules import Figures
from .server import Server, Window, server_for
from .worker import WORKER

_role: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "appliance_agent_role", default=None
)


@dataclass(frozen=True)
class CallRecord:
    """What the agent learned about one call (handed to ``on_call`` callbacks)."""

    role: str
    operation: str
    model: str | None
    stream: bool
    outcome: str  # ok | error | rejected (the engine turned the call away: HTTP 503)
    error_type: str | None
    duration_s: float
    time_to_first_chunk_s: float | None
    input_tokens: int | None
    output_tokens: int | None
    chunks: int | None
    finish_reasons: tuple[str, ...]
    figures: Figures
    response_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Settings:
    """What one instrumented client shares with all its calls."""

    config: AgentConfig
    tracer: trace.Tracer
    metrics: AgentMetrics
    server: Server
    address: str | None
    port: int | None
    role: str
    on_call: Callable[[CallRecord], None] | None = None
    otel: OTelMetrics | None = None  # the meter API's instruments (the global provider's)
    # The meter API's attribute dicts by (operation, role, model, response model): built once,
    # never changed after (an SDK aggregation may keep the dict it was given).
    otel_attrs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.otel is None:
            self.otel = otel_for(None)
        # An SDK tracer (its sampler and id generator public): the span is started on the
        # agent's thread with the ids the caller sent in ``traceparent`` (:class:`PresetIds`).
        gen = getattr(self.tracer, "id_generator", None)
        self.deferred_start = gen is not None and hasattr(self.tracer, "sampler")
        if self.deferred_start and not isinstance(gen, PresetIds):
            self.tracer.id_generator = PresetIds(gen)
        # The SDK's default sampler (ParentBased(ALWAYS_ON)): its decision is the parent's
        # sampled flag (a root is sampled), taken on the caller without calling it.
        sampling = sys.modules.get("opentelemetry.sdk.trace.sampling")
        self.default_sampler = self.deferred_start and (
            sampling is not None and self.tracer.sampler is getattr(sampling, "DEFAULT_ON", None)
        )
        self.roots = None
        if self.default_sampler:  # a root is sampled: its flags are known ahead
            inner = self.tracer.id_generator.inner
            flags = TraceFlags.SAMPLED | _random_flag(inner)
            self.roots = roots.pool_for(inner, flags)

    @classmethod
    def for_base(
        cls,
        base: str,
        config: AgentConfig,
        provider: trace.TracerProvider,
        agent_metrics: AgentMetrics,
        role: str,
        on_call: Callable[[CallRecord], None] | None,
        meter_provider=None,
    ) -> Settings:
        """The settings of every call to the server at ``base`` (the client's base URL);
        ``meter_provider``: the meter API's (the global one when ``None``)."""
        flush_first(provider)
        parts = urlsplit(base)
        metrics_url = normalise_base_url(config.metrics_url or base) + specdecode.SNAPSHOT_PATH
        return cls(
            config=config,
            tracer=provider.get_tracer("appliance.agent", __version__, schema_url=spans.SCHEMA_URL),
            metrics=agent_metrics,
            server=server_for(metrics_url),
            address=parts.hostname,
            port=parts.port or (443 if parts.scheme == "https" else 80),
            role=role,
            on_call=on_call,
            otel=otel_for(meter_provider),
        )


def _runtime_var() -> contextvars.ContextVar | None:
    """The ``ContextVar`` the OpenTelemetry API keeps the current context in, when its runtime
    context is the API's own contextvars one (the default ``OTEL_PYTHON_CONTEXT``); else None."""
    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

    runtime = getattr(context, "_RUNTIME_CONTEXT", None)
    var = getattr(runtime, "_current_context", None)
    if type(runtime) is ContextVarsRuntimeContext and isinstance(var, contextvars.ContextVar):
        return var
    return None


# The caller's context read, attached and detached: through the API's runtime context, each is
# two Python calls on the caller's thread (four of the six on a call's path: issue 56 §2), so
# where that runtime is the API's own contextvars one, its ContextVar directly (the same value,
# the same token); another runtime through the API's functions.
_VAR = _runtime_var()
if _VAR is not None:
    current_context, attach_context, detach_context = _VAR.get, _VAR.set, _VAR.reset
else:
    current_context, attach_context, detach_context = (
        context.get_current,
        context.attach,
        context.detach,
    )

_preset = threading.local()


def flush_first(provider) -> None:
    """Make ``provider.force_flush()`` and ``shutdown()`` (an SDK provider's) first run the
    agent's pending work (:func:`.worker.Worker.flush`, bounded by the call's own timeout or
    5 s): the spans of calls that have returned are ended on the agent's thread, and a program
    that shuts its provider down right after its last call still exports them."""
    for name in ("force_flush", "shutdown"):
        method = getattr(provider, name, None)
        if method is None or getattr(method, "_agent_flushes_first", False):
            continue
        if not hasattr(provider, "add_span_processor"):  # not the SDK's: nothing to wrap
            return

        def first(*args, _method=method, **kwargs):
            timeout_ms = kwargs.get("timeout_millis", args[0] if args else 5000)
            WORKER.flush(min(5.0, timeout_ms / 1000) if isinstance(timeout_ms, int) else 5.0)
            return _method(*args, **kwargs)

        first._agent_flushes_first = True
        setattr(provider, name, first)


class PresetIds:
    """The agent tracer's id generator: the ids set for this thread (a call whose span starts
    on the agent's thread, with the ids its ``traceparent`` carried), else the SDK's own."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def generate_span_id(self) -> int:
        ids = getattr(_preset, "ids", None)
        return ids[1] if ids else self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        ids = getattr(_preset, "ids", None)
        return ids[0] if ids else self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        # Its own method: through __getattr__, each span's start paid a failed lookup first.
        return self.inner.is_trace_id_random()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # any later addition


class Call(Reader):
    """One call through the agent, from before the request to the span's end."""

    # Made and written on the caller's thread every call: slots, one allocation and no
    # attribute dict (issue 56 §2).
    __slots__ = (
        "_done",
        "_error",
        "_fig",
        "_kwargs",
        "_later",
        "_readings",
        "_response",
        "chunks",
        "content",
        "ended",
        "ended_ns",
        "extra",
        "finish_reasons",
        "input_tokens",
        "model",
        "operation",
        "output_tokens",
        "parent_ctx",
        "response_id",
        "response_model",
        "role",
        "send_ctx",
        "settings",
        "span",
        "started",
        "stream",
        "ttfc",
        "usage_expected",
        "window",
    )

    def __init__(self, settings: Settings, operation: str, kwargs: dict) -> None:
        self.settings = settings
        self.operation = operation
        self.role = _role.get() or settings.role
        self.model = kwargs.get("model") if isinstance(kwargs.get("model"), str) else None
        self.stream = kwargs.get("stream") is True
        opts = kwargs.get("stream_options")
        # (None first: an ABC's isinstance is a Python call, on every call.)
        include_usage = (
            opts is not None and isinstance(opts, Mapping) and bool(opts.get("include_usage"))
        )
        # A stream without include_usage carries neither usage nor the per-request block; a
        # Responses stream always ends with a response.completed event that carries usage, an
        # Anthropic Messages stream with a message_delta event that does.
        self.usage_expected = not self.stream or include_usage or operation in NO_BLOCK
        self.response_model: str | None = None
        self.response_id: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.finish_reasons: list[str] = []
        self.extra: dict | None = None
        self.chunks = 0
        self.ttfc: float | None = None
        self.content: list[str] = []
        self._response: Any = None  # a response whose rest is read with the span (read_rest)
        self.window: Window | None = None
        self.span: trace.Span | None = None
        # A span started later, on the agent's thread (Settings.deferred_start): its context,
        # name, request attributes (None: from the kwargs then) and start time.
        self._later: tuple | None = None
        self.parent_ctx: context.Context | None = None  # the caller's context at the start
        self.send_ctx: context.Context | None = None  # the send's, when made ahead (.roots)
        self.started = time.perf_counter()
        self.ended = self.started
        self.ended_ns: int | None = None
        self._done = False
        self._kwargs = kwargs

    # -- start ---------------------------------------------------------------------------------
    def _open_window(self) -> None:
        """Open the call's window, and say whether it takes the counters path (snapshots)."""
        srv, mode = self.settings.server, self.settings.config.attribution
        if mode == "auto":
            # What the server taught about per-request figures holds for chat and completions;
            # the Responses and Messages APIs carry no block on vLLM 0.32: never skip the
            # counters there.
            per_request = srv.per_request and self.operation not in NO_BLOCK
            snapshots = not (per_request and self.usage_expected)
        else:
            snapshots = mode == "counters"
        if snapshots and (self.operation in NO_BLOCK or not self.usage_expected):
            # Not a server's first chat call, which reads only until it learns per_request.
            srv.counters_seen = True
        self.window = srv.begin(snapshots, quiet_before=not self.usage_expected)

    def _open_span(self) -> dict:
        kwargs = self._kwargs
        # The GenAI conventions name a Responses API or Anthropic Messages call "chat" too.
        op = "chat" if self.operation in NO_BLOCK else self.operation
        name = f"{op} {self.model}" if self.model else op  # spans.span_name, inline
        if self.settings.deferred_start:
            headers = self._placeholder(name, op)
        else:
            attrs = self._request_attributes(op)
            self.span = self.settings.tracer.start_span(
                name, kind=SpanKind.CLIENT, attributes=attrs
            )
            headers = _trace_headers(self.span, self.span.get_span_context())
        user = kwargs.get("extra_headers")
        # dict, httpx.Headers, any Mapping the SDK accepts (None first: see __init__)
        if user is not None and isinstance(user, Mapping):
            user = dict(user)
            mine = {k.lower() for k in user}
            headers = {k: v for k, v in headers.items() if k.lower() not in mine}  # theirs win
            headers.update(user)
        return {**kwargs, "extra_headers": headers}

    def _request_attributes(self, op: str) -> dict[str, Any]:
        return spans.request_attributes(
            op,
            self._kwargs,
            self.settings.address,
            self.settings.port,
            self.role,
            self.settings.config.capture_content,
        )

    def _placeholder(self, name: str, op: str) -> dict[str, str]:
        """The call's span context, made on the caller's thread: the ids (the SDK's generator),
        and the sampler's decision (made again, the same, when the span starts). The span
        itself starts on the agent's thread (:meth:`_started`); a non-recording stand-in
        (``self.span``) is what ``traceparent`` and any span started during the send (an HTTP
        instrumentation's) take as the parent. Returns the trace headers to send."""
        tracer = self.settings.tracer
        self.parent_ctx = ctx = current_context()
        if ctx:
            parent = trace.get_current_span(ctx).get_span_context()
            valid = parent.is_valid
        else:  # an empty context (a root call's usual one) holds no span: no lookups
            parent, valid = trace.INVALID_SPAN_CONTEXT, False
        pool = self.settings.roots
        ready = None if valid or pool is None else pool.take()
        if ready is not None:  # made ahead on the agent's thread (.roots)
            sc, span, header, root_ctx = ready
            if not ctx:  # a root call's usual empty context: the send's is made ahead too
                self.send_ctx = root_ctx
        else:
            gen = tracer.id_generator.inner
            if valid:
                trace_id, random_id = parent.trace_id, parent.trace_flags & _RANDOM_TRACE_ID
            else:
                trace_id, random_id = gen.generate_trace_id(), _random_flag(gen)
            span_id = gen.generate_span_id()
            if self.settings.default_sampler:
                is_sampled = parent.trace_flags.sampled if valid else True
                trace_state = parent.trace_state if valid else None
            else:
                result = tracer.sampler.should_sample(ctx, trace_id, name, SpanKind.CLIENT)
                is_sampled, trace_state = result.decision.is_sampled(), result.trace_state
            flags = TraceFlags(
                (TraceFlags.SAMPLED if is_sampled else TraceFlags.DEFAULT) | random_id
            )
            sc = SpanContext(trace_id, span_id, False, flags, trace_state)
            span, header = trace.NonRecordingSpan(sc), None
        # Captured text is read now: the caller may change its messages after the call.
        attrs = self._request_attributes(op) if self.settings.config.capture_content else None
        self._later = (ctx, name, op, attrs, time.time_ns())
        self.span = span
        return _trace_headers(span, sc, ctx, header)

    def _started(self, fig: Figures | None = None) -> trace.Span | None:
        """On the agent's thread: the SDK span of a call whose start was deferred, with the
        ids its placeholder gave out (the tracer's :class:`PresetIds`), started with the
        request's attributes and, given ``fig``, the end's (one start with every attribute
        costs the SDK one attribute set, not a second pass through ``set_attributes``)."""
        if self._later is None:
            return self.span
        ctx, name, op, attrs, start_ns = self._later
        self._later = None
        attributes = attrs if attrs is not None else self._request_attributes(op)
        if fig is not None:
            self._end_attributes(fig, attributes)  # into this dict of the call's own: no copy
        placeholder = self.span.get_span_context()
        _preset.ids = (placeholder.trace_id, placeholder.span_id)
        try:
            self.span = self.settings.tracer.start_span(
                name,
                context=ctx,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                start_time=start_ns,
            )
        finally:
            _preset.ids = None
        return self.span

    def start(self) -> dict:
        """Sync start; returns the kwargs to call with (the caller's own on any agent failure)."""
        try:
            self._open_window()
            kwargs = self._open_span()
            w = self.window
            if w.snapshots:
                cfg = self.settings.config
                self.settings.server.prepare(
                    w, self.settings.metrics, cfg.snapshot_timeout, cfg.failure_cooldown
                )
            self._sent()
            return kwargs
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            return self._kwargs
        except BaseException as exc:  # KeyboardInterrupt mid-read: end the span, then let it go
            self.finish(error=exc)
            raise

    async def astart(self) -> dict:
        try:
            self._open_window()
            kwargs = self._open_span()
            if self.window.snapshots:
                cfg = self.settings.config
                await self.settings.server.aprepare(
                    self.window, self.settings.metrics, cfg.snapshot_timeout, cfg.failure_cooldown
                )
            self._sent()
            return kwargs
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            return self._kwargs
        except BaseException as exc:  # CancelledError mid-read: end the span, then let it go
            self.finish(error=exc)
            raise

    # A call whose request is built before it goes out (the Anthropic SDK's ``messages.stream``
    # builds it at the call and sends it on entering its ``with`` block): the span is opened,
    # and ``traceparent`` put in the request, at :meth:`open`; the window at :meth:`send`.
    def open(self) -> dict:
        """Open the span alone; the kwargs to build the request with (``traceparent`` in)."""
        try:
            return self._open_span()
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            return self._kwargs

    def send(self) -> None:
        """Open the window just before the request goes out (after :meth:`open`)."""
        try:
            self._open_window()
            if self.window.snapshots:
                cfg = self.settings.config
                self.settings.server.prepare(
                    self.window, self.settings.metrics, cfg.snapshot_timeout, cfg.failure_cooldown
                )
            self._sent()
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
        except BaseException as exc:  # KeyboardInterrupt mid-read: end the span, then let it go
            self.finish(error=exc)
            raise

    async def asend(self) -> None:
        try:
            self._open_window()
            if self.window.snapshots:
                cfg = self.settings.config
                await self.settings.server.aprepare(
                    self.window, self.settings.metrics, cfg.snapshot_timeout, cfg.failure_cooldown
                )
            self._sent()
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
        except BaseException as exc:  # CancelledError mid-read: end the span, then let it go
            self.finish(error=exc)
            raise

    def _sent(self) -> None:
        self.started = time.perf_counter()
        self.window.sent = time.monotonic()

    def _agent_failed(self) -> None:
        self.settings.metrics.error("internal")

    # -- finish --------------------------------------------------------------------------------
    def _figures_without_after(self) -> tuple[Figures | None, bool]:
        """Figures from the response when it has them; (None, True) when a read is due."""
        mode = self.settings.config.attribution
        if mode == "off":
            return Figures("unknown", "skipped"), False
        if mode != "counters":
            if _has_block(self.extra):  # its figures are read on the agent's thread
                if self.operation not in NO_BLOCK:
                    self.settings.server.per_request = True
                return FROM_BLOCK, False
            if (
                mode == "auto"
                and self.operation not in NO_BLOCK
                and self.settings.server.per_request
                and not self.window.snapshots
            ):
                # It sent per-request figures before and not now (restarted without the flag?):
                # read counters again from the next call on.
                self.settings.server.per_request = False
        if self.window is not None and self.window.snapshots:
            return None, True
        return Figures("unknown", "missing"), False

    def finish(self, error: BaseException | None = None) -> None:
        """End of the call (sync or async: no waiting here). Once.

        When the figures need an after-read, it and everything after it (span end, metrics,
        ``on_call``) are queued for the agent's background thread; the caller returns at once.
        Otherwise the figures are known here, and the span end, metrics and record are handed to
        that thread without waking it (:meth:`.worker.Worker.defer`): what stays on the caller
        is the window's end (the overlap and the chain need it now) and the figures' source.
        """
        if self._done:
            return
        self._done = True
        self.ended = time.perf_counter()
        self.ended_ns = time.time_ns()
        deferred = False
        try:
            if self.window is not None:
                self.window.finished = time.monotonic()
                if error is None:  # a failed call's usage is unknown, its tokens may not be
                    self.window.tokens = self.output_tokens
            if error is not None:
                fig, read = UNKNOWN_ERROR, False
            else:
                fig, read = self._figures_without_after()
            srv = self.settings.server
            if self.window is not None:
                # The call is over at the server; its after-read, when due, counted pending.
                srv.end(self.window, after_read=read)
            if read:
                try:
                    if WORKER.offer(self._complete):
                        deferred = True
                        return
                except BaseException:  # Ctrl-C mid-offer: nothing left pending
                    srv.after_done()
                    raise
                # The worker's backlog is full: no figures rather than an unbounded queue.
                srv.after_done()
                self.settings.metrics.error("backlog")
                fig = rules.UNKNOWN_SKIPPED
            deferred = self._close_in_batch(fig, error)
            if (
                error is None
                and (fig is FROM_BLOCK or fig.source == "request")
                and self.settings.server.counters_seen  # (checked again there)
            ):
                self._read_for_next()  # now: a counters call right after starts from it
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
        finally:
            if not deferred:
                self._end_span_quietly()  # a no-op unless an interrupt cut _close short

    def _close_in_batch(self, fig: Figures, error: BaseException | None) -> bool:
        """Hand span end, metrics and record to the agent's next batch (:meth:`_close_later`);
        when the deferred backlog is full, close here instead. Whether it was handed over."""
        self._fig, self._error = fig, error
        if WORKER.defer(self._close_later):
            return True
        self._close(self._resolve_figures(fig), error)
        return False

    def _close_later(self) -> None:
        """On the background thread: span end, metrics and record of a call whose figures are
        known (``_fig``, ``_error``: set by :meth:`_close_in_batch`)."""
        try:
            self._close(self._resolve_figures(self._fig), self._error)
            if self.settings.roots is not None:
                self.settings.roots.fill()  # the next calls' roots, in this batch
        except Exception:  # noqa: BLE001 - telemetry never raises
            self._agent_failed()
        finally:
            self._end_span_quietly()

    def _resolve_figures(self, fig: Figures) -> Figures:
        """``fig``, or the figures it stands for: of the response's per-request block
        (:data:`FROM_BLOCK`), or of the readings around the call (:data:`FROM_READINGS`)."""
        if fig is FROM_BLOCK:
            return rules.from_response(self.extra) or Figures("unknown", "missing")
        if fig is FROM_READINGS:
            before, after = self._readings
            self.read_rest()  # the response's model names the page's series
            return rules.from_readings(
                before,
                after,
                self.response_model or self.model,
                overlapped=self.window.overlapped,
                output_tokens=self.output_tokens,
            )
        return fig

    def _read_for_next(self) -> None:
        """After a per-request call to a server that also has counters-path calls: a read on
        the agent's thread, certified by this call's usage (:meth:`.Server.certify`), so that a
        counters call right after it starts from that reading instead of reading a fresh one on
        its caller's path (a per-request call reads nothing, so the newest reading predates its
        end: :meth:`.Server.needs`)."""
        srv = self.settings.server
        if not srv.counters_seen or self.window is None or self.window.tokens is None:
            return
        srv.after_queued()
        try:
            if WORKER.offer(self._certify_read):
                return
        except BaseException:  # Ctrl-C mid-offer: nothing left pending
            srv.after_done()
            raise
        srv.after_done()  # the backlog is full: the next counters call reads for itself

    def _certify_read(self) -> None:
        """On the background thread: the read after a per-request call, certified if it can be."""
        try:
            cfg, srv = self.settings.config, self.settings.server
            try:
                after = srv.read(self.settings.metrics, cfg.snapshot_timeout, cfg.failure_cooldown)
            finally:
                srv.after_done()
            before = srv.before(self.window)
            srv.chained(before is not None and after is not None and srv.certify(before, after))
        except Exception:  # noqa: BLE001 - telemetry never raises
            self._agent_failed()

    async def afinish(self, error: BaseException | None = None) -> None:
        self.finish(error)

    def _complete(self) -> None:
        """On the background thread: the after-read and the figures now, then span, metrics and
        record with the next batch of deferred work (:class:`.worker.Worker`)."""
        deferred = False
        try:
            cfg, srv = self.settings.config, self.settings.server
            try:
                after = srv.read(self.settings.metrics, cfg.snapshot_timeout, cfg.failure_cooldown)
            finally:
                srv.after_done()
            w = self.window
            before = srv.before(w)
            # When the token counter proves it, the next call may start from this after-read
            # even if its request went out while the read was in flight (Server.certify).
            srv.chained(before is not None and after is not None and srv.certify(before, after))
            self._readings = (before, after)
            if srv.restarting(w):  # its restart wait learns from its figures now
                fig = self._resolve_figures(FROM_READINGS)
                srv.restarted(w, fig.exact)
            else:
                # The figures with the batch (FROM_READINGS): the readings are final, and that
                # arithmetic costs a few times more on this thread just woken (issue 56 §2).
                fig = FROM_READINGS
            deferred = self._close_in_batch(fig, None)
        except Exception:  # noqa: BLE001 - telemetry never raises
            self._agent_failed()
        finally:
            if not deferred:
                self._end_span_quietly()

    def abandon(self) -> None:
        """End the span of a stream dropped unread (on the background thread; no network)."""
        if self._done:
            return
        self._done = True
        self.ended = time.perf_counter()
        self.ended_ns = time.time_ns()
        deferred = False
        try:
            if self.window is not None:
                self.settings.server.end(self.window)
            deferred = self._close_in_batch(ABANDONED, None)  # records in call order
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
        finally:
            if not deferred:
                self._end_span_quietly()

    def _end_span_quietly(self) -> None:
        try:
            # (ended is set once, under the server's lock: True read without it is final.)
            if self.window is not None and not self.window.ended:
                self.settings.server.end(self.window)
            if self._later is not None:  # _close did not get to start it: the last resort
                self._started()
            if self.span is not None and self.span.is_recording():
                self.span.end(end_time=self.ended_ns)
        except Exception:  # noqa: BLE001, S110 - the last resort: nothing left to count with
            pass

    def _close(self, fig: Figures, error: BaseException | None) -> None:
        self.read_rest()
        duration = self.ended - self.started
        model = self.response_model or self.model
        if self._later is not None:  # the deferred start: with every attribute at once
            span = self._started(fig)
        else:
            span = self.span
            if span is not None:
                span.set_attributes(self._end_attributes(fig))
        if span is not None:
            if error is not None:
                spans.set_error(span, error, self.settings.config.capture_content)
            span.end(end_time=self.ended_ns)
        outcome = "ok" if error is None else "rejected" if spans.rejected(error) else "error"
        m = self.settings.metrics
        role, model_label = self.role, model or ""
        m.count(role, model_label, fig.source, outcome)
        m.of("duration", role, model_label).observe(duration)
        if fig.exact and error is None:
            if fig.acceptance is not None:
                m.of("acceptance", role, model_label).observe(fig.acceptance)
            if fig.tokens_per_step is not None:
                m.of("tokens_per_step", role, model_label).observe(fig.tokens_per_step)
            if fig.draft_tokens is not None:
                m.of("draft_tokens", role, model_label).inc(fig.draft_tokens)
            if fig.accepted is not None:
                m.of("accepted", role, model_label).inc(fig.accepted)
        self._record_otel(fig, error, duration)
        if self.settings.on_call is not None:
            record = CallRecord(
                role=self.role,
                operation=self.operation,
                model=model,
                stream=self.stream,
                outcome=outcome,
                error_type=None if error is None else type(error).__qualname__,
                duration_s=duration,
                time_to_first_chunk_s=self.ttfc,
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                chunks=self.chunks if self.stream else None,
                finish_reasons=tuple(self.finish_reasons),
                figures=fig,
                response_id=self.response_id,
            )
            try:
                self.settings.on_call(record)
            except Exception:  # noqa: BLE001 - telemetry never raises into the call
                m.error("on_call")

    def _end_attributes(self, fig: Figures, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """The span's attributes known at the call's end: the figures and the response's (added
        to ``into`` when given)."""
        attrs: dict[str, Any] = spans.figures_attributes(fig, into)
        # Straight-line, as figures_attributes (cold caches on the agent's thread).
        if self.response_model is not None:
            attrs[spans.GEN_AI_RESPONSE_MODEL] = self.response_model
        if self.response_id is not None:
            attrs[spans.GEN_AI_RESPONSE_ID] = self.response_id
        if self.input_tokens is not None:
            attrs[spans.GEN_AI_USAGE_INPUT_TOKENS] = self.input_tokens
        if self.output_tokens is not None:
            attrs[spans.GEN_AI_USAGE_OUTPUT_TOKENS] = self.output_tokens
        if self.ttfc is not None:
            attrs[spans.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = self.ttfc
        if self.finish_reasons:
            attrs[spans.GEN_AI_RESPONSE_FINISH_REASONS] = list(self.finish_reasons)
        if self.settings.config.capture_content and self.content:
            attrs[spans.GEN_AI_OUTPUT_MESSAGES] = json.dumps(["".join(self.content)])
        return attrs

    def _record_otel(self, fig: Figures, error: BaseException | None, duration: float) -> None:
        """The same figures through the meter API (:class:`.metrics.OTelMetrics`), with the
        GenAI conventions' client metric attributes and the agent's role."""
        o = self.settings.otel
        attrs, with_input, with_output = self._otel_attributes()
        if error is not None:
            o.duration.record(duration, {**attrs, spans.ERROR_TYPE: spans.error_type(error)})
            return
        o.duration.record(duration, attrs)
        if self.input_tokens is not None:
            o.token_usage.record(self.input_tokens, with_input)
        if self.output_tokens is not None:
            o.token_usage.record(self.output_tokens, with_output)
        if fig.exact:
            if fig.acceptance is not None:
                o.acceptance.record(fig.acceptance, attrs)
            if fig.tokens_per_step is not None:
                o.acceptance_length.record(fig.tokens_per_step, attrs)
            if fig.draft_tokens is not None:
                o.draft_tokens.add(fig.draft_tokens, attrs)
            if fig.accepted is not None:
                o.accepted.add(fig.accepted, attrs)

    def _otel_attributes(self) -> tuple[dict, dict, dict]:
        """The meter API's attributes of this call, and the same with each token type: the
        same dicts for every call with the same operation, role and models (issue 56 §2)."""
        cache = self.settings.otel_attrs
        key = (self.operation, self.role, self.model, self.response_model)
        found = cache.get(key)
        if found is None:
            attrs: dict[str, Any] = {
                spans.GEN_AI_OPERATION_NAME: "chat"
                if self.operation in NO_BLOCK
                else self.operation,
                spans.GEN_AI_PROVIDER_NAME: spans.PROVIDER,
                spans.ROLE: self.role,
            }
            for name, value in (
                (spans.GEN_AI_REQUEST_MODEL, self.model),
                (spans.GEN_AI_RESPONSE_MODEL, self.response_model),
                (spans.SERVER_ADDRESS, self.settings.address),
                (spans.SERVER_PORT, self.settings.port),
            ):
                if value is not None:
                    attrs[name] = value
            found = (
                attrs,
                {**attrs, spans.GEN_AI_TOKEN_TYPE: "input"},
                {**attrs, spans.GEN_AI_TOKEN_TYPE: "output"},
            )
            if len(cache) >= _OTEL_ATTRS_KEPT:  # ever new models: start over
                cache.clear()
            cache[key] = found
        return found


_OTEL_ATTRS_KEPT = 256
UNKNOWN_ERROR = Figures("unknown", "call_failed")
ABANDONED = Figures("unknown", "abandoned")
# The response carries vLLM's per-request block: its figures are parsed off the caller's thread.
FROM_BLOCK = Figures("request", "ok")
# The readings around the call are taken: its figures are computed with the batch.
FROM_READINGS = Figures("counters", "ok")


def _has_block(extra: Any) -> bool:
    """Whether a response's extra fields hold ``metrics.speculative_decoding`` (a dict)."""
    if not isinstance(extra, dict):
        return False
    block = extra.get("metrics")
    return isinstance(block, dict) and isinstance(block.get("speculative_decoding"), dict)


# The global propagator last seen, and whether it is the SDK's default (W3C trace context and
# baggage, nothing else): then ``traceparent`` is written here, without the propagator's calls.
_propagator: tuple[object, bool] = (None, False)
_DEFAULT_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})


def _trace_headers(
    span: trace.Span,
    sc: SpanContext,
    ctx: context.Context | None = None,
    traceparent: str | None = None,
) -> dict[str, str]:
    """The headers the global propagator would inject for ``span`` (its context ``sc``; in
    ``ctx``, the current context when ``None``). With the default propagator, no trace state
    and no baggage, that is ``traceparent`` alone (``traceparent``: its value written ahead),
    written as the W3C propagator writes it; otherwise the propagator's own."""
    if traceparent is not None and ctx is not None and not ctx:
        # A root made ahead (valid, no trace state) in an empty context (no baggage).
        plain = True
    else:  # (an empty context holds no baggage: no copy of it made to find none)
        no_baggage = (ctx is not None and not ctx) or not baggage.get_all(ctx)
        plain = sc.is_valid and not sc.trace_state and no_baggage
    if plain and _default_propagation():
        return {"traceparent": traceparent or roots.traceparent(sc)}
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return headers


def _default_propagation() -> bool:
    """Whether the global propagator is the SDK's default (checked once per propagator)."""
    global _propagator
    prop = propagate.get_global_textmap()
    if prop is not _propagator[0]:
        _propagator = (prop, _is_default(prop))
    return _propagator[1]


def _is_default(prop) -> bool:
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if isinstance(prop, TraceContextTextMapPropagator):
        return type(prop) is TraceContextTextMapPropagator
    inner = getattr(prop, "_propagators", None)
    return (
        type(prop) is CompositePropagator
        and isinstance(inner, (list, tuple))
        and {type(p) for p in inner} <= {TraceContextTextMapPropagator, W3CBaggagePropagator}
        and prop.fields <= _DEFAULT_FIELDS
    )


# W3C Trace Context level 2's random trace-id flag, which newer SDKs set (0 where the API has
# none).
_RANDOM_TRACE_ID = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)


def _random_flag(gen) -> int:
    global _random_flags
    if gen is not _random_flags[0]:  # asked once per id generator, not once per call
        is_random = getattr(gen, "is_trace_id_random", None)
        flag = _RANDOM_TRACE_ID if is_random is not None and is_random() else 0
        _random_flags = (gen, flag)
    return _random_flags[1]


_random_flags: tuple[object, int] = (None, 0)  # the last id generator asked, and its flag
