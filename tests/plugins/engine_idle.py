"""Waiting for a real engine to be idle: what a test does before calls whose figures must be
exact (nothing else may run in the engine between their counter reads).

A call the client has left (a cancelled task, a stream closed unread) is still ending inside
vLLM for a moment: the API server notices the disconnect and aborts the request, and the engine
core steps once more to drop it (``has_requests`` counts finished requests not yet freed:
vllm/v1/core/sched/scheduler.py), publishing its running and waiting counts with that step's
outputs (vllm/v1/engine/core.py ``step``). The engine is idle when both gauges read 0 and the
finished-requests counter (``vllm:request_success_total``, every finish reason, aborts among
them) says the same on two reads in a row.
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from appliance.engine_api import specdecode
from appliance.engine_api.vllm_client import VLLMClient

BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
FINISHED = "vllm:request_success_total"


def _state(text: str) -> tuple[float, float]:
    """(running + waiting, finished) from a /metrics page."""
    busy = finished = 0.0
    wanted = "\n".join(ln for ln in text.splitlines() if ln.startswith((*BUSY, FINISHED)))
    for fam in text_string_to_metric_families(wanted + "\n"):
        for s in fam.samples:
            if s.name in BUSY:
                busy += s.value
            elif s.name == FINISHED:
                finished += s.value
    return busy, finished


def idle(obs: VLLMClient, within: float = 120.0) -> specdecode.Snapshot:
    """The engine's snapshot once it is idle (see the module's docstring); fails after
    ``within`` seconds of requests still running, waiting or finishing."""
    deadline = time.monotonic() + within
    last = None
    while True:
        now = _state(obs.metrics_text())
        if now[0] == 0 and now == last:
            return obs.snapshot()
        assert time.monotonic() < deadline, f"the engine never went idle: {now} (busy, finished)"
        last = now
        time.sleep(0.1)
