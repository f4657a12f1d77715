"""Client proxies: ``instrument(client)`` returns the same client with its ``create`` calls traced.

Only ``chat.completions.create`` and ``completions.create`` are intercepted; every other
attribute passes through to the real client untouched (``wrapt.ObjectProxy``), so the result,
the exceptions and the streaming behaviour are the bare client's own. The SDK's
``with_options()`` / ``copy()`` pass through too and return a bare copy: instrument that copy.
"""

from __future__ import annotations

import contextvars
import logging
import weakref

import wrapt
from opentelemetry import trace

from .calls import Call, Settings, attach_context, detach_context
from .responses import MESSAGES
from .streams import AsyncStream, SyncStream
from .worker import WORKER

log = logging.getLogger("appliance.agent")


class _Create(wrapt.ObjectProxy):
    """Proxy for a ``Completions`` resource whose ``create`` goes through the agent."""

    def __init__(
        self, resource, settings: Settings, operation: str, is_async: bool, stream_type: type
    ) -> None:
        super().__init__(resource)
        self._self_settings = settings
        self._self_operation = operation
        self._self_async = is_async
        self._self_stream_type = stream_type

    def create(self, *args, **kwargs):
        run = acall if self._self_async else call
        return run(
            self._self_settings,
            self._self_operation,
            self.__wrapped__.create,
            args,
            kwargs,
            self._self_stream_type,
        )


# Set while a traced call's ``create`` runs: a client both proxied (``instrument(client)``)
# and patched by an instrumentor reaches the patched class method from inside the proxy's call,
# and that inner layer then passes straight through, so the call gets one span (the outer,
# proxy's: the settings the application chose for that client), not two.
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "appliance_agent_inside", default=False
)


# The upstream OpenAI instrumentation (opentelemetry-instrumentation-openai-v2) wraps chat
# completions' ``create`` too. A call the agent traces is sent beneath its layers, so the call
# has one CLIENT span, the agent's, with the figures (ADR 0006); calls to other servers still
# go through them.
UPSTREAM_OPENAI = "opentelemetry.instrumentation.openai_v2"


# wrapt 2's function wrappers (what instrumentations wrap with) derive from its base proxy, not
# from ``wrapt.ObjectProxy``; wrapt 1 has the one class.
_WRAPT_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def beneath_upstream(create):
    """``create`` without the upstream OpenAI instrumentation's ``wrapt`` layers on top."""
    # Only a wrapt proxy has a _self_wrapper: a bound method's failed getattr raises (and
    # swallows) an AttributeError on every call.
    while isinstance(create, _WRAPT_PROXY) and (
        getattr(getattr(create, "_self_wrapper", None), "__module__", None) or ""
    ).startswith(UPSTREAM_OPENAI):
        create = create.__wrapped__
    return create


def inside() -> bool:
    """Whether this thread or task is already inside a traced call's ``create``."""
    return _inside.get()


def _attach(traced: Call):
    """The call's span made current while the SDK sends it: a span the SDK or an HTTP
    instrumentation starts inside (the Anthropic SDK 2.x traces its own calls) is its child, in
    the call's trace, not a second root (errors are recorded by the call's finish, once). The
    token to :func:`_detach` (None when the call has no span)."""
    if traced.send_ctx is not None:  # made ahead with the call's root (.roots)
        return attach_context(traced.send_ctx)
    if traced.span is None:
        return None
    # In the context the span was made in (the current one: no second lookup).
    return attach_context(trace.set_span_in_context(traced.span, traced.parent_ctx))


def _detach(token) -> None:
    """Undo :func:`_attach` (once: the token is spent, None is returned to forget it)."""
    if token is not None:
        try:
            detach_context(token)
        except Exception:  # as the API's detach: logged, never raised
            log.debug("failed to detach the call's context", exc_info=True)


def call(settings: Settings, operation: str, create, args, kwargs, stream_type: type):
    """One sync ``create`` through the agent (shared by the proxy and the instrumentors).

    ``stream_type``: the SDK's stream class (``openai.Stream``, ``anthropic.Stream``), whose
    instances are returned wrapped in :class:`.streams.SyncStream`."""
    traced = None if _inside.get() else _new_call(settings, operation, kwargs)
    if traced is None:
        return create(*args, **kwargs)
    create = beneath_upstream(create)
    send = traced.start()
    token = _inside.set(True)
    current = _attach(traced)
    try:
        result = create(*args, **send)
    except BaseException as exc:
        current = _detach(current)
        traced.finish(error=exc)
        raise
    finally:
        _detach(current)
        _inside.reset(token)
    if isinstance(result, stream_type):
        return SyncStream(result, traced)
    return _done(traced, result, stream_type, SyncStream)


async def acall(settings: Settings, operation: str, create, args, kwargs, stream_type: type):
    """One async ``create`` through the agent (``stream_type``: the SDK's async stream class)."""
    traced = None if _inside.get() else _new_call(settings, operation, kwargs)
    if traced is None:
        return await create(*args, **kwargs)
    create = beneath_upstream(create)
    send = await traced.astart()
    token = _inside.set(True)
    current = _attach(traced)
    try:
        result = await create(*args, **send)
    except BaseException as exc:
        current = _detach(current)
        await traced.afinish(error=exc)
        raise
    finally:
        _detach(current)
        _inside.reset(token)
    if isinstance(result, stream_type):
        return AsyncStream(result, traced)
    return _done(traced, result, stream_type, AsyncStream)


def stream_manager(settings: Settings, stream, args, kwargs, stream_type, is_async: bool):
    """The Anthropic SDK's ``messages.stream(...)`` through the agent.

    ``stream()`` builds the request and returns a manager; the request goes out when its
    ``with`` block is entered. So the span opens here and its ``traceparent`` goes into the
    request built now, the window opens on entering, and the SDK's raw stream inside the
    ``MessageStream`` is wrapped in :class:`.streams.SyncStream` (or the async one): every way
    of reading it (iteration, ``text_stream``, ``get_final_message()``, ``until_done()``) goes
    through that proxy, and leaving the block closes it, which finishes the call."""
    traced = None if _inside.get() else _new_call(settings, MESSAGES, {**kwargs, "stream": True})
    if traced is None:
        return stream(*args, **kwargs)
    send = dict(traced.open())
    send.pop("stream", None)  # stream() takes no such argument: it always streams
    try:
        manager = stream(*args, **send)
    except BaseException as exc:  # a bad argument: raised at the call, as bare
        traced.finish(error=exc)
        raise
    proxy = AsyncMessageStreamManager if is_async else MessageStreamManager
    return proxy(manager, traced, stream_type)


def _watch(message_stream, traced: Call, stream_type, wrapper) -> None:
    """Wrap a ``MessageStream``'s raw stream (it reads it lazily, after this) in ``wrapper``."""
    raw = getattr(message_stream, "_raw_stream", None)
    if isinstance(raw, stream_type):
        message_stream._raw_stream = wrapper(raw, traced)
        return
    # A changed SDK: the call ends now (figures honest: its usage is unknown), never raised.
    traced.settings.metrics.error("internal")
    traced.finish()


class _StreamManager(wrapt.ObjectProxy):
    """A messages.stream manager holding its call (see :func:`stream_manager`).

    A manager never entered is ended unread by a finalizer (as a dropped stream is); once
    entered, the stream proxy owns the call."""

    def __init__(self, manager, traced: Call, stream_type) -> None:
        super().__init__(manager)
        self._self_call = traced
        self._self_stream_type = stream_type
        WORKER.start()
        self._self_unread = weakref.finalize(self, WORKER.put, traced.abandon)


class MessageStreamManager(_StreamManager):
    """Proxy for ``anthropic.lib.streaming.MessageStreamManager``."""

    def __enter__(self):
        traced = self._self_call
        self._self_unread.detach()
        traced.send()
        token = _inside.set(True)
        current = _attach(traced)
        try:
            message_stream = self.__wrapped__.__enter__()
        except BaseException as exc:
            current = _detach(current)
            traced.finish(error=exc)
            raise
        finally:
            _detach(current)
            _inside.reset(token)
        _watch(message_stream, traced, self._self_stream_type, SyncStream)
        return message_stream

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:  # first: the SDK's exit closes the raw stream, which finishes too
            self._self_call.finish(error=exc)
        try:  # closes the MessageStream, hence the raw stream proxy: the call finishes there
            return self.__wrapped__.__exit__(exc_type, exc, tb)
        finally:
            self._self_call.finish()


class AsyncMessageStreamManager(_StreamManager):
    """Proxy for ``anthropic.lib.streaming.AsyncMessageStreamManager``."""

    async def __aenter__(self):
        traced = self._self_call
        self._self_unread.detach()
        await traced.asend()
        token = _inside.set(True)
        current = _attach(traced)
        try:
            message_stream = await self.__wrapped__.__aenter__()
        except BaseException as exc:
            current = _detach(current)
            await traced.afinish(error=exc)
            raise
        finally:
            _detach(current)
            _inside.reset(token)
        _watch(message_stream, traced, self._self_stream_type, AsyncStream)
        return message_stream

    async def __aexit__(self, exc_type, exc, tb):
        if exc is not None:
            await self._self_call.afinish(error=exc)
        try:
            return await self.__wrapped__.__aexit__(exc_type, exc, tb)
        finally:
            await self._self_call.afinish()


def _done(traced: Call, result, stream_type, wrapper):
    """Read a returned ``result`` and finish the call (sync or async: no waiting here).

    A raw response (``client.chat.completions.with_raw_response.create``, which is how
    LangChain's ``ChatOpenAI.invoke`` calls) holds the body unparsed: it is parsed here, and the
    SDK caches ``parse()``, so the caller's own ``parse()`` returns that very object (the body is
    read once, as bare). A raw stream (``ChatOpenAI(include_response_headers=True).stream()``)
    parses to the SDK's stream: the proxy that finishes the call goes in that cache instead, so
    the caller's ``parse()`` iterates through it."""
    if not _is_raw(result):
        traced.on_response(result)
        traced.finish()
        return result
    try:
        body = result.parse()
    except Exception as exc:  # noqa: BLE001 - the caller's own parse() raises it again
        traced.finish(error=exc)
        return result
    if isinstance(body, stream_type):
        try:
            # The SDK's parse() cache, keyed by the type it parses to (openai's LegacyAPIResponse).
            result._parsed_by_type[result._cast_to] = wrapper(body, traced)
        except Exception:  # noqa: BLE001 - a changed SDK: the call ends now, figures honest
            traced.settings.metrics.error("internal")
            traced.finish()
        return result
    traced.on_response(body)
    traced.finish()
    return result


def _is_raw(result) -> bool:
    """Whether ``result`` is an SDK's raw response (``with_raw_response``), not the body."""
    return type(result).__name__ == "LegacyAPIResponse" and callable(getattr(result, "parse", None))


def _new_call(settings: Settings, operation: str, kwargs: dict) -> Call | None:
    try:
        return Call(settings, operation, kwargs)
    except Exception:  # noqa: BLE001 - telemetry never raises into the call
        settings.metrics.error("internal")
        return None


class _Chat(wrapt.ObjectProxy):
    def __init__(self, chat, settings: Settings, is_async: bool, stream_type: type) -> None:
        super().__init__(chat)
        self._self_completions = _Create(chat.completions, settings, "chat", is_async, stream_type)

    @property
    def completions(self):
        return self._self_completions


class InstrumentedClient(wrapt.ObjectProxy):
    """An ``openai.OpenAI`` / ``openai.AsyncOpenAI`` whose completions are traced by the agent."""

    def __init__(self, client, settings: Settings) -> None:
        super().__init__(client)
        import openai  # the application's own: it made ``client`` with it

        is_async = isinstance(client, openai.AsyncOpenAI)
        stream_type = openai.AsyncStream if is_async else openai.Stream
        self._self_settings = settings
        self._self_chat = _Chat(client.chat, settings, is_async, stream_type)
        self._self_completions = _Create(
            client.completions, settings, "text_completion", is_async, stream_type
        )

    @property
    def chat(self):
        return self._self_chat

    @property
    def completions(self):
        return self._self_completions
