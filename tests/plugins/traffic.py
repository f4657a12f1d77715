"""Steady client traffic on an engine through an operation, every request classified.

:class:`Traffic` keeps several clients calling an instance's URL on 127.0.0.1 (with its API key
when it has one) while a test runs an operation (a cutover, a rollback, a stop, a fleet roll):
half of them stream long chat completions one after another (``ignore_eos`` to ``max_tokens``
near the tiny model's 512-token context, each client its own length, so that some request is
always running whenever a stop comes), the other half alternate short plain and short streamed
calls. Every request asks for ``ignore_eos``, so what a whole answer is is known in advance:
finish reason ``length`` and ``usage.completion_tokens`` equal to ``max_tokens``.

Each request ends in one class:

- ``whole``: answered 200 and complete (finish reason and usage equal what was asked);
- ``refused``: turned away so that a client can retry: 503 (vLLM's admission at the queue bound,
  a stopping server), a 503 error event before any token, or a refused connection (nothing
  listens while the engine is down); also a connection reset before any answer within
  ``REFUSAL_GAP_S`` of another refusal: the kernel resets the connections still queued on a
  listening socket when vLLM closes it at the drain's end, so the request never reached the
  server (counted apart as ``reset`` in the summary: the stop's one residual race, issue 52);
- ``cut``: accepted (200) and then ended short: a stream without its finish or usage, a body
  cut off, an error event after tokens, a finish that is not ``length``;
- ``error``: anything else: a 500, another status, a connection dropped with no answer, a
  timeout, a request still running when the harness ended.

The promise every operation keeps (issue 52): nothing ``cut``, nothing ``error``. The harness is
bounded (``max_seconds``, ``max_requests``) and stops by itself; a refused client waits
``retry_s`` (or the 503's ``Retry-After``, as a client told so would) before its next call, and
a client of short calls
``think_s`` after each. One connection per request:
a pooled keep-alive connection closed by the server between two calls would read as an error
that no client of the instance sees. Standard library and httpx only: the traffic benchmark
(benchmarks/traffic.py) runs it too.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Self

import httpx

from appliance.engine_api import shed

WHOLE, REFUSED, CUT, ERROR = "whole", "refused", "cut", "error"
# Every run of the harness in this process: (test, label, report), for the table at the end.
FINISHED: list[tuple[str, str, Report]] = []
CLASSES = (WHOLE, REFUSED, CUT, ERROR)

# The tiny model's context is 512 tokens; the prompt takes about 30 of them with the template.
LONG_TOKENS = (440, 400, 360, 320)
SHORT_TOKENS = (8, 16, 24, 32)
# Refusals closer together than this belong to one stretch of the instance refusing traffic
# (a refused client calls again every ``retry_s``).
REFUSAL_GAP_S = 3.0
RESET = "reset before any answer while the instance refused traffic"


@dataclass(frozen=True)
class Outcome:
    """One request: how it was asked, when it ran (monotonic seconds), its class and why."""

    client: int
    stream: bool
    max_tokens: int
    start: float
    end: float
    cls: str
    status: int | None = None
    detail: str = ""


@dataclass
class Report:
    """Every outcome of one run of the harness, and what they add up to."""

    outcomes: list[Outcome]
    started: float
    stopped: float

    def of(self, cls: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.cls == cls]

    def counts(self) -> dict[str, int]:
        c = Counter(o.cls for o in self.outcomes)
        return {cls: c[cls] for cls in CLASSES}

    def refused_windows(self, down: bool = False) -> list[tuple[float, float]]:
        """Stretches (start, end; seconds since the harness started) in which the instance
        turned requests away (``down``: refused their connections, nothing listening):
        refusals closer than ``REFUSAL_GAP_S`` make one stretch, which runs from the first
        refused request's start to the last one's answer."""
        refused = [o for o in self.of(REFUSED) if o.status is None or not down]
        spans = sorted((o.start, o.end) for o in refused)
        windows: list[list[float]] = []
        for start, end in spans:
            if windows and start - windows[-1][1] <= REFUSAL_GAP_S:
                windows[-1][1] = max(windows[-1][1], end)
            else:
                windows.append([start, end])
        return [(a - self.started, b - self.started) for a, b in windows]

    @property
    def refused_seconds(self) -> float:
        """How long, in all, the instance turned traffic away (503s and refused connections)."""
        return sum(b - a for a, b in self.refused_windows())

    @property
    def down_seconds(self) -> float:
        """How long, in all, nothing listened (connections refused)."""
        return sum(b - a for a, b in self.refused_windows(down=True))

    def shed(self) -> int:
        """Refused requests that got an answer (503), not a refused connection."""
        return sum(o.status is not None for o in self.of(REFUSED))

    def drained(self) -> list[Outcome]:
        """Whole requests that were running while the instance turned others away (a stop's
        drain finished them, or they were let in beside the refusals at the queue bound)."""
        refused = [o.end for o in self.of(REFUSED)]
        return [o for o in self.of(WHOLE) if any(o.start < t < o.end for t in refused)]

    def whole_after_refusals(self) -> list[Outcome]:
        """Whole requests that started after the last refusal: the instance served again."""
        last = max((o.end for o in self.of(REFUSED)), default=self.started)
        return [o for o in self.of(WHOLE) if o.start > last]

    def summary(self) -> str:
        """The counts by class, the refused stretches and the first few broken requests."""
        c = self.counts()
        windows = ", ".join(f"+{a:.1f}..{b:.1f} s" for a, b in self.refused_windows())
        lines = [
            f"traffic: {len(self.outcomes)} requests in {self.stopped - self.started:.1f} s: "
            + ", ".join(f"{cls} {c[cls]}" for cls in CLASSES),
            (
                f"  refused traffic for {self.refused_seconds:.1f} s ({windows or 'never'}): "
                f"{self.shed()} answered 503, {c[REFUSED] - self.shed()} connections refused "
                f"over {self.down_seconds:.1f} s "
                f"({sum(o.detail.startswith(RESET) for o in self.of(REFUSED))} reset); "
                f"{len(self.drained())} whole while others were refused, "
                f"{len(self.whole_after_refusals())} whole after the last refusal"
            ),
        ]
        for o in [*self.of(CUT), *self.of(ERROR)][:8]:
            kind = "stream" if o.stream else "plain"
            lines.append(
                f"  {o.cls}: client {o.client} {kind} max_tokens={o.max_tokens} "
                f"+{o.start - self.started:.1f}..{o.end - self.started:.1f} s "
                f"status {o.status}: {o.detail}"
            )
        return "\n".join(lines)

    def around_first_refusal(self, seconds: float = 3.0) -> str:
        """Every request that ran within ``seconds`` of the first refused one, for a failure's
        message: what was in flight when the instance began to turn traffic away."""
        first = min((o.start for o in self.of(REFUSED)), default=self.started)
        near = [o for o in self.outcomes if o.end >= first - seconds and o.start <= first + seconds]
        rows = [
            f"client {o.client} {'stream' if o.stream else 'plain'} {o.max_tokens} "
            f"+{o.start - self.started:.2f}..{o.end - self.started:.2f} s {o.cls} {o.status}"
            for o in near
        ]
        return "in flight around the first refusal:\n    " + "\n    ".join(rows)

    def promise(
        self, *, down: bool = False, back: bool = False, drain: bool | None = None
    ) -> str | None:
        """None when the promise held, else what broke, with the summary. The promise: nothing
        cut, nothing errored, some traffic served whole. ``down``: the operation took the
        engine down (a stop, a restart), so traffic was turned away at some point and (unless
        ``drain`` is false) a request running then still finished whole (the drain). ``back``:
        the engine served again after the last refusal."""
        drain = down if drain is None else drain
        c = self.counts()
        broke = []
        if c[CUT] or c[ERROR]:
            broke.append("cut and error must be 0")
        if not c[WHOLE]:
            broke.append("nothing was served whole")
        if down and not c[REFUSED]:
            broke.append("never refused: the traffic did not span the engine's stop")
        if drain and c[REFUSED] and not self.drained():
            broke.append("no request running while traffic was refused finished whole")
            broke.append(self.around_first_refusal())
        if back and not self.whole_after_refusals():
            broke.append("nothing served whole after the last refusal")
        if broke:
            return f"the traffic promise broke ({'; '.join(broke)}):\n{self.summary()}"
        return None


# `appliance cutover --live-acceptance-window` under this traffic: the tiny engine drafts
# hundreds of tokens a second, so half-second windows hold the rule's least evidence and each
# side settles in about 5 s instead of 20 (the default 2 s windows are a real host's).
LIVE_WINDOW = ("--live-acceptance-window", "0.5")


@dataclass
class _Client:
    """One client's plan: its index, whether it streams long answers, its lengths."""

    index: int
    long: bool
    running_since: float | None = None
    running_stream: bool = False
    running_tokens: int = 0
    wait_s: float = 0.0  # the last 503's Retry-After


class Traffic:
    """Clients calling ``url`` until :meth:`stop` (or their bounds); a context manager.

    ``clients`` should exceed the profile's queue bound where it has one (vLLM's
    ``--max-num-queued-reqs``) so that admission turns some away."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        clients: int = 6,
        model: str = "gemma4-tiny",
        max_seconds: float = 1500.0,
        max_requests: int = 20000,
        retry_s: float = 0.5,
        think_s: float = 0.2,
        read_timeout: float = 300.0,
        long_tokens: tuple[int, ...] = LONG_TOKENS,
        label: str = "traffic",
    ) -> None:
        if not url.startswith("http://127.0.0.1:"):
            raise ValueError(f"traffic goes to 127.0.0.1 only, not {url}")
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.max_seconds, self.max_requests = max_seconds, max_requests
        self.retry_s, self.think_s = retry_s, think_s
        self.timeout = httpx.Timeout(read_timeout, connect=5.0)
        self.clients = [_Client(i, long=i % 2 == 0) for i in range(clients)]
        # A stop lets a request in flight finish within the drain (--shutdown-timeout 50): an
        # engine without MTP decodes a token a step, so its long answers are shorter.
        self.long_tokens = long_tokens
        self._outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._flowing = threading.Event()
        self._last_refused = float("-inf")
        self._threads: list[threading.Thread] = []
        self.started = 0.0
        self.label = label
        self.report: Report | None = None

    def __enter__(self) -> Self:
        """Start, and wait until the traffic reaches the engine."""
        return self.start().wait_flowing()

    def __exit__(self, *exc: object) -> None:
        """Stop; the report is :attr:`report` (printed, for the test's output, and kept for the
        run's table of operations under traffic)."""
        self.report = self.stop()
        print(f"{self.label}: {self.report.summary()}", flush=True)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("::")[-1]
        FINISHED.append((test, self.label, self.report))

    def start(self) -> Self:
        self.started = time.monotonic()
        for c in self.clients:
            t = threading.Thread(target=self._run, args=(c,), name=f"traffic-{c.index}")
            t.daemon = True  # a client stuck past its timeout never holds the test run
            t.start()
            self._threads.append(t)
        return self

    def wait_flowing(self, timeout: float = 300.0) -> Self:
        """Wait until some call was let in (answered 200): the traffic reaches the engine.
        Not every client: past a queue bound some may be turned away for a long while."""
        if not self._flowing.wait(timeout):
            raise TimeoutError(f"traffic: no call to {self.url} was let in within {timeout} s")
        return self

    def wait_back(self, timeout: float = 120.0) -> bool:
        """Wait until a request that started after the last refusal so far ended whole (the
        engine serves again after an operation); whether one did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = Report(self.so_far(), self.started, time.monotonic())
            if now.whole_after_refusals():
                return True
            self._done.wait(0.2)
        return False

    def so_far(self) -> list[Outcome]:
        """The requests that ended so far."""
        with self._lock:
            return list(self._outcomes)

    def wait_ended(self, timeout: float) -> bool:
        """Wait until every client ended by itself (its bounds reached); whether they did."""
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def stop(self) -> Report:
        """No new calls; wait for every call in flight to end; the report."""
        self._done.set()
        for t in self._threads:
            t.join(self.timeout.read + 30)
        stopped = time.monotonic()
        with self._lock:
            outcomes = list(self._outcomes)
            for c, t in zip(self.clients, self._threads, strict=True):
                if t.is_alive() and c.running_since is not None:
                    outcomes.append(
                        Outcome(
                            c.index,
                            c.running_stream,
                            c.running_tokens,
                            c.running_since,
                            stopped,
                            ERROR,
                            detail="still running when the harness ended",
                        )
                    )
        return Report(sorted(outcomes, key=lambda o: o.start), self.started, stopped)

    def _more(self) -> bool:
        if self._done.is_set() or time.monotonic() - self.started > self.max_seconds:
            return False
        with self._lock:
            return len(self._outcomes) < self.max_requests

    def _run(self, c: _Client) -> None:
        k = c.index % len(SHORT_TOKENS)
        shorts = itertools.cycle(SHORT_TOKENS[k:] + SHORT_TOKENS[:k])
        # One client per thread (building one costs ~0.1 CPU-s), no connection kept between
        # calls (see the module's docstring).
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=self.timeout, limits=limits) as http:
            for n in itertools.count():
                if not self._more():
                    return
                stream = c.long or n % 2 == 1
                tokens = (
                    self.long_tokens[(c.index // 2) % len(self.long_tokens)]
                    if c.long
                    else next(shorts)
                )
                c.running_since, c.running_stream = time.monotonic(), stream
                c.running_tokens = tokens
                out = self._call(http, c, n, stream, tokens)
                with self._lock:
                    self._outcomes.append(out)
                    c.running_since = None
                    if out.cls == REFUSED:
                        self._last_refused = max(self._last_refused, out.end)
                if out.cls != WHOLE:
                    self._done.wait(max(self.retry_s, c.wait_s))
                    c.wait_s = 0.0
                elif not c.long:
                    # A short call's client thinks a moment: back to back, six clients' HTTP and
                    # tokenizing alone took most of two cores and doubled a fleet roll's time.
                    self._done.wait(self.think_s)

    def _call(self, http: httpx.Client, c: _Client, n: int, stream: bool, tokens: int) -> Outcome:
        body: dict = {
            "model": self.model,
            "messages": [
                {"role": "user", "content": f"Client {c.index}, call {n}: count to a thousand."}
            ],
            "max_tokens": tokens,
            "ignore_eos": True,  # vLLM's extension: a whole answer has exactly max_tokens
            "temperature": 0,
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        start = time.monotonic()

        def done(cls: str, status: int | None = None, detail: str = "") -> Outcome:
            return Outcome(c.index, stream, tokens, start, time.monotonic(), cls, status, detail)

        try:
            with http.stream("POST", self.url, json=body, headers=self.headers) as resp:
                status = resp.status_code
                if status != 200:
                    text = resp.read().decode(errors="replace")[:300]
                    c.wait_s = shed.retry_after(resp.headers.get("retry-after")) or 0.0
                    return done(REFUSED if status == 503 else ERROR, status, text)
                self._flowing.set()
                try:
                    read = _read_stream if stream else _read_plain
                    cls, detail = read(resp, tokens)
                except httpx.HTTPError as exc:  # accepted, then the body broke off
                    return done(CUT, status, f"{type(exc).__name__}: {exc}")
                return done(cls, status, detail)
        except httpx.ConnectError as exc:
            if "refused" in str(exc).lower():
                return done(REFUSED, None, "connection refused")
            return done(ERROR, None, f"ConnectError: {exc}")
        except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
            with self._lock:
                refusing = time.monotonic() - self._last_refused <= REFUSAL_GAP_S
            if refusing:
                return done(REFUSED, None, f"{RESET}: {type(exc).__name__}: {exc}")
            return done(ERROR, None, f"{type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:  # no answer at all: dropped, timed out
            return done(ERROR, None, f"{type(exc).__name__}: {exc}")


def _whole(finish: str | None, tokens: int | None, asked: int) -> tuple[str, str]:
    if finish == "length" and tokens == asked:
        return WHOLE, ""
    return CUT, f"finish {finish!r}, {tokens} of {asked} tokens"


def _read_plain(resp: httpx.Response, asked: int) -> tuple[str, str]:
    raw = resp.read()
    try:
        data = json.loads(raw)
        finish = data["choices"][0]["finish_reason"]
        tokens = data["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        return CUT, f"body not a whole completion: {raw[:200]!r}"
    return _whole(finish, tokens, asked)


def _read_stream(resp: httpx.Response, asked: int) -> tuple[str, str]:
    finish = tokens = None
    chunks, ended = 0, False
    for line in resp.iter_lines():
        if line == "data: [DONE]":
            ended = True
            continue
        if not line.startswith("data: "):
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            # vLLM reports a failure after the 200 as an error event (code 503 when admission
            # turned the request away before it ran).
            err = chunk["error"]
            code = err.get("code") if isinstance(err, dict) else None
            if code == 503 and chunks == 0:
                return REFUSED, f"error event before any token: {err}"
            return CUT, f"error event after {chunks} chunks: {err}"
        for choice in chunk.get("choices") or ():
            chunks += 1
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens")
    if not ended:
        return CUT, f"no [DONE] after {chunks} chunks (finish {finish!r}, {tokens} tokens)"
    return _whole(finish, tokens, asked)


def pytest_terminal_summary(terminalreporter) -> None:
    """The operations run under traffic in this run, each with its requests by class."""
    if not FINISHED:
        return
    terminalreporter.section("operations under traffic (tests/plugins/traffic.py)")
    terminalreporter.write_line(
        f"{'test':<62} {'traffic':<36} whole  503 refused  cut error refusing s"
    )
    for test, label, r in FINISHED:
        c = r.counts()
        terminalreporter.write_line(
            f"{test[:62]:<62} {label[:36]:<36} {c[WHOLE]:5} {r.shed():4} "
            f"{c[REFUSED] - r.shed():7} {c[CUT]:4} {c[ERROR]:5} {r.refused_seconds:10.1f}"
        )
