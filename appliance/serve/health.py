"""Is the engine up? ``/health`` (every instance) and one generation (a multi-node head).

Why a generation for a multi-node head: after a worker's death vLLM's head keeps answering
``/health`` 200 until a request fails (500, EngineDeadError); only then does its engine exit.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Callable

from ..host.lock import pid_alive

# Each poll is one loopback connect (refused until vLLM listens): half a second makes a start
# `active` within 0.5 s of vLLM answering, where 2 s cost every start 1 s on average.
POLL_S = 0.5
NOTE_EVERY_S = 60
REQUEST_TIMEOUT_S = 10
GENERATE_TIMEOUT_S = 120


class EngineExited(Exception):
    """The unit's main process (the engine's container) exited while it was waited for."""


def status(
    host: str, port: int, method: str = "GET", path: str = "/health", *,
    body: dict | None = None, key: str | None = None, timeout: float = REQUEST_TIMEOUT_S,
) -> int | None:  # fmt: skip
    """The HTTP status of one request, None when nothing answers."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key and path.startswith("/v1/"):
        headers["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def generate(host: str, port: int, model: str, key: str | None) -> int | None:
    """The status of one two-token completion."""
    body = {"model": model, "prompt": "ok", "max_tokens": 2, "temperature": 0}
    return status(host, port, "POST", "/v1/completions", body=body, key=key,
                  timeout=GENERATE_TIMEOUT_S)  # fmt: skip


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


def wait_listening(host: str, port: int, note: Callable[[str], None]) -> float:
    """Wait, without end, until something accepts a TCP connection on ``host``:``port``; the
    seconds it took. A worker waits so for its head's rendezvous: started while the head's host
    is down, its engine would wait out torch's timeout, exit, and after three starts the unit
    would stay `failed` (its start limit) when the head came back; waiting here, it is started
    once, and joins when the head is back."""
    start = time.monotonic()
    noted = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=REQUEST_TIMEOUT_S):
                return time.monotonic() - start
        except OSError as exc:
            now = time.monotonic()
            if noted is None or now - noted >= NOTE_EVERY_S:
                note(
                    f"{WAITING_FOR_HEAD} at {host}:{port} ({exc.strerror or exc}):"
                    " its host is down or its unit not started; the worker joins when it is back"
                )
                noted = now
        time.sleep(POLL_S)


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
