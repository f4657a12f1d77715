"""One greedy chat completion with its output token ids: what the canary sends per case.

``return_token_ids`` (vLLM's extension of the chat API; read in 0.32's chat protocol) puts the
generated ids in ``choices[0].token_ids``. An engine that does not know it answers without them
(its request model ignores extra keys), and the canary then compares that record by text. The
request is non-streaming: the canary wants the final answer, not timings. Errors are the family
of :mod:`appliance.vllm_client`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import httpx

from ..errors import AuthError, EngineError
from ..vllm_client import bearer, normalise_base_url

PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Answer:
    """One answer: text, output token ids (None when the engine sent none), usage, time."""

    text: str
    token_ids: tuple[int, ...] | None
    completion_tokens: int
    finish_reason: str | None
    seconds: float


class CanaryClient:
    """Sends the canary's requests to one endpoint (``base_url`` without ``/v1``)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 300.0):
        self.base_url = normalise_base_url(base_url)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=bearer(api_key))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def answer(self, model: str, messages: Sequence[dict], *, max_tokens: int, seed: int) -> Answer:
        """The greedy (temperature 0) answer to ``messages``."""
        payload = {
            "model": model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": seed,
            "return_token_ids": True,
        }
        url = self.base_url + PATH
        start = time.perf_counter()
        try:
            resp = self._http.post(PATH, json=payload)
        except httpx.TimeoutException as exc:
            raise EngineError(f"{url} timed out") from exc
        except httpx.HTTPError as exc:
            raise EngineError(
                f"canary request to {url} failed: {exc}",
                fix="is the engine running and the URL right?",
            ) from exc
        seconds = time.perf_counter() - start
        if resp.status_code == 401:
            raise AuthError(url)
        if resp.status_code != 200:
            raise EngineError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            return _answer(resp.json(), seconds)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"{url} answered something that is not a chat completion: {exc}")


def _answer(body: dict, seconds: float) -> Answer:
    choice = body["choices"][0]
    usage = body["usage"]
    # Output tokens are the server's count, never a count of ids or characters.
    completion_tokens = int(usage["completion_tokens"])
    ids = choice.get("token_ids")
    return Answer(
        text=(choice.get("message") or {}).get("content") or "",
        token_ids=tuple(int(i) for i in ids) if isinstance(ids, list) else None,
        completion_tokens=completion_tokens,
        finish_reason=choice.get("finish_reason"),
        seconds=round(seconds, 4),
    )
