"""The agent's settings, read from ``APPLIANCE_AGENT_*`` and the standard ``OTEL_*`` variables."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..errors import UsageError

log = logging.getLogger("appliance.agent")

Attribution = Literal["auto", "request", "counters", "off"]
ATTRIBUTIONS = ("auto", "request", "counters", "off")


@dataclass(frozen=True)
class AgentConfig:
    """How the agent attributes MTP figures and how long it may spend doing so.

        ``attribution``: ``auto`` uses the response's per-request figures when the server sends them
        and ``/metrics`` snapshots otherwise; ``request`` never snapshots; ``counters`` always does;
        ``off`` records spans without MTP figures. ``snapshot_timeout`` bounds ONE ``/metrics`` read
        (connect, read and the whole body). Reads run off the caller's path, except one before a
    stream without ``include_usage`` (no usage comes back to prove the window with).
        ``failure_cooldown`` skips snapshots for that many seconds after one failed, so a hanging
        endpoint costs one bound per cooldown, not one per call.
    """

    attribution: Attribution = "auto"
    snapshot_timeout: float = 0.25
    failure_cooldown: float = 5.0
    metrics_url: str | None = None  # base URL of /metrics when not the client's own server
    capture_content: bool = False
    # Base URLs the instrumentor treats as vLLM without asking their /version.
    servers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.attribution not in ATTRIBUTIONS:
            raise UsageError(
                f"unknown attribution {self.attribution!r}", fix=f"use one of {ATTRIBUTIONS}"
            )
        if not (self.snapshot_timeout > 0 and math.isfinite(self.snapshot_timeout)):
            raise UsageError("snapshot_timeout must be a number of seconds > 0")
        if not (self.failure_cooldown >= 0 and math.isfinite(self.failure_cooldown)):
            raise UsageError("failure_cooldown must be a number of seconds >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentConfig:
        """Settings from the environment (``os.environ`` unless ``env`` is given).

        Never raises: a malformed variable must not stop the application from starting. It is
        logged (once per variable and value) and that setting keeps its default.
        """
        env = os.environ if env is None else env
        default = cls()
        values: dict = {}
        for field_name, var, convert in _VARIABLES:
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            try:
                value = convert(raw.strip())
                cls(**{field_name: value})  # the same checks as a direct construction
            except (ValueError, UsageError) as exc:
                _warn_once(var, raw, getattr(default, field_name), exc)
                continue
            values[field_name] = value
        # The variable the OpenTelemetry GenAI instrumentations use for the same switch.
        values["capture_content"] = env.get(
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", ""
        ).strip().lower() in ("1", "true", "yes")
        return cls(**values)


def _attribution(raw: str) -> str:
    if raw not in ATTRIBUTIONS:
        raise ValueError(f"not one of {', '.join(ATTRIBUTIONS)}")
    return raw


def _servers(raw: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in raw.split(",") if u.strip())


_VARIABLES = (
    ("attribution", "APPLIANCE_AGENT_ATTRIBUTION", _attribution),
    ("snapshot_timeout", "APPLIANCE_AGENT_SNAPSHOT_TIMEOUT", float),
    ("failure_cooldown", "APPLIANCE_AGENT_FAILURE_COOLDOWN", float),
    ("metrics_url", "APPLIANCE_AGENT_METRICS_URL", str),
    ("servers", "APPLIANCE_AGENT_SERVERS", _servers),
)

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(var: str, raw: str, default, exc: Exception) -> None:
    with _warned_lock:
        if (var, raw) in _warned:
            return
        _warned.add((var, raw))
    log.warning("ignoring %s=%r (%s); using the default %r", var, raw, exc, default)
