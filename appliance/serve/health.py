"""Is the engine up? ``/health`` (every instance) and one generation (a multi-node head).

Why a generation for a multi-node head: after a worker's death vLLM's head keeps answering
``/health`` 200 until a request fails (500, EngineDeadError); only then does its engine exit.
A generation turned away at the head's queue bound (503: it is serving its clients) says
nothing of the workers: it is sent again (:mod:`appliance.engine_api.shed`) until
:data:`SHED_WITHIN_S`.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Callable

from ..engine_api import shed
from ..errors import OverloadedError
from ..host.lock import pid_alive

# Each poll is one loopback connect (refused until vLLM listens): half a second makes a start
# `active` within 0.5 s of vLLM answering, where 2 s cost every start 1 s on average.
POLL_S = 0.5
NOTE_EVERY_S = 60
REQUEST_TIMEOUT_S = 10
GENERATE_TIMEOUT_S = 120
# How long a generation turned away at the queue bound is sent again: each request that ends
# frees a place, so a head at its bound lets one in within seconds; minutes of 503s is no start.
SHED_WITHIN_S = 300


class EngineExited(Exception):
    """The unit's main process (the engine's container) exited while it was waited for."""


def status(
    host: str, port: int, method: str = "GET", path: str = "/health", *,
    body: dict | None = None, key: str | None = None, timeout: float = REQUEST_TIMEOUT_S,
) -> int | None:  # fmt: skip
    """The HTTP status of one request, None when nothing answers."""
    got = _request(host, port, method, path, body, key, timeout)
    return got[0] if got else None


def _request(
    host: str, port: int, method: str, path: str, body: dict | None, key: str | None,
    timeout: float,
) -> tuple[int, http.client.HTTPMessage, bytes] | None:  # fmt: skip
    """One request's status, headers and the start of its body; None when nothing answers."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key and path.startswith("/v1/"):
        headers["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read(4096)
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def generate(
    host: str, port: int, model: str, key: str | None, *,
    within: float = SHED_WITHIN_S, tally: shed.Tally | None = None,
) -> int | None:  # fmt: skip
    """The status of one two-token completion (None when nothing answers). One the engine turns
    away at its queue bound (503) is sent again until ``within`` seconds have passed, counted in
    ``tally``; then :class:`appliance.engine_api.shed.TurnedAway`."""
    body = {"model": model, "prompt": "ok", "max_tokens": 2, "temperature": 0}
    path = "/v1/completions"

    def once() -> int | None:
        got = _request(host, port, "POST", path, body, key, GENERATE_TIMEOUT_S)
        if got is not None and got[0] == 503:
            detail = got[2].decode(errors="replace").strip()[:300] or "503"
            after = shed.retry_after(got[1].get("Retry-After"))
            raise OverloadedError(f"http://{host}:{port}{path}", detail, retry_after=after)
        return got[0] if got else None

    return shed.retry(once, time.monotonic() + within, tally)


WAITING_FOR_HEAD = "waiting for the head's rendezvous"
_CHECKED = " checked; "


def waiting_for_head(image: str, host: str, port: int) -> str:
    """The worker unit's status line while it waits for its head, ``image`` checked: read back
    by the cutover's worker gate (:func:`image_waiting_for_head`)."""
    return f"{image}{_CHECKED}{WAITING_FOR_HEAD} at {host}:{port}"


def image_waiting_for_head(status: str) -> str | None:
    """The image a worker's status line (:func:`waiting_for_head`) says it checked while it
    waits for its head; None for any other status."""
    image, sep, rest = status.partition(_CHECKED)
    return image if sep and rest.startswith(WAITING_FOR_HEAD) else None


def notify_status(text: str) -> None:
    """Say ``text`` on the unit's status line (sd_notify ``STATUS=``); nothing outside a unit
    that listens (no ``NOTIFY_SOCKET``). Best effort: the status line informs, it never stops
    a start."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(f"STATUS={text}".encode(), path)
    except OSError:
        pass


def refused(host: str, port: int) -> OSError | None:
    """Why nothing accepts a TCP connection on ``host``:``port`` now; None when something does."""
    try:
        with socket.create_connection((host, port), timeout=REQUEST_TIMEOUT_S):
            return None
    except OSError as exc:
        return exc


def wait_listening(host: str, port: int, note: Callable[[str], None]) -> float:
    """Wait, without end, until something accepts a TCP connection on ``host``:``port``; the
    seconds it took. A worker waits so for its head's rendezvous: started while the head's host
    is down, its engine would wait out torch's timeout, exit, and after three starts the unit
    would stay `failed` (its start limit) when the head came back; waiting here, it is started
    once, and joins when the head is back."""
    start = time.monotonic()
    noted = None
    while (exc := refused(host, port)) is not None:
        now = time.monotonic()
        if noted is None or now - noted >= NOTE_EVERY_S:
            note(
                f"{WAITING_FOR_HEAD} at {host}:{port} ({exc.strerror or exc}):"
                " its host is down or its unit not started; the worker joins when it is back"
            )
            noted = now
        time.sleep(POLL_S)
    return time.monotonic() - start


def main_pid_alive() -> bool:
    """False once the unit's main process has exited (systemd gives ExecStartPost ``MAINPID``):
    without this an engine that died at start held the unit "activating" to its timeout."""
    pid = os.environ.get("MAINPID", "")
    return not pid.isdigit() or pid_alive(int(pid))


def wait_healthy(
    host: str, port: int, note: Callable[[str], None], waiting_hint: str = ""
) -> float:
    """Return the seconds it took ``/health`` to answer 200; EngineExited if the engine died."""
    start = time.monotonic()
    next_note = NOTE_EVERY_S
    while status(host, port) != 200:
        if not main_pid_alive():
            raise EngineExited(os.environ.get("MAINPID", "?"))
        waited = time.monotonic() - start
        if waited >= next_note:
            note(f"waiting for vLLM /health on {host}:{port} ({waited:.0f} s){waiting_hint}")
            next_note += NOTE_EVERY_S
        time.sleep(POLL_S)
    return time.monotonic() - start
