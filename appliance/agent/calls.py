"""One instrumented call's lifecycle: window, snapshots, span, figures, metrics, record.

Every method here swallows its own failures (counted as ``gemma4_agent_errors_total``): the
caller only ever sees the bare client's result or exception. :meth:`Call.finish` runs once.
"""

from __future__ import annotations

import contextvars
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from . import attribution, spans
from .attribution import Figures
from .config import AgentConfig
from .metrics import AgentMetrics

_role: contextvars.ContextVar[str | None] = contextvars.ContextVar("appliance_agent_role", default=None)


@dataclass(frozen=True)
class CallRecord:
    """What the agent learned about one call (handed to ``on_call`` callbacks)."""

    role: str
    operation: str
    model: str | None
    stream: bool
    outcome: str  # ok | error
    error_type: str | None
    duration_s: float
    time_to_first_chunk_s: float | None
    input_tokens: int | None
    output_tokens: int | None
    chunks: int | None
    finish_reasons: tuple[str, ...]
    figures: Figures

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Settings:
    """What one instrumented client shares with all its calls."""

    config: AgentConfig
    tracer: trace.Tracer
    metrics: AgentMetrics
    server: attribution.Server
    address: str | None
    port: int | None
    role: str
    on_call: Callable[[CallRecord], None] | None = None


class Call:
    """One call through the agent, from before the request to the span's end."""

    def __init__(self, settings: Settings, operation: str, kwargs: dict) -> None:
        self.s = settings
        self.operation = operation
        self.role = _role.get() or settings.role
        self.model = kwargs.get("model") if isinstance(kwargs.get("model"), str) else None
        self.stream = kwargs.get("stream") is True
        opts = kwargs.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self.response_model: str | None = None
        self.response_id: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.finish_reasons: list[str] = []
        self.extra: dict | None = None
        self.chunks = 0
        self.ttfc: float | None = None
        self.content: list[str] = []
        self.window: attribution.Window | None = None
        self.span: trace.Span | None = None
        self.started = time.perf_counter()
        self._done = False
        self._kwargs = kwargs

    # -- start ---------------------------------------------------------------------------------
    def _wants_snapshots(self) -> bool:
        mode = self.s.config.attribution
        if mode == "counters":
            return True
        if mode != "auto":
            return False
        # A stream without include_usage has no final usage chunk, so no per-request block.
        expect_block = not self.stream or self.include_usage
        return not (self.s.server.per_request and expect_block)

    def _begin(self) -> dict:
        """Open the window and the span; the kwargs to send (with ``traceparent`` injected)."""
        kwargs = self._kwargs
        self.window = self.s.server.begin()
        self.window.snapshots = self._wants_snapshots()
        attrs = spans.request_attributes(
            self.operation, kwargs, self.s.address, self.s.port, self.role,
            self.s.config.capture_content,
        )
        self.span = self.s.tracer.start_span(
            spans.span_name(self.operation, self.model), kind=SpanKind.CLIENT, attributes=attrs
        )
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(self.span))
        user = kwargs.get("extra_headers")
        merged = {**headers, **(user if isinstance(user, dict) else {})}  # the caller's win
        return {**kwargs, "extra_headers": merged}

    def start(self) -> dict:
        """Sync start; returns the kwargs to call with (the caller's own on any agent failure)."""
        try:
            kwargs = self._begin()
            if self.window.snapshots:
                self.window.before = self.s.server.snapshot(
                    self.s.metrics, self.s.config.snapshot_timeout, self.s.config.failure_cooldown
                )
            self.started = time.perf_counter()
            return kwargs
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            return self._kwargs

    async def astart(self) -> dict:
        try:
            kwargs = self._begin()
            if self.window.snapshots:
                self.window.before = await self.s.server.asnapshot(
                    self.s.metrics, self.s.config.snapshot_timeout, self.s.config.failure_cooldown
                )
            self.started = time.perf_counter()
            return kwargs
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            return self._kwargs

    def _agent_failed(self) -> None:
        self.s.metrics.error("internal")

    # -- observe -------------------------------------------------------------------------------
    def on_response(self, resp: Any) -> None:
        """Read a non-streamed response."""
        try:
            self.response_id = getattr(resp, "id", None)
            self.response_model = getattr(resp, "model", None)
            self._usage(getattr(resp, "usage", None))
            for choice in getattr(resp, "choices", None) or ():
                if choice.finish_reason:
                    self.finish_reasons.append(str(choice.finish_reason))
                if self.s.config.capture_content:
                    msg = getattr(choice, "message", None)
                    self.content.append(getattr(msg, "content", None) or getattr(choice, "text", "") or "")
            self.extra = getattr(resp, "model_extra", None)
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()

    def on_chunk(self, chunk: Any) -> None:
        """Read one streamed chunk (never changes it)."""
        try:
            if self.ttfc is None:
                self.ttfc = time.perf_counter() - self.started
            self.response_id = self.response_id or getattr(chunk, "id", None)
            self.response_model = self.response_model or getattr(chunk, "model", None)
            choices = getattr(chunk, "choices", None) or ()
            if choices:
                self.chunks += 1
            for choice in choices:
                if choice.finish_reason:
                    self.finish_reasons.append(str(choice.finish_reason))
                if self.s.config.capture_content:
                    delta = getattr(choice, "delta", None)
                    self.content.append(getattr(delta, "content", None) or getattr(choice, "text", None) or "")
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                self._usage(usage)
            extra = getattr(chunk, "model_extra", None)
            if isinstance(extra, dict) and "metrics" in extra:
                self.extra = extra
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()

    def _usage(self, usage: Any) -> None:
        if usage is None:
            return
        self.input_tokens = getattr(usage, "prompt_tokens", None)
        # Under MTP one chunk carries 1 + accepted tokens: usage is the only true count.
        self.output_tokens = getattr(usage, "completion_tokens", None)

    # -- finish --------------------------------------------------------------------------------
    def _figures_without_after(self) -> tuple[Figures | None, bool]:
        """Figures from the response when it has them; (None, True) when a read is due."""
        mode = self.s.config.attribution
        if mode == "off":
            return Figures("unknown", "skipped"), False
        if mode != "counters":
            fig = attribution.from_response(self.extra)
            if fig is not None:
                self.s.server.per_request = True
                return fig, False
            if mode == "auto" and self.s.server.per_request and not self.window.snapshots:
                # It sent per-request figures before and not now (restarted without the flag?):
                # read counters again from the next call on.
                self.s.server.per_request = False
        if self.window is not None and self.window.snapshots:
            return None, True
        return Figures("unknown", "missing"), False

    def finish(self, error: BaseException | None = None) -> None:
        """Sync end of the call: the after-read when due, then span, metrics, record. Once."""
        if self._done:
            return
        self._done = True
        duration = time.perf_counter() - self.started
        try:
            fig, read = self._figures_without_after() if error is None else (UNKNOWN_ERROR, False)
            if read:
                after = self.s.server.snapshot(
                    self.s.metrics, self.s.config.snapshot_timeout, self.s.config.failure_cooldown
                )
                fig = self._from_snapshots(after)
            self._close(fig, error, duration)
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            self._end_span_quietly()

    async def afinish(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._done = True
        duration = time.perf_counter() - self.started
        try:
            fig, read = self._figures_without_after() if error is None else (UNKNOWN_ERROR, False)
            if read:
                after = await self.s.server.asnapshot(
                    self.s.metrics, self.s.config.snapshot_timeout, self.s.config.failure_cooldown
                )
                fig = self._from_snapshots(after)
            self._close(fig, error, duration)
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            self._end_span_quietly()

    def abandon(self) -> None:
        """End the span of a stream dropped unread (no network from a finalizer)."""
        if self._done:
            return
        self._done = True
        try:
            self._close(Figures("unknown", "abandoned"), None, time.perf_counter() - self.started)
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()
            self._end_span_quietly()

    def _from_snapshots(self, after) -> Figures:
        w = self.window
        self.s.server.end(w)  # before deciding: a call that overlapped us has marked w by now
        model = self.response_model or self.model
        return attribution.from_snapshots(w.before, after, model, w.overlapped)

    def _end_span_quietly(self) -> None:
        try:
            if self.window is not None:
                self.s.server.end(self.window)
            if self.span is not None and self.span.is_recording():
                self.span.end()
        except Exception:  # noqa: BLE001, S110 - the last resort: nothing left to count with
            pass

    def _close(self, fig: Figures, error: BaseException | None, duration: float) -> None:
        if self.window is not None:
            self.s.server.end(self.window)
        model = self.response_model or self.model
        span = self.span
        if span is not None:
            attrs: dict[str, Any] = dict(spans.figures_attributes(fig))
            for key, value in (
                (spans.GEN_AI_RESPONSE_MODEL, self.response_model),
                (spans.GEN_AI_RESPONSE_ID, self.response_id),
                (spans.GEN_AI_USAGE_INPUT_TOKENS, self.input_tokens),
                (spans.GEN_AI_USAGE_OUTPUT_TOKENS, self.output_tokens),
                (spans.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, self.ttfc),
            ):
                if value is not None:
                    attrs[key] = value
            if self.finish_reasons:
                attrs[spans.GEN_AI_RESPONSE_FINISH_REASONS] = list(self.finish_reasons)
            if self.s.config.capture_content and self.content:
                attrs[spans.GEN_AI_OUTPUT_MESSAGES] = json.dumps(["".join(self.content)])
            span.set_attributes(attrs)
            if error is not None:
                spans.set_error(span, error)
            span.end()
        outcome = "ok" if error is None else "error"
        m = self.s.metrics
        labels = {"role": self.role, "model": model or ""}
        m.calls.labels(**labels, source=fig.source, outcome=outcome).inc()
        m.duration.labels(**labels).observe(duration)
        if fig.exact and error is None:
            if fig.acceptance is not None:
                m.acceptance.labels(**labels).observe(fig.acceptance)
            if fig.tokens_per_step is not None:
                m.tokens_per_step.labels(**labels).observe(fig.tokens_per_step)
            if fig.drafted is not None:
                m.drafted.labels(**labels).inc(fig.drafted)
            if fig.accepted is not None:
                m.accepted.labels(**labels).inc(fig.accepted)
        if self.s.on_call is not None:
            record = CallRecord(
                role=self.role, operation=self.operation, model=model, stream=self.stream,
                outcome=outcome, error_type=None if error is None else type(error).__qualname__,
                duration_s=duration, time_to_first_chunk_s=self.ttfc,
                input_tokens=self.input_tokens, output_tokens=self.output_tokens,
                chunks=self.chunks if self.stream else None,
                finish_reasons=tuple(self.finish_reasons), figures=fig,
            )
            try:
                self.s.on_call(record)
            except Exception:  # noqa: BLE001 - telemetry never raises into the call
                m.error("on_call")


UNKNOWN_ERROR = Figures("unknown", "call_failed")
