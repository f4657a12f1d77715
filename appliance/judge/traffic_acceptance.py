"""Draft acceptance of the traffic an engine really serves, in short windows of its ``/metrics``.

The cutover is not on the request path: the per-request figures vLLM puts in each response
(``--per-request-spec-decode-metrics``) go to the clients, and the telemetry agent's per-call
histograms live in the clients' processes, when they run it at all. What the host can read is
the engine's four counters (vllm/v1/spec_decode/metrics.py: ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._per_pos``; vLLM 0.32 has no
per-request acceptance series). So a stretch of traffic is read as **windows**: the counters'
movement between reads at least ``window_s`` apart, a window closing once it holds
``min_draft_tokens`` (so that one two-token draft is not a sample of 0 or 1). Each window's
acceptance is :mod:`specdecode`'s (accepted / draft tokens); ``vllm:request_success`` says how
many calls finished in it. A restart between two reads (counters reset) starts a new window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ..engine_api import metrics_reader, specdecode
from . import noninferiority


@dataclass(frozen=True)
class Settings:
    """How the windows are read."""

    window_s: float = 2.0
    min_draft_tokens: int = 16
    read_timeout: float = 5.0


@dataclass(frozen=True)
class Window:
    """The counters' movement over one window and the calls that finished in it (``None``
    when the engine exposes no request counter)."""

    seconds: float
    delta: specdecode.Delta
    calls: int | None

    @property
    def acceptance(self) -> float:
        return self.delta.acceptance or 0.0


@dataclass(frozen=True)
class Traffic:
    """One stretch of sampling: its windows, how long it took, and what it saw besides.

    ``speculative`` False: the engine exposes no speculative-decoding counters (no MTP);
    ``busy``: something moved between two reads (drafts made, requests finished);
    ``failed_reads``: reads that failed (an engine still starting, a timeout)."""

    windows: tuple[Window, ...] = ()
    seconds: float = 0.0
    speculative: bool = True
    busy: bool = False
    failed_reads: int = 0

    @property
    def calls(self) -> int | None:
        """Calls finished over the windows (``None``: the engine does not count them)."""
        known = [w.calls for w in self.windows if w.calls is not None]
        return sum(known) if known or not self.windows else None

    def side(self) -> noninferiority.Side:
        """The windows' acceptances as one side of :func:`noninferiority.judge`."""
        return noninferiority.Side(tuple(w.acceptance for w in self.windows), self.calls)

    def summed(self) -> specdecode.Delta | None:
        """Every window's counters added up (the stretch's engine-wide figures)."""
        return specdecode.summed([w.delta for w in self.windows])

    def describe(self) -> str:
        """One clause: windows, calls, the stretch's acceptance."""
        total = self.summed()
        acc = total.acceptance if total is not None else None
        calls = "unknown" if self.calls is None else self.calls
        figure = f", acceptance {acc:.1%} over them" if acc is not None else ""
        return f"{len(self.windows)} windows, {calls} calls in {self.seconds:.0f} s{figure}"


Until = Callable[[Traffic], bool]


def sample(
    base_url: str,
    *,
    until: Until,
    limit_s: float,
    idle_s: float | None = None,
    settings: Settings = Settings(),
    client: httpx.Client | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> Traffic:
    """Read windows of ``base_url``'s counters until ``until(traffic)`` holds, ``limit_s``
    passes, or (with ``idle_s``) nothing moved at all for ``idle_s``: no drafts, no call
    finished (the engine serves no traffic). Stops at once on an engine without
    speculative-decoding counters."""
    url = base_url.rstrip("/") + specdecode.SNAPSHOT_PATH
    own = client is None
    http = client or httpx.Client()
    start = time.monotonic()
    windows: list[Window] = []
    failed = 0
    busy = False
    last_note = start

    def now_traffic(speculative: bool = True) -> Traffic:
        took = round(time.monotonic() - start, 2)
        return Traffic(tuple(windows), took, speculative, busy, failed)

    def read() -> metrics_reader.Reading | None:
        nonlocal failed
        try:
            return metrics_reader.read(url, timeout=settings.read_timeout, client=http)
        except metrics_reader.MetricsReadError:
            failed += 1
            return None

    try:
        opened = read()
        while not until(now_traffic()):
            left = start + limit_s - time.monotonic()
            if left <= 0:
                break
            if idle_s is not None and not busy and time.monotonic() - start >= idle_s:
                break
            time.sleep(min(settings.window_s, left))
            cur = read()
            if cur is None:
                continue
            if opened is None:
                opened = cur
                continue
            if not cur.snapshot.speculative and not opened.snapshot.speculative:
                return now_traffic(speculative=False)
            busy = busy or _moved(opened, cur)
            d = specdecode.delta(opened.snapshot, cur.snapshot)
            if d.status != "ok":
                opened = cur  # a restart in between: the movement is unknown, start again
            elif (d.draft_tokens or 0) >= settings.min_draft_tokens:
                windows.append(Window(round(cur.at - opened.at, 3), d, _finished(opened, cur)))
                opened = cur
            if time.monotonic() - last_note >= 10:
                last_note = time.monotonic()
                progress(f"live acceptance: {now_traffic().describe()} so far")
        return now_traffic()
    finally:
        if own:
            http.close()


def _finished(a: metrics_reader.Reading, b: metrics_reader.Reading) -> int | None:
    """Requests finished between two reads (None when not counted, or the count went back)."""
    if a.finished_requests is None or b.finished_requests is None:
        return None
    done = b.finished_requests - a.finished_requests
    return round(done) if done >= 0 else None


def _moved(a: metrics_reader.Reading, b: metrics_reader.Reading) -> bool:
    """Anything served between two reads: drafts made or a call finished."""
    d = specdecode.delta(a.snapshot, b.snapshot)
    return bool(d.status == "ok" and d.drafts) or bool(_finished(a, b))
