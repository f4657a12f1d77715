"""A small client that observes a vLLM server: health, version, models, speculative counters.

It reads; it never changes the server. Every failure becomes an :class:`EngineError` (or
:class:`NotVLLMError` when something answers that is not vLLM) with the URL in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from . import specdecode
from .errors import EngineError, NotVLLMError


@dataclass(frozen=True)
class ServedModel:
    """One entry of ``/v1/models``."""

    id: str
    root: str | None
    max_model_len: int | None


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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, headers=headers, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VLLMClient:
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
            raise EngineError(
                f"{self.base_url}{resp.request.url.path} answered 401: the API key is missing or wrong",
                fix="give the key the server was started with",
            )

    def health(self) -> bool:
        """True when ``/health`` answers 200; False on any other status (raises if unreachable)."""
        return self._get("/health").status_code == 200

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

    def metrics_text(self) -> str:
        """The raw Prometheus exposition of ``/metrics``."""
        resp = self._get("/metrics")
        if resp.status_code != 200:
            raise EngineError(f"{self.base_url}/metrics answered {resp.status_code}")
        return resp.text

    def snapshot(self) -> specdecode.Snapshot:
        """The speculative-decoding counters now (a filtered read: only the series needed)."""
        resp = self._get(specdecode.SNAPSHOT_PATH, params=specdecode.SNAPSHOT_PARAMS)
        if resp.status_code != 200:
            raise EngineError(f"{self.base_url}/metrics answered {resp.status_code}")
        try:
            return specdecode.parse(resp.text)
        except specdecode.MetricsParseError as exc:
            raise NotVLLMError(f"{self.base_url}/metrics: {exc}") from exc


def normalise_base_url(url: str) -> str:
    """``http://h:p`` from ``http://h:p/``, ``http://h:p/v1`` and the like."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url
