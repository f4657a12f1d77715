"""The agent's settings, read from ``APPLIANCE_AGENT_*`` and the standard ``OTEL_*`` variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ..errors import UsageError

Attribution = Literal["auto", "request", "counters", "off"]
ATTRIBUTIONS = ("auto", "request", "counters", "off")


@dataclass(frozen=True)
class AgentConfig:
    """How the agent attributes MTP figures and how long it may spend doing so.

    ``attribution``: ``auto`` uses the response's per-request figures when the server sends them
    and ``/metrics`` snapshots otherwise; ``request`` never snapshots; ``counters`` always does;
    ``off`` records spans without MTP figures. ``snapshot_timeout`` bounds ONE ``/metrics`` read
    (connect, read and the whole body), so a call is delayed by at most twice that.
    ``failure_cooldown`` skips snapshots for that many seconds after one failed, so a hanging
    endpoint costs one bound per cooldown, not one per call.
    """

    attribution: Attribution = "auto"
    snapshot_timeout: float = 0.25
    failure_cooldown: float = 5.0
    metrics_url: str | None = None  # base URL of /metrics when not the client's own server
    capture_content: bool = False

    def __post_init__(self) -> None:
        if self.attribution not in ATTRIBUTIONS:
            raise UsageError(
                f"unknown attribution {self.attribution!r}", fix=f"use one of {ATTRIBUTIONS}"
            )
        if self.snapshot_timeout <= 0:
            raise UsageError("snapshot_timeout must be > 0")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> AgentConfig:
        """Settings from the environment (``os.environ`` unless ``env`` is given)."""
        env = os.environ if env is None else env
        try:
            return cls(
                attribution=env.get("APPLIANCE_AGENT_ATTRIBUTION", "auto"),  # type: ignore[arg-type]
                snapshot_timeout=float(env.get("APPLIANCE_AGENT_SNAPSHOT_TIMEOUT", "0.25")),
                failure_cooldown=float(env.get("APPLIANCE_AGENT_FAILURE_COOLDOWN", "5")),
                metrics_url=env.get("APPLIANCE_AGENT_METRICS_URL") or None,
                # The variable the OpenTelemetry GenAI instrumentations use for the same switch.
                capture_content=env.get(
                    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", ""
                ).lower() in ("1", "true", "yes"),
            )
        except ValueError as exc:
            raise UsageError(f"bad agent setting in the environment: {exc}") from exc
