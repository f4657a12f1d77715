"""Stream proxies: every chunk passes through untouched; the call finishes exactly once.

A ``wrapt.ObjectProxy`` so anything the caller touches on the SDK's stream (``response``,
``close``, private helpers) still reaches the real object. The call finishes on exhaustion, on
an error, on ``close()`` or leaving a ``with`` block. A stream dropped unread is ended from a
finalizer that only hands the call to the agent's background thread (a reentrant queue put): the
garbage collector may run it while this thread holds any lock, so it must take none. The async
proxy awaits the real ``close()`` so httpx releases its connection.
"""

from __future__ import annotations

import weakref

import wrapt

from .calls import Call
from .worker import WORKER


class SyncStream(wrapt.ObjectProxy):
    """Proxy for ``openai.Stream`` or ``anthropic.Stream`` (both iterate with ``__next__``)."""

    def __init__(self, stream, call: Call) -> None:
        super().__init__(stream)
        self._self_call = call
        WORKER.start()
        weakref.finalize(self, WORKER.put, call.abandon)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            chunk = self.__wrapped__.__next__()
        except StopIteration:
            self._self_call.finish()
            raise
        except BaseException as exc:
            self._self_call.finish(error=exc)
            raise
        self._self_call.on_chunk(chunk)
        return chunk

    def close(self) -> None:
        try:
            self.__wrapped__.close()
        finally:
            self._self_call.finish()

    def __enter__(self):
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            return self.__wrapped__.__exit__(exc_type, exc, tb)
        finally:
            self._self_call.finish(error=exc)


class AsyncStream(wrapt.ObjectProxy):
    """Proxy for ``openai.AsyncStream`` or ``anthropic.AsyncStream``."""

    def __init__(self, stream, call: Call) -> None:
        super().__init__(stream)
        self._self_call = call
        WORKER.start()
        weakref.finalize(self, WORKER.put, call.abandon)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            chunk = await self.__wrapped__.__anext__()
        except StopAsyncIteration:
            await self._self_call.afinish()
            raise
        except BaseException as exc:
            await self._self_call.afinish(error=exc)
            raise
        self._self_call.on_chunk(chunk)
        return chunk

    async def close(self) -> None:
        try:
            await self.__wrapped__.close()
        finally:
            await self._self_call.afinish()

    async def __aenter__(self):
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, exc_type, exc, tb):
        try:
            return await self.__wrapped__.__aexit__(exc_type, exc, tb)
        finally:
            await self._self_call.afinish(error=exc)
