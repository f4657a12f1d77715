"""The unit's timings: start timeout, restart delay, stop grace and the start limit.

One unit serves every instance, so these are the same for all profiles; the start limit is
derived from the others so that a slowly failing start still trips it
(gotchas/unit-restarts-and-start-limit.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..serve import docker as serve_docker

START_TIMEOUT_S = 1800
RESTART_SEC = 15
STOP_GRACE_S = serve_docker.STOP_GRACE_S  # docker stop's grace; vLLM drains within it
DRAIN_S = serve_docker.DRAIN_S  # vLLM's --shutdown-timeout
STOP_TIMEOUT_S = STOP_GRACE_S + 30
START_LIMIT_BURST = 3
# systemd counts starts in a fixed window and refuses the one after the burst: the window must
# hold burst starts that each hang to the start timeout and wait the restart delay, or a slowly
# failing image is reloaded forever. The margin covers ExecStartPre/ExecStopPost.
START_LIMIT_MARGIN_S = 600


@dataclass(frozen=True)
class UnitTiming:
    """The unit's restart and start-limit timings (one unit serves every profile)."""

    start_timeout_s: int
    restart_sec: int
    stop_timeout_s: int
    start_limit_burst: int
    start_limit_interval_s: int
    start_limit_margin_s: int = START_LIMIT_MARGIN_S


def start_limit_interval(start_timeout_s: int, restart_sec: int, burst: int) -> int:
    """The smallest ``StartLimitIntervalSec`` that still trips when every start fails slowly:
    ``burst`` starts, each hanging to ``start_timeout_s`` then waiting ``restart_sec``, plus
    :data:`START_LIMIT_MARGIN_S`."""
    return burst * (start_timeout_s + restart_sec) + START_LIMIT_MARGIN_S


def unit_timing() -> UnitTiming:
    """The timings the unit is rendered with: the unit is shared by every instance, so its
    timeouts are the largest any shipped profile needs (the 31B models' loads), the same for
    all."""
    return UnitTiming(
        start_timeout_s=START_TIMEOUT_S,
        restart_sec=RESTART_SEC,
        stop_timeout_s=STOP_TIMEOUT_S,
        start_limit_burst=START_LIMIT_BURST,
        start_limit_interval_s=start_limit_interval(
            START_TIMEOUT_S, RESTART_SEC, START_LIMIT_BURST
        ),
    )
