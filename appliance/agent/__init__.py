"""The MTP telemetry agent: per-call Gemma 4 MTP figures on OpenTelemetry spans and Prometheus.

Adopt it with one line::

    client = appliance.agent.instrument(openai.OpenAI(base_url=..., api_key=...), role="worker")
    with appliance.agent.role("architect"):      # optional, per call or per block
        client.chat.completions.create(...)

Sync and async clients, streamed and plain ``chat.completions.create`` / ``completions.create``
are traced; results, exceptions and streams are the bare client's own. Each call gets one CLIENT
span (OpenTelemetry GenAI conventions, see :mod:`.spans`) with ``vllm.spec_decode.*`` figures
attributed per :mod:`.rules`, and the metrics of :mod:`.metrics`: Prometheus, and the same
through the OpenTelemetry meter API.

Settings: :class:`AgentConfig` (``APPLIANCE_AGENT_*``) and the standard ``OTEL_*`` variables
(:func:`setup_tracing`). Prompt and completion text are recorded only when
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from . import metrics
from .calls import CallRecord, Settings, _role
from .config import AgentConfig
from .metrics import build_registry
from .metrics import serve as serve_metrics
from .patch import InstrumentedClient
from .rules import Figures
from .tracing import exporting, setup_tracing
from .worker import WORKER, register_exit_flush

__all__ = [
    "AgentConfig",
    "CallRecord",
    "Figures",
    "InstrumentedClient",
    "build_registry",
    "exporting",
    "flush",
    "instrument",
    "role",
    "serve_metrics",
    "setup_tracing",
]


def flush(timeout: float = 5.0) -> bool:
    """Wait until every finished call's figures, span and record are done; False on timeout.

    Figures that need a ``/metrics`` after-read are completed on the agent's background thread
    after the call returns. Call this before reading ``on_call`` records you depend on, or
    before shutting down a tracer provider yourself. At interpreter exit it runs on its own
    (``atexit``, bounded to 2 s), ahead of the exit shutdown of any tracer provider created
    before the client was instrumented. Called from an ``on_call`` callback it returns False
    at once (the callback runs on the agent's thread).
    """
    return WORKER.flush(timeout)


def instrument(
    client,
    *,
    role: str = "default",
    config: AgentConfig | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    registry: CollectorRegistry | None = None,
    on_call: Callable[[CallRecord], None] | None = None,
    meter_provider=None,
) -> InstrumentedClient:
    """Wrap an ``openai.OpenAI`` or ``openai.AsyncOpenAI`` client; use the result instead.

    ``tracer_provider`` defaults to the global one; ``registry`` to the agent's own (serve it
    with :func:`serve_metrics`); ``on_call`` receives a :class:`CallRecord` after each call;
    ``meter_provider`` (the meter API's; the global one by default) gets the same figures as
    OpenTelemetry metrics (:mod:`.metrics`).
    """
    cfg = config or AgentConfig.from_env()
    # Ahead of the exit handlers registered so far (e.g. this provider's own shutdown).
    register_exit_flush()
    provider = tracer_provider or trace.get_tracer_provider()
    settings = Settings.for_base(
        str(client.base_url),
        cfg,
        provider,
        metrics.for_registry(registry),
        role,
        on_call,
        meter_provider,
    )
    return InstrumentedClient(client, settings)


@contextlib.contextmanager
def role(name: str) -> Iterator[None]:
    """Tag every call made inside the block (in this thread or task) with role ``name``."""
    token = _role.set(name)
    try:
        yield
    finally:
        _role.reset(token)
