"""``--middleware stop_gate.StopGate``: from the container's SIGTERM on, vLLM's API server turns
every new request away so that its client retries (503 with ``Retry-After``, then a refused
connection), while the requests already in flight drain.

Why (vLLM 0.32, checked in its source):

- ``serve_http``'s ``handle_shutdown`` (``vllm/entrypoints/launchers/launcher.py``) awaits
  ``engine_client.shutdown(timeout=--shutdown-timeout)`` and only then sets
  ``server.should_exit``: the HTTP server keeps accepting for the whole drain;
- ``AsyncLLM.shutdown`` (``vllm/v1/engine/async_llm.py``) first shuts the renderer's thread pool
  (``renderers/base.py`` ``BaseRenderer.shutdown``), so a request arriving during the drain fails
  with ``RuntimeError: cannot schedule new futures after shutdown``: HTTP 500;
- the engine core rejects a request added once its shutdown began
  (``vllm/v1/engine/core.py`` ``_reject_add_in_shutdown``): a request that passed admission just
  before the SIGTERM ends ``finish_reason: abort`` with no token, under HTTP 200;
- ``/health`` (``vllm/entrypoints/serve/instrumentator/health.py``) asks only whether the engine
  is dead: 200 for the whole drain.

vLLM keeps no state a middleware could read that says a drain began (the shutdown event is local
to ``serve_http``), so the gate watches the signal itself. At the lifespan's startup, once
``serve_http`` has registered its SIGTERM handler (``loop.add_signal_handler``: on uvloop a
Python-level handler, ``Loop.__sighandler``, plus the wakeup fd), it installs one that shuts the
gate, then calls the one it replaced: vLLM's drain runs exactly as before. Shut, the gate

- answers every new request (``/health`` too) with 503, ``Retry-After`` and ``Connection:
  close``, after reading its body (closing on an unread body resets the connection); once the
  drain is over vLLM closes its socket and connections are refused;
- holds back every generation's answer (``GENERATIONS``) until it shows a generated token (a
  client waits for the first token either way), and any other answer that starts after the
  SIGTERM likewise: one still without a token when the gate shuts, or that starts
  after, goes out as that same 503 if it fails (500, or an exception vLLM would answer with
  one: vLLM 0.19 does so outside every middleware) or ends with no token (the engine core's
  abort above: its 200 had not left yet, so the client is told to retry instead).

The listening socket stays open until vLLM closes it: closed at the SIGTERM, every connection
still in its accept queue would be reset (a client reads ``connection reset``, not a refusal;
seen under systemd on a busy host). ``Retry-After`` asks clients not to come back before the
drain's end, when the same reset awaits a connection that is queued as uvicorn closes the
socket. ``/metrics`` stays open: scrapes and per-request counter reads go on while the requests
in flight finish.

``appliance image build`` copies this file into every image as ``/opt/gemma4-appliance/
stop_gate.py``, beside the entry point's ``vllm_main.py`` (the script's folder is the API
server's ``sys.path[0]``), and labels the image ``io.gemma4-appliance.stop-gate=true``; the serve
program passes ``--middleware stop_gate.StopGate`` to such an image only. Standard library only:
it runs in the image's Python, beside vLLM, not the appliance's.
"""

from __future__ import annotations

import json
import signal
import sys

# What a turned-away client is told to wait: a hint (behind a load balancer the retry goes to
# another instance; a restarted one refuses connections until it listens again).
RETRY_AFTER_S = 5
OPEN_PATHS = frozenset({"/metrics"})
# The answers the engine core can abort with no token after their 200 (``_reject_add_in_shutdown``).
GENERATIONS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
MESSAGE = "vLLM is stopping: the requests in flight finish, new ones are refused; retry"
# Where a token shows in vLLM's OpenAI answers: a chat delta or message, a completion's text.
_TOKEN_FIELDS = ("content", "reasoning", "reasoning_content", "tool_calls", "text")


def _refusal() -> tuple[dict, dict]:
    body = json.dumps(
        {"error": {"message": MESSAGE, "type": "ServiceUnavailable", "param": None, "code": 503}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),  # a client's pool reconnects, and is refused after the drain
    ]
    start = {"type": "http.response.start", "status": 503, "headers": headers}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class StopGate:
    """A pure ASGI middleware (vLLM's ``--middleware`` adds a class with ``app.add_middleware``,
    the outermost layer: it sees every request before vLLM's own admission and API key check)."""

    def __init__(self, app) -> None:
        self.app = app
        self.shut = False  # True from the SIGTERM on
        self._watching = False

    def watch(self) -> bool:
        """Chain a SIGTERM handler that shuts the gate before the current one runs; False (and a
        line on stderr) when there is no handler to chain: then the gate never shuts."""
        self._watching = True
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):
            # SIG_DFL or SIG_IGN: the signal would not reach a drain anyway.
            _say(f"no SIGTERM handler to follow ({previous!r}): arrivals are not refused")
            return False

        def on_sigterm(signum, frame) -> None:
            self.shut = True
            previous(signum, frame)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread: only it may set handlers
            _say("not on the main thread: arrivals during a stop are not refused")
            return False
        return True

    async def __call__(self, scope, receive, send) -> None:
        if not self._watching:
            self.watch()  # the first call is the lifespan's startup, after vLLM's handler
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.shut:
            await _read_body(receive)
            for message in _refusal():
                await send(message)
            return
        generation = scope.get("method") == "POST" and scope.get("path") in GENERATIONS
        answer = _Answer(self, send, generation)
        try:
            await self.app(scope, receive, answer.send)
        except Exception:
            # vLLM 0.19 answers any exception with a handler that Starlette runs outside every
            # middleware (``app.exception_handler(Exception)``): its drain's "cannot schedule
            # new futures after shutdown" would pass this gate as that 500. Refused here while
            # nothing of the answer has left; anything else goes on as it came.
            if not (self.shut and answer.mode in ("start", "hold")):
                raise
            await answer.refuse()


class _Answer:
    """One admitted request's answer on its way out. A generation's, or any answer starting
    after the gate shut, is held until it shows a token (then sent whole and passed). One that
    ends without a token passes as it is while the gate is open; once it is shut, such an
    answer, or a 500, goes out as the refusal instead."""

    def __init__(self, gate: StopGate, send, generation: bool) -> None:
        self.gate, self._send, self.generation = gate, send, generation
        self.mode = "start"  # start -> pass | hold -> pass | refused
        self.held: list[dict] = []

    async def send(self, message: dict) -> None:
        if self.mode == "pass":
            await self._send(message)
        elif self.mode == "start":
            await self._start(message)
        elif self.mode == "hold":
            self.held.append(message)
            ended = not message.get("more_body", False)
            body = b"".join(m.get("body", b"") for m in self.held[1:])
            if _shows_token(body, ended) or (ended and not self.gate.shut):
                await self._release()
            elif ended:
                await self.refuse()

    async def _start(self, message: dict) -> None:
        if message["type"] != "http.response.start" or not (self.generation or self.gate.shut):
            self.mode = "pass"
            await self._send(message)
        elif message["status"] == 500 and self.gate.shut:
            await self.refuse()
        elif message["status"] != 200:
            self.mode = "pass"
            await self._send(message)
        else:
            self.mode = "hold"
            self.held.append(message)

    async def _release(self) -> None:
        self.mode = "pass"
        for message in self.held:
            await self._send(message)
        self.held.clear()

    async def refuse(self) -> None:
        self.mode = "refused"  # whatever the app still sends is dropped
        self.held.clear()
        for message in _refusal():
            await self._send(message)


async def _read_body(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _shows_token(body: bytes, ended: bool) -> bool:
    """Whether ``body`` (a JSON answer, or server-sent events as far as they came) carries a
    generated token, or is not a generation's answer at all (then it is not the gate's to
    judge). Only a whole JSON answer or a whole event counts."""
    if body.lstrip().startswith(b"{"):
        return ended and _has_token(body)
    events = body.split(b"\n\n")
    if not ended:
        events = events[:-1]  # the last one may still be coming
    for event in events:
        for line in event.splitlines():
            data = line.removeprefix(b"data:").strip()
            if line.startswith(b"data:") and data != b"[DONE]" and _has_token(data):
                return True
    return False


def _has_token(data: bytes) -> bool:
    try:
        doc = json.loads(data)
    except ValueError:
        return True  # not vLLM's JSON: not the gate's to judge
    if not isinstance(doc, dict):
        return True
    if "error" in doc:
        return False
    if "choices" not in doc and "usage" not in doc:
        return True  # not a generation's answer (e.g. /tokenize)
    if ((doc.get("usage") or {}).get("completion_tokens") or 0) > 0:
        return True
    for choice in doc.get("choices") or ():
        if choice.get("finish_reason") not in (None, "abort"):
            return True
        said = choice.get("delta") or choice.get("message") or choice
        if any(said.get(field) for field in _TOKEN_FIELDS):
            return True
    return False


def _say(line: str) -> None:
    print(f"stop_gate: {line}", file=sys.stderr, flush=True)
