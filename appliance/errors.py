"""The one exception family for user-facing errors.

The CLI prints an ``ApplianceError`` as a single line (``Error: ...``), with the fix when one is
known, and exits with ``exit_code``; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ApplianceError(Exception):
    """An error the operator can act on."""

    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} ({self.fix})" if self.fix else self.message


class UsageError(ApplianceError):
    """Bad input from the operator: a wrong name, path or value."""

    exit_code = 2


class EngineError(ApplianceError):
    """The vLLM engine could not be started, reached or understood."""


class NotVLLMError(EngineError):
    """Something answered, but it is not a vLLM OpenAI-compatible server."""


class OverloadedError(EngineError):
    """The engine turned the request away with 503: its queue bound is reached (vLLM's
    ``--max-num-queued-reqs``/``--max-num-queued-tokens``); a later try, or another instance,
    may be let in. ``seconds``: how long the answer took; ``retry_after``: the seconds the
    server's ``Retry-After`` asked for (None when it sent none)."""

    def __init__(
        self, url: str, detail: str, seconds: float = 0.0, retry_after: float | None = None
    ) -> None:
        super().__init__(
            f"{url} answered 503: {detail}",
            fix="retry later or on another instance; if it lasts, add capacity or raise the "
            "profile's queue bound (gotchas/queue-bound.md)",
        )
        self.seconds = seconds
        self.retry_after = retry_after


class AuthError(EngineError):
    """The server refused the request's API key (HTTP 401): the one message for every caller."""

    def __init__(self, url: str) -> None:
        super().__init__(
            f"{url} answered 401: the API key is missing or wrong",
            fix="send the key the server was started with: --api-key-file, --api-key or "
            "VLLM_API_KEY (an installed instance's is /etc/gemma4-vllm/<instance>.api-key)",
        )
