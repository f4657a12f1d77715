"""A small client that observes a vLLM server: health, version, models, speculative counters,
and the one kind of request that is not a read: a generation (:meth:`VLLMClient.generate`).

It never changes the server. Every failure becomes an :class:`EngineError` (:class:`AuthError`
for a refused key, :class:`NotVLLMError` when something answers that is not vLLM) with the URL in
the message.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Self
from urllib.parse import urlsplit

import httpx

from ..errors import AuthError, EngineError, NotVLLMError, OverloadedError, UsageError
from . import metrics_reader, shed, specdecode


def bearer(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header vLLM's ``--api-key`` wants; empty without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class ServedModel:
    """One entry of ``/v1/models``."""

    id: str
    root: str | None
    max_model_len: int | None


@dataclass(frozen=True)
class Generation:
    """One chat completion: its usage, text, and the per-request speculative-decoding block.

    ``completion_tokens`` is ``usage.completion_tokens``, never a count of streamed chunks (under
    MTP one chunk carries 1 + accepted tokens). ``spec`` is the response's
    ``metrics.speculative_decoding`` block when the server sends one (vLLM >= 0.32 with
    ``--per-request-spec-decode-metrics``). For a streamed generation, ``chunk_times`` holds the
    seconds from sending to each chunk that carried a choice. ``token_ids`` are the output's ids
    when asked for (vLLM's ``return_token_ids``) and sent; ``seconds`` is the whole request.
    """

    model: str
    text: str
    completion_tokens: int
    prompt_tokens: int | None
    finish_reason: str | None
    spec: specdecode.Delta | None = None
    chunk_times: tuple[float, ...] = ()
    usage: dict = field(default_factory=dict)
    token_ids: tuple[int, ...] | None = None
    seconds: float = 0.0


class VLLMClient:
    """Read-only view of one vLLM server at ``base_url`` (no trailing ``/v1``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = normalise_base_url(base_url)
        try:
            self._http = httpx.Client(
                base_url=self.base_url,
                timeout=timeout,
                headers=bearer(api_key),
                transport=transport,
            )
        except httpx.InvalidURL as exc:  # a URL that came past engine_url (a library caller's)
            raise UsageError(f"{self.base_url!r} is not a URL: {exc}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self, path: str, params=None) -> httpx.Response:
        try:
            return self._http.get(path, params=params)
        except httpx.TimeoutException as exc:
            raise EngineError(f"{self.base_url}{path} timed out") from exc
        except httpx.HTTPError as exc:
            raise EngineError(
                f"cannot reach {self.base_url}: {exc}",
                fix="is the engine running and the URL right?",
            ) from exc

    def _check_auth(self, resp: httpx.Response) -> None:
        if resp.status_code == 401:
            raise AuthError(f"{self.base_url}{resp.request.url.path}")

    def health_status(self) -> int:
        """The HTTP status ``/health`` answers (raises EngineError if unreachable)."""
        return self._get("/health").status_code

    def health(self) -> bool:
        """True when ``/health`` answers 200; False on any other status (raises if unreachable)."""
        return self.health_status() == 200

    def version(self) -> str:
        """The engine's vLLM version, from ``/version``."""
        resp = self._get("/version")
        self._check_auth(resp)
        try:
            resp.raise_for_status()
            return str(resp.json()["version"])
        except (httpx.HTTPStatusError, ValueError, KeyError, TypeError) as exc:
            raise NotVLLMError(f"{self.base_url} does not answer /version like vLLM") from exc

    def models(self) -> list[ServedModel]:
        """The served models, from ``/v1/models``."""
        resp = self._get("/v1/models")
        self._check_auth(resp)
        try:
            resp.raise_for_status()
            data = resp.json()["data"]
            return [ServedModel(m["id"], m.get("root"), m.get("max_model_len")) for m in data]
        except (httpx.HTTPStatusError, ValueError, KeyError, TypeError) as exc:
            raise NotVLLMError(f"{self.base_url} does not answer /v1/models like vLLM") from exc

    def generate(
        self,
        model: str,
        prompt: str | Sequence[dict],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        stream: bool = False,
        token_ids: bool = False,
        timeout: float | httpx.Timeout | None = None,
    ) -> Generation:
        """One chat completion of ``prompt`` (a user message, or the messages themselves).

        Streamed, it asks for the usage chunk and times every chunk; either way the token count
        is the server's ``usage.completion_tokens`` (an answer without it is an EngineError).
        """
        payload = chat_payload(
            model,
            prompt,
            max_tokens,
            temperature=temperature,
            seed=seed,
            stream=stream,
            token_ids=token_ids,
        )
        url = self.base_url + CHAT_PATH
        kw = {} if timeout is None else {"timeout": timeout}
        with _generation_errors(url):
            if not stream:
                start = time.perf_counter()
                resp = self._http.post(CHAT_PATH, json=payload, **kw)
                _check_generation(resp, self.base_url, resp.read, start)
                gen = _generation(url, model, resp.json(), (), None)
                return replace(gen, seconds=round(time.perf_counter() - start, 4))
            start = time.perf_counter()  # TTFT counts from the send, headers included
            with self._http.stream("POST", CHAT_PATH, json=payload, **kw) as resp:
                _check_generation(resp, self.base_url, resp.read, start)
                reader = _StreamReader(url, model, start)
                for line in resp.iter_lines():
                    reader.feed(line)
                return reader.generation()

    def metrics_text(self) -> str:
        """The raw Prometheus exposition of ``/metrics`` (bounded like every read of it)."""
        bound = max(v for v in (self._http.timeout.read, 5.0) if v is not None)
        try:
            status, body = metrics_reader.read_text("/metrics", timeout=bound, client=self._http)
            if status != 200:
                raise metrics_reader.MetricsReadError("status", "/metrics", status_code=status)
        except metrics_reader.MetricsReadError as exc:
            raise metrics_reader.engine_error(exc, self.base_url) from exc
        return body.decode("utf-8", errors="replace")

    def snapshot(self) -> specdecode.Snapshot:
        """The speculative-decoding counters now (a filtered read: only the series needed)."""
        bound = max(v for v in (self._http.timeout.read, 5.0) if v is not None)
        try:
            reading = metrics_reader.read(
                specdecode.SNAPSHOT_PATH, timeout=bound, client=self._http
            )
        except metrics_reader.MetricsReadError as exc:
            raise metrics_reader.engine_error(exc, self.base_url) from exc
        return reading.snapshot


def normalise_base_url(url: str) -> str:
    """``http://h:p`` from ``http://h:p/``, ``http://h:p/v1`` and the like."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


# A host name's labels (letters, digits, '-' and '_', which Docker's container names use), never
# starting with '-'; an IP address is checked by ipaddress instead.
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*(\.[A-Za-z0-9_][A-Za-z0-9_-]*)*\.?")
_URL_FIX = "give the engine's base URL, e.g. http://127.0.0.1:8000"


def engine_url(text: str, where: str = "URL") -> str:
    """``text`` as an engine's base URL (normalised as :func:`normalise_base_url` does), or a
    UsageError naming ``where`` it came from: only http or https (``ftp://h`` is not taken for
    a host called ``ftp``), a host name or IP address, a port within 1..65535, no user or
    password (the key goes in a header: --api-key-file)."""
    scheme, sep, rest = text.strip().partition("://")
    if sep and scheme.lower() not in ("http", "https"):
        raise UsageError(f"{where} {text!r}: scheme {scheme!r} is not http or https", fix=_URL_FIX)
    url = normalise_base_url(f"{scheme.lower()}://{rest}" if sep else scheme)

    def refuse(why: str) -> UsageError:
        return UsageError(f"{where} {url!r}: {why}", fix=_URL_FIX)

    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise refuse(str(exc)) from None
    if "@" in parts.netloc:  # not echoed back: the part before "@" may be a password
        raise UsageError(
            f"{where}: a user or password in the URL is not sent",
            fix="give the API key with --api-key-file; vLLM reads it from a Bearer header",
        )
    try:
        port = parts.port
    except ValueError:  # out of 0..65535, or not a number
        port = 0
    if port == 0:
        raise refuse("the port is not a number within 1..65535")
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if "[" in parts.netloc or len(host) > 253 or not _HOST_NAME.fullmatch(host):
            raise refuse(f"{host!r} is not a host name or IP address") from None
    try:
        httpx.URL(url)  # what the client will make of it
    except httpx.InvalidURL as exc:
        raise refuse(str(exc)) from None
    return url


CHAT_PATH = "/v1/chat/completions"


def chat_payload(
    model: str,
    prompt: str | Sequence[dict],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    stream: bool = False,
    token_ids: bool = False,
) -> dict:
    """The chat completion body of ``prompt`` (a user message, or the messages themselves)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    payload: dict = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if seed is not None:
        payload["seed"] = seed
    if token_ids:
        # vLLM's extension: the output ids in choices[0].token_ids. An engine that does not
        # know it ignores the key and answers without them (token_ids stays None).
        payload["return_token_ids"] = True
    if stream:
        payload |= {"stream": True, "stream_options": {"include_usage": True}}
    return payload


async def generate_streamed(
    http: httpx.AsyncClient,
    model: str,
    prompt: str | Sequence[dict],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    timeout: float | httpx.Timeout | None = None,
) -> Generation:
    """:meth:`VLLMClient.generate` streamed, on an async client whose ``base_url`` is the
    server: the same body, chunk timing and usage rule, for many requests in flight on one
    event loop (as ``vllm bench serve`` does with aiohttp)."""
    payload = chat_payload(
        model, prompt, max_tokens, temperature=temperature, seed=seed, stream=True
    )
    base = normalise_base_url(str(http.base_url))
    url = base + CHAT_PATH
    kw = {} if timeout is None else {"timeout": timeout}
    with _generation_errors(url):
        start = time.perf_counter()  # TTFT counts from the send, headers included
        async with http.stream("POST", CHAT_PATH, json=payload, **kw) as resp:
            if resp.status_code != 200:
                await resp.aread()
            _check_generation(resp, base, lambda: resp.content, start)
            reader = _StreamReader(url, model, start)
            # Read to the end of the body, past [DONE]: a response left unread closes its
            # connection, and the next request would pay a new one (vLLM's client reads on too).
            async for line in resp.aiter_lines():
                reader.feed(line)
            return reader.generation()


@contextlib.contextmanager
def _generation_errors(url: str) -> Iterator[None]:
    """httpx's failures during a generation at ``url``, as EngineErrors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise EngineError(f"{url} timed out") from exc
    except httpx.HTTPError as exc:
        raise EngineError(
            f"generation at {url} failed: {exc}",
            fix="is the engine running and the URL right?",
        ) from exc
    except ValueError as exc:  # a body that is not JSON
        raise EngineError(f"{url} answered something that is not JSON: {exc}") from exc


def _check_generation(
    resp: httpx.Response, base: str, body: Callable[[], bytes], start: float | None = None
) -> None:
    """Raise for a refused key, a request turned away (503: :class:`OverloadedError`, with the
    seconds since ``start``) or any other status but 200 (``body`` gives the answer's bytes)."""
    if resp.status_code == 401:
        raise AuthError(f"{base}{resp.request.url.path}")
    if resp.status_code == 503:
        seconds = 0.0 if start is None else time.perf_counter() - start
        raise OverloadedError(
            f"{base}{CHAT_PATH}",
            _error_message(body()),
            seconds,
            shed.retry_after(resp.headers.get("Retry-After")),
        )
    if resp.status_code != 200:
        text = body().decode(errors="replace")[:300]
        raise EngineError(f"{base}{CHAT_PATH} answered {resp.status_code}: {text}")


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body (vLLM's), else the body's start."""
    text = raw.decode(errors="replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]
    return str(message)[:300]


class _StreamReader:
    """One SSE stream, line by line: when each chunk that carries a choice arrived (the usage
    chunk carries none), the text, and the usage chunk."""

    def __init__(self, url: str, model: str, start: float) -> None:
        self.url, self.model, self.start = url, model, start
        self.times: list[float] = []
        self.parts: list[str] = []
        self.final: dict | None = None
        self.finish: str | None = None
        self.done = False

    def feed(self, line: str) -> None:
        """Take one line (anything after ``[DONE]`` is not the stream's)."""
        if self.done or not line.startswith("data:"):
            return  # blank separators and SSE comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        now = time.perf_counter()
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{self.url} streamed a chunk that is not JSON: {data[:80]}") from exc
        error = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(error, dict):
            # vLLM's error event: a request turned away after its response started (the
            # admission check in add_request, after the render: vLLM #58192) arrives as
            # HTTP 200 and this, with the status as its code.
            message = str(error.get("message"))[:300]
            if error.get("code") == 503:
                raise OverloadedError(self.url, message, now - self.start)
            raise EngineError(f"{self.url} streamed an error: {message}")
        if obj.get("choices"):
            self.times.append(now - self.start)
            choice = obj["choices"][0]
            self.parts.append((choice.get("delta") or {}).get("content") or "")
            self.finish = choice.get("finish_reason") or self.finish
        elif obj.get("usage"):
            self.final = obj

    def generation(self) -> Generation:
        """The stream read so far as a Generation (EngineError when it carried no token)."""
        if not self.times:
            raise EngineError(f"{self.url} streamed no tokens")
        text = "".join(self.parts)
        return _generation(self.url, self.model, self.final, tuple(self.times), (text, self.finish))


def _generation(
    url: str,
    model: str,
    body: dict | None,
    times: tuple[float, ...],
    streamed: tuple[str, str | None] | None,
) -> Generation:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict) or "completion_tokens" not in usage:
        # Counting chunks instead would be wrong under MTP; refuse rather than guess.
        hint = " (stream_options.include_usage unsupported?)" if streamed else ""
        raise EngineError(f"{url} sent no usage.completion_tokens{hint}")
    ids = None
    if streamed is None:
        try:
            choice = body["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
            finish = choice.get("finish_reason")
            raw_ids = choice.get("token_ids")
            ids = tuple(int(i) for i in raw_ids) if isinstance(raw_ids, list) else None
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            raise EngineError(f"{url} answered without choices") from exc
    else:
        text, finish = streamed
    return Generation(
        model=model,
        text=text,
        completion_tokens=int(usage["completion_tokens"]),
        prompt_tokens=usage.get("prompt_tokens"),
        finish_reason=finish,
        spec=specdecode.from_response_metrics(body),
        chunk_times=times,
        usage=usage,
        token_ids=ids,
    )
