"""What the SDKs hand back, read for one call: a chat or completions response or stream chunk,
a Responses API response or stream event, an Anthropic Message or stream event.

The readers are methods of :class:`appliance.agent.calls.Call` (through :class:`Reader`): they
fill the call's reading (``response_id``, ``response_model``, ``input_tokens``,
``output_tokens``, ``finish_reasons``, ``extra``, ``chunks``, ``ttfc``, ``content``) from what
they are shown and never change it, and they count their own failures through the call.
"""

from __future__ import annotations

import time
from typing import Any

RESPONSES = "responses"  # the agent's operation for the Responses API (span: chat)
MESSAGES = "messages"  # the Anthropic Messages API (span: chat)
# The endpoints that answer without a per-request block on vLLM 0.32: always the counters path.
NO_BLOCK = (RESPONSES, MESSAGES)


class Reader:
    """The response readers of a call (its ``settings``, ``operation`` and ``started``, and
    ``_agent_failed`` for a reader's own failure, come from :class:`~.calls.Call`)."""

    __slots__ = ()  # the call's own (Call.__slots__)

    def on_response(self, resp: Any) -> None:
        """Read a non-streamed response: its usage and extra fields now (the window and the
        figures need them at the call's end), the rest (:meth:`read_rest`) with the span, on
        the agent's thread."""
        try:
            self._usage(getattr(resp, "usage", None))
            self.extra = getattr(resp, "model_extra", None)
            self._response = resp
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()

    def read_rest(self) -> None:
        """What the span and the record need of the response :meth:`on_response` kept: its id,
        model, finish reasons and (when captured) content."""
        resp, self._response = self._response, None
        if resp is None:
            return
        try:
            self.response_id = getattr(resp, "id", None)
            self.response_model = getattr(resp, "model", None)
            # Each API's own fields only: a field a pydantic model lacks costs an
            # AttributeError raised and caught inside getattr (issue 56 §2).
            if self.operation == RESPONSES:  # a Responses API response: no choices
                status = getattr(resp, "status", None)
                if isinstance(status, str):
                    self.finish_reasons.append(status)
                    if self.settings.config.capture_content:
                        self.content.append(getattr(resp, "output_text", "") or "")
                return
            if self.operation == MESSAGES:  # an Anthropic Message: no choices either
                self._stop_reason(getattr(resp, "stop_reason", None))
                if self.settings.config.capture_content:
                    blocks = getattr(resp, "content", None) or ()
                    self.content.extend(getattr(b, "text", None) or "" for b in blocks)
                return
            for choice in getattr(resp, "choices", None) or ():
                if choice.finish_reason:
                    self.finish_reasons.append(str(choice.finish_reason))
                if self.settings.config.capture_content:
                    msg = getattr(choice, "message", None)
                    self.content.append(
                        getattr(msg, "content", None) or getattr(choice, "text", "") or ""
                    )
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()

    def on_chunk(self, chunk: Any) -> None:
        """Read one streamed chunk (never changes it)."""
        try:
            if self.ttfc is None:
                self.ttfc = time.perf_counter() - self.started
            kind = getattr(chunk, "type", None)
            if isinstance(kind, str) and self.operation == MESSAGES:
                self._on_message_event(kind, chunk)
                return
            if isinstance(kind, str):  # a Responses API event
                self._on_event(kind, chunk)
                return
            self.response_id = self.response_id or getattr(chunk, "id", None)
            self.response_model = self.response_model or getattr(chunk, "model", None)
            choices = getattr(chunk, "choices", None) or ()
            if choices:
                self.chunks += 1
            for choice in choices:
                if choice.finish_reason:
                    self.finish_reasons.append(str(choice.finish_reason))
                if self.settings.config.capture_content:
                    delta = getattr(choice, "delta", None)
                    self.content.append(
                        getattr(delta, "content", None) or getattr(choice, "text", None) or ""
                    )
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                self._usage(usage)
            extra = getattr(chunk, "model_extra", None)
            if isinstance(extra, dict) and "metrics" in extra:
                self.extra = extra
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self._agent_failed()

    def _on_event(self, kind: str, event: Any) -> None:
        if kind.endswith(".delta"):
            self.chunks += 1
            if self.settings.config.capture_content and kind == "response.output_text.delta":
                self.content.append(getattr(event, "delta", "") or "")
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            capture = self.settings.config.capture_content
            self.content = [] if capture else self.content  # the final text replaces the deltas
            self.on_response(event.response)

    def _on_message_event(self, kind: str, event: Any) -> None:
        """An Anthropic Messages stream event (message_start, content_block_delta, ...)."""
        if kind == "message_start":
            msg = event.message
            self.response_id = getattr(msg, "id", None)
            self.response_model = getattr(msg, "model", None)
            # Its output count is not the final one (vLLM says 0): only message_delta's is, so
            # a stream closed before it has unknown usage, which no proof or certificate takes.
            tokens = _first_int(getattr(msg, "usage", None), "input_tokens")
            self.input_tokens = tokens if tokens is not None else self.input_tokens
        elif kind == "content_block_delta":
            self.chunks += 1
            if self.settings.config.capture_content:
                self.content.append(getattr(event.delta, "text", None) or "")
        elif kind == "message_delta":
            self._stop_reason(getattr(event.delta, "stop_reason", None))
            # Its usage is cumulative: the final output count (input_tokens may be left out).
            self._usage(getattr(event, "usage", None))

    def _stop_reason(self, reason: Any) -> None:
        if isinstance(reason, str):
            self.finish_reasons.append(reason)

    def _usage(self, usage: Any) -> None:
        if usage is None:
            return
        # Chat and completions say prompt/completion_tokens; Responses and Messages input/output.
        # A count left out (an Anthropic message_delta's input_tokens) keeps the earlier one.
        input_tokens = _first_int(usage, "prompt_tokens", "input_tokens")
        if input_tokens is not None:
            self.input_tokens = input_tokens
        # Under MTP one chunk carries 1 + accepted tokens: usage is the only true count.
        output_tokens = _first_int(usage, "completion_tokens", "output_tokens")
        if output_tokens is not None:
            self.output_tokens = output_tokens


def _first_int(obj: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int):
            return value
    return None
