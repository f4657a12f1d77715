"""The port: free on the address vLLM binds (vLLM's own bind, tried and released)."""

from __future__ import annotations

import errno
import socket

from .findings import Finding


def port_finding(host: str, port: int, *, own: bool = False) -> Finding:
    """``own``: the installed instance's own port, busy while the instance runs (a warning)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As uvicorn does: a port left in TIME_WAIT by the last run is free to vLLM too.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and own:
                return Finding(
                    "port", "warn", f"{host}:{port} is in use (by the instance, when it runs)"
                )
            if exc.errno == errno.EADDRINUSE:
                return Finding(
                    "port",
                    "blocker",
                    f"{host}:{port} is in use",
                    f"stop what listens there (ss -ltnp 'sport = :{port}') or install with --port",
                )
            return Finding(
                "port",
                "blocker",
                f"cannot bind {host}:{port}: {exc.strerror}",
                "install with --host/--port",
            )
    return Finding("port", "ok", f"{host}:{port} is free")
