"""Zero-code: OpenTelemetry instrumentors that patch the OpenAI and Anthropic SDKs' classes.

``opentelemetry-instrument python app.py`` loads them from the ``opentelemetry_instrumentor``
entry points; ``OpenAIInstrumentor().instrument()`` does the same in code. Every client the
process creates (its own, LangChain's, LiteLLM's) is then traced, sync and async, plain and
streamed, for ``chat.completions``, ``completions`` and ``responses``, and, with
:class:`AnthropicInstrumentor`, the Anthropic SDK's ``messages.create`` and ``messages.stream``.
Each call goes through the same :func:`.patch.call` / :func:`.patch.acall` as
``instrument(client)``, so the figures, spans and metrics are the proxy's own. Only servers
that are vLLM get traced: a base URL listed in ``APPLIANCE_AGENT_SERVERS``, or one whose
``/version`` answers like vLLM's (asked once per base URL, cached); every other call passes
straight through, with no request of the agent's.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import Collection

import httpx
import wrapt
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap

from ..engine_api.vllm_client import normalise_base_url
from . import metrics
from .calls import Settings
from .config import AgentConfig
from .patch import UPSTREAM_OPENAI, acall, beneath_upstream, call, inside, stream_manager
from .responses import MESSAGES, RESPONSES
from .tracing import own_provider
from .worker import register_exit_flush

# (module, class, operation, async): the SDK resources whose ``create`` is traced.
METHODS = (
    ("openai.resources.chat.completions", "Completions", "chat", False),
    ("openai.resources.chat.completions", "AsyncCompletions", "chat", True),
    ("openai.resources.completions", "Completions", "text_completion", False),
    ("openai.resources.completions", "AsyncCompletions", "text_completion", True),
    ("openai.resources.responses", "Responses", RESPONSES, False),
    ("openai.resources.responses", "AsyncResponses", RESPONSES, True),
)

# The Anthropic SDK's (``messages.create``; vLLM serves ``/v1/messages``).
ANTHROPIC_METHODS = (
    ("anthropic.resources.messages", "Messages", MESSAGES, False),
    ("anthropic.resources.messages", "AsyncMessages", MESSAGES, True),
)
# And its ``messages.stream(...)``, which posts without going through ``create`` (a sync
# method on both classes: it returns a manager whose ``with`` block sends the request).
ANTHROPIC_STREAMS = (
    ("anthropic.resources.messages", "Messages", False),
    ("anthropic.resources.messages", "AsyncMessages", True),
)

# A base URL whose probe failed to connect is asked again after this long (the engine may
# be starting); a server that answered and is not vLLM is never asked again.
RETRY_PROBE_S = 30.0


class _SDKInstrumentor(BaseInstrumentor):
    """Wraps ``create`` on an SDK's resource classes (``_methods``) with the agent's call.

    ``instrument(config=, tracer_provider=, meter_provider=, registry=, on_call=, role=)``; all
    optional.
    Idempotent (the base class instruments once); ``uninstrument()`` restores the classes.
    """

    _methods: tuple[tuple[str, str, str, bool], ...] = ()
    _streams: tuple[tuple[str, str, bool], ...] = ()  # (module, class, async): ``stream``

    def _stream_types(self) -> tuple[type, type]:
        """The SDK's (sync, async) stream classes, whose instances a streamed call returns."""
        raise NotImplementedError

    def _instrument(self, **kwargs) -> None:
        # First: without the SDK this raises ModuleNotFoundError, which opentelemetry-instrument
        # takes as "library not installed" and skips, before anything else was set up.
        streams = self._stream_types()
        self._servers = Servers(
            config=kwargs.get("config") or AgentConfig.from_env(),
            tracer_provider=kwargs.get("tracer_provider"),
            registry=kwargs.get("registry"),
            on_call=kwargs.get("on_call"),
            role=kwargs.get("role") or "default",
            meter_provider=kwargs.get("meter_provider"),
        )
        register_exit_flush()
        self._wrappers = [
            (module, cls, _wrapper(self._servers, operation, is_async, streams[is_async]))
            for module, cls, operation, is_async in self._methods
        ]
        self._wrap_creates()
        for module, cls, is_async in self._streams:
            wrapt.wrap_function_wrapper(
                module, f"{cls}.stream", _stream_wrapper(self._servers, is_async, streams[is_async])
            )

    def _wrap_creates(self) -> None:
        for module, cls, wrapper in self._wrappers:
            wrapt.wrap_function_wrapper(module, f"{cls}.create", wrapper)

    def _unwrap_creates(self) -> None:
        for module, cls, _ in self._wrappers:
            unwrap(getattr(importlib.import_module(module), cls), "create")

    def _uninstrument(self, **kwargs) -> None:
        self._unwrap_creates()
        for module, cls, _ in self._streams:
            unwrap(getattr(importlib.import_module(module), cls), "stream")


class OpenAIInstrumentor(_SDKInstrumentor):
    """Traces every OpenAI SDK client's calls to a vLLM server with the agent's MTP figures."""

    _methods = METHODS

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("openai >= 1.40",)

    def _instrument(self, **kwargs) -> None:
        super()._instrument(**kwargs)
        upstream = _upstream_instrumentor()
        if upstream is not None:  # stay the outer layer whatever order the two instrument in
            for method in ("_instrument", "_uninstrument"):
                wrapt.wrap_function_wrapper(upstream, method, self._aside)

    def _uninstrument(self, **kwargs) -> None:
        super()._uninstrument(**kwargs)
        upstream = _upstream_instrumentor()
        if upstream is not None:
            for method in ("_instrument", "_uninstrument"):
                unwrap(upstream, method)

    def _aside(self, wrapped, instance, args, kwargs):
        """The upstream instrumentor (un)wraps ``create`` with ours off, then ours goes back on
        top: a call to vLLM then reaches ours first, which sends it beneath theirs (one span),
        and their ``unwrap``, which removes the outer layer, removes theirs, not ours."""
        self._unwrap_creates()
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._wrap_creates()

    def _stream_types(self) -> tuple[type, type]:
        import openai

        return openai.Stream, openai.AsyncStream


class AnthropicInstrumentor(_SDKInstrumentor):
    """Traces every Anthropic SDK client's ``messages.create`` and ``messages.stream`` to a vLLM
    server (its Anthropic Messages API), with the same figures: always from the counters, as
    vLLM 0.32 sends no per-request block there. Which servers: as for
    :class:`OpenAIInstrumentor`."""

    _methods = ANTHROPIC_METHODS
    _streams = ANTHROPIC_STREAMS

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("anthropic >= 0.40",)

    def _stream_types(self) -> tuple[type, type]:
        import anthropic  # only here: the agent does not need the Anthropic SDK otherwise

        return anthropic.Stream, anthropic.AsyncStream


def _upstream_instrumentor() -> type | None:
    """The upstream OpenAI instrumentor's class when it is installed (it needs not be)."""
    try:
        return importlib.import_module(UPSTREAM_OPENAI).OpenAIInstrumentor
    except Exception:  # noqa: BLE001 - absent or broken: nothing to coexist with
        return None


def _wrapper(servers: Servers, operation: str, is_async: bool, stream_type: type):
    if is_async:

        async def traced_async(wrapped, instance, args, kwargs):
            if inside():  # called from a proxied client's call: that one traces it
                return await beneath_upstream(wrapped)(*args, **kwargs)
            settings = await servers.afor_client(getattr(instance, "_client", None))
            if settings is None:
                return await wrapped(*args, **kwargs)
            return await acall(settings, operation, wrapped, args, kwargs, stream_type)

        return traced_async

    def traced(wrapped, instance, args, kwargs):
        if inside():  # called from a proxied client's call: that one traces it
            return beneath_upstream(wrapped)(*args, **kwargs)
        settings = servers.for_client(getattr(instance, "_client", None))
        if settings is None:
            return wrapped(*args, **kwargs)
        return call(settings, operation, wrapped, args, kwargs, stream_type)

    return traced


def _stream_wrapper(servers: Servers, is_async: bool, stream_type: type):
    def traced_stream(wrapped, instance, args, kwargs):
        if inside():
            return wrapped(*args, **kwargs)
        # stream() is not a coroutine even on AsyncMessages: a base URL's first call asks
        # /version on the caller's thread (once per base URL; bounded as every probe is).
        settings = servers.for_client(getattr(instance, "_client", None))
        if settings is None:
            return wrapped(*args, **kwargs)
        return stream_manager(settings, wrapped, args, kwargs, stream_type, is_async)

    return traced_stream


class Servers:
    """Which base URLs are vLLM (asked once each, cached) and their :class:`Settings`."""

    def __init__(
        self, config: AgentConfig, tracer_provider, registry, on_call, role: str, meter_provider
    ):
        self.config = config
        self.provider = tracer_provider
        self.meter_provider = meter_provider
        self.metrics = metrics.for_registry(registry)
        self.on_call = on_call
        self.role = role
        self._settings: dict[str, Settings | None] = {}
        self._retry_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._listed = {normalise_base_url(u) for u in config.servers}

    def for_client(self, client) -> Settings | None:
        base = _base(client)
        if base is None:
            return None
        try:
            return self._settings[base]  # the hot path: no lock, no request
        except KeyError:
            pass
        if self._retry_at.get(base, 0.0) > time.monotonic():
            return None
        return self._resolve(base)

    async def afor_client(self, client) -> Settings | None:
        base = _base(client)
        if base is None:
            return None
        if base in self._settings:
            return self._settings[base]
        if self._retry_at.get(base, 0.0) > time.monotonic():
            return None
        return await asyncio.to_thread(self._resolve, base)  # the one probe, off the loop

    def _resolve(self, base: str) -> Settings | None:
        try:
            with self._lock:
                if base in self._settings:
                    return self._settings[base]
                vllm = base in self._listed or self._probe(base)
                if vllm is None:  # no answer: ask again later
                    self._retry_at[base] = time.monotonic() + RETRY_PROBE_S
                    return None
                self._settings[base] = self._build(base) if vllm else None
                return self._settings[base]
        except Exception:  # noqa: BLE001 - telemetry never raises into the call
            self.metrics.error("internal")
            return None

    def _probe(self, base: str) -> bool | None:
        """True: vLLM; False: a server that is not; None: no answer."""
        try:  # vLLM serves /version at the root, beside /v1 (base is the root)
            resp = httpx.get(base + "/version", timeout=self.config.snapshot_timeout * 4)
        except httpx.HTTPError:
            return None
        try:
            body = resp.json()
        except ValueError:
            return False
        # vLLM's /version is {"version": "0.32.0"} and nothing else.
        return resp.status_code == 200 and isinstance(body, dict) and set(body) == {"version"}

    def _build(self, base: str) -> Settings:
        provider = self.provider or _global_provider()
        return Settings.for_base(
            base,
            self.config,
            provider,
            self.metrics,
            self.role,
            self.on_call,
            self.meter_provider,
        )


_own_provider: trace.TracerProvider | None = None
_own_lock = threading.Lock()


def _global_provider() -> trace.TracerProvider:
    """The global provider; one from the ``OTEL_*`` variables when nothing set one.

    ``opentelemetry-instrument`` without a distro configures no SDK: the agent then builds its
    own provider (:func:`.tracing.own_provider`) and makes it global, so the spans go somewhere.
    """
    global _own_provider
    provider = trace.get_tracer_provider()
    if not isinstance(provider, trace.ProxyTracerProvider):
        return provider
    with _own_lock:
        if _own_provider is None:
            _own_provider = own_provider()
            trace.set_tracer_provider(_own_provider)
            register_exit_flush()  # the figures still pending at exit go before its shutdown
        return trace.get_tracer_provider()


def _base(client) -> str | None:
    url = getattr(client, "base_url", None)
    return None if url is None else normalise_base_url(str(url))
