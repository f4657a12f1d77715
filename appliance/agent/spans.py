"""Span names and attributes, per the OpenTelemetry GenAI semantic conventions.

Pinned: the GenAI attribute names as shipped in ``opentelemetry-semantic-conventions`` 0.66b2
(schema https://opentelemetry.io/schemas/1.44.0). The names are spelled out here rather than
imported, because that package marks the GenAI module incubating/moved; a test checks that each
constant still equals the package's.

The MTP attributes are provider-specific, so they stay out of ``gen_ai.`` as the conventions
now ask (``gen_ai.openai.request.service_tier`` became ``openai.request.service_tier``): they
are ``vllm.spec_decode.*``, vLLM's own word, with vLLM's counter names where it has one
(:data:`SPEC_DECODE`). For one release each is also written under its old
``gen_ai.vllm.mtp.*`` name (:data:`MTP_OLD`), so queries and dashboards can move; the old names
go in the release after (ADR 0020).
"""

from __future__ import annotations

import json
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"

GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"  # a metric attribute: input or output
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"

# What vLLM answers a request it turns away at its queue bound (vllm/exceptions.py
# QueueOverflowError, MaxQueuedTokensError: --max-num-queued-reqs/-tokens, since vLLM 0.29).
REJECTED_STATUS = 503

# No well-known provider value covers vLLM; the conventions allow a custom one.
PROVIDER = "vllm"
ROLE = "appliance.agent.role"

SPEC_DECODE = "vllm.spec_decode."
MTP_DRAFTS = SPEC_DECODE + "num_drafts"  # vllm:spec_decode_num_drafts
MTP_DRAFT_TOKENS = SPEC_DECODE + "num_draft_tokens"  # vllm:spec_decode_num_draft_tokens
MTP_ACCEPTED = SPEC_DECODE + "num_accepted_tokens"  # vllm:spec_decode_num_accepted_tokens
MTP_ACCEPTANCE = SPEC_DECODE + "acceptance_rate"  # accepted / draft tokens, 0..1
MTP_TOKENS_PER_STEP = SPEC_DECODE + "acceptance_length"  # vLLM's mean acceptance length
MTP_PER_POSITION = SPEC_DECODE + "per_position_acceptance_rate"
MTP_SOURCE = SPEC_DECODE + "source"  # the figures' provenance (the agent's): request, counters...
MTP_SHARED = SPEC_DECODE + "shared"
MTP_STATUS = SPEC_DECODE + "status"

# The names of the release before (deprecated; written too until the next release): new -> old.
MTP = "gen_ai.vllm.mtp."
MTP_OLD = {
    MTP_DRAFTS: MTP + "drafts",
    MTP_DRAFT_TOKENS: MTP + "draft_tokens",
    MTP_ACCEPTED: MTP + "accepted",
    MTP_ACCEPTANCE: MTP + "acceptance",
    MTP_TOKENS_PER_STEP: MTP + "tokens_per_step",
    MTP_PER_POSITION: MTP + "per_position_acceptance",
    MTP_SOURCE: MTP + "source",
    MTP_SHARED: MTP + "shared",
    MTP_STATUS: MTP + "status",
}


def span_name(operation: str, model: str | None) -> str:
    return f"{operation} {model}" if model else operation


def request_attributes(
    operation: str,
    kwargs: dict,
    address: str | None,
    port: int | None,
    role: str,
    capture_content: bool,
) -> dict[str, Any]:
    """The attributes known before the call; unset values are left out."""
    # Sampling parameters an SDK does not name (the Anthropic SDK 2.x names no temperature or
    # top_k) travel in extra_body, which vLLM reads as it reads the named ones.
    extra = kwargs.get("extra_body")
    sampling = {**extra, **kwargs} if isinstance(extra, dict) else kwargs
    attrs: dict[str, Any] = {
        GEN_AI_OPERATION_NAME: operation,
        GEN_AI_PROVIDER_NAME: PROVIDER,
        GEN_AI_REQUEST_MODEL: kwargs.get("model"),
        GEN_AI_REQUEST_MAX_TOKENS: kwargs.get("max_tokens")
        or kwargs.get("max_completion_tokens")
        or kwargs.get("max_output_tokens"),
        GEN_AI_REQUEST_TEMPERATURE: sampling.get("temperature"),
        GEN_AI_REQUEST_TOP_P: sampling.get("top_p"),
        GEN_AI_REQUEST_TOP_K: sampling.get("top_k"),
        GEN_AI_REQUEST_STREAM: bool(kwargs.get("stream")),
        SERVER_ADDRESS: address,
        SERVER_PORT: port,
        ROLE: role,
    }
    if capture_content:
        payload = kwargs.get("messages", kwargs.get("prompt", kwargs.get("input")))
        attrs[GEN_AI_INPUT_MESSAGES] = json.dumps(payload, default=str)
    # Set values only, tested inline: this runs once per call on the agent's thread, with cold
    # caches (issue 56 §2), where eleven calls and a comprehension's frame cost more.
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if isinstance(v, _SCALARS) and not (isinstance(v, str) and v == ""):
            out[k] = v
    # Anthropic's stop_sequences: a list of strings, which the test above leaves out.
    stops = kwargs.get("stop_sequences")
    if isinstance(stops, (list, tuple)) and stops and all(isinstance(x, str) for x in stops):
        out[GEN_AI_REQUEST_STOP_SEQUENCES] = list(stops)
    return out


# What an attribute value is set to; the SDK's NOT_GIVEN / Omit sentinels are falsy-ish
# objects that are not attribute values, and "" is no value either.
_SCALARS = (str, bool, int, float)


def figures_attributes(fig, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``vllm.spec_decode.*`` attributes of a :class:`~.rules.Figures`, each also under its
    old ``gen_ai.vllm.mtp.*`` name (:data:`MTP_OLD`, for this release); added to ``into`` when
    given (the span's other attributes: one dict for the span's one start)."""
    # Straight-line stores for the new names: this runs once per call on the agent's thread,
    # with cold caches (issue 56 §2), where a loop over (name, value) pairs cost more.
    attrs: dict[str, Any] = {} if into is None else into
    drafts, tokens, accepted = fig.drafts, fig.draft_tokens, fig.accepted
    rate, length, per = fig.acceptance, fig.tokens_per_step, fig.per_position
    attrs[MTP_SOURCE], attrs[MTP_SHARED], attrs[MTP_STATUS] = fig.source, fig.shared, fig.status
    if drafts is not None:
        attrs[MTP_DRAFTS] = drafts
    if tokens is not None:
        attrs[MTP_DRAFT_TOKENS] = tokens
    if accepted is not None:
        attrs[MTP_ACCEPTED] = accepted
    if rate is not None:
        attrs[MTP_ACCEPTANCE] = rate
    if length is not None:
        attrs[MTP_TOKENS_PER_STEP] = length
    if per is not None:
        attrs[MTP_PER_POSITION] = list(per)
    for key, old in _RENAMED:  # the old names, in the new ones' order (one list shared)
        if key in attrs:
            attrs[old] = attrs[key]
    return attrs


_NEW_ORDER = (
    MTP_SOURCE,
    MTP_SHARED,
    MTP_STATUS,
    MTP_DRAFTS,
    MTP_DRAFT_TOKENS,
    MTP_ACCEPTED,
    MTP_ACCEPTANCE,
    MTP_TOKENS_PER_STEP,
    MTP_PER_POSITION,
)
_RENAMED = tuple((key, MTP_OLD[key]) for key in _NEW_ORDER)


def http_status(exc: BaseException | None) -> int | None:
    """The HTTP status an SDK's error carries, else None: ``status_code`` of the OpenAI and
    Anthropic SDKs' APIStatusError, or the ``code`` of the error event a stream ended with (the
    SDK's bare APIError; vLLM turns a streamed request away that way, vllm#58192)."""
    code = getattr(exc, "status_code", None)
    if code is None:
        body = getattr(exc, "body", None)
        code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def rejected(exc: BaseException | None) -> bool:
    """Whether the call was turned away by the engine's queue bound (HTTP 503)."""
    return http_status(exc) == REJECTED_STATUS


def error_type(exc: BaseException) -> str:
    """``error.type`` of a failed call: the exception's type, or "503" for the engine's
    rejection (see :func:`set_error`)."""
    return str(REJECTED_STATUS) if rejected(exc) else type(exc).__qualname__


def set_error(span: Span, exc: BaseException, capture_content: bool = False) -> None:
    """Mark the span failed with the exception's type; its text only when content is captured.

    vLLM's 400 bodies can echo the request's input, so with capture off no exception text is
    recorded at all. An HTTP error also records its status; a call the engine turned away
    (503) has ``error.type`` "503", as OpenTelemetry's HTTP conventions name a status error:
    the SDK's class for it (OpenAI's InternalServerError) would read as a server fault.
    """
    status = http_status(exc)
    name = error_type(exc)
    if status is not None:
        span.set_attribute(HTTP_RESPONSE_STATUS_CODE, status)
    if capture_content:
        description = str(exc)[:200]
    elif status == REJECTED_STATUS:
        description = "rejected: the engine's queue is full (HTTP 503)"
    else:
        description = name
    span.set_status(Status(StatusCode.ERROR, description))
    span.set_attribute(ERROR_TYPE, name)
