"""The real Docker engine for the ``docker`` and ``systemd`` tiers, started by the tests.

``docker_engine`` (session) makes sure a ``dockerd`` answers on the default socket
(``/var/run/docker.sock``) and yields a Docker SDK client for it. If nothing answers, it starts
``dockerd`` with docker's default data root (``/var/lib/docker``), so images built by one run are
reused by the next on the same machine, and a log under ``/var/cache/gemma4-appliance/docker``.

Choice, documented: a dockerd the fixture started is LEFT RUNNING at the end of the session. It
is a per-machine daemon like the one an operator's host runs; other test sessions running at the
same time (and the nspawn machines, which bind its socket) use it too, and the next run then
starts in under a second. ``APPLIANCE_STOP_DOCKERD=1`` stops it at session end instead (only the
one this fixture started, by its pid).

Run as a script (``python tests/plugins/docker_engine.py``) it just makes sure dockerd runs.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

SOCKET = Path("/var/run/docker.sock")
CACHE = Path(os.environ.get("APPLIANCE_SYSTEM_CACHE", "/var/cache/gemma4-appliance")) / "docker"


def _answers(timeout: float = 2.0) -> bool:
    import docker.errors

    import docker

    if not SOCKET.exists():
        return False
    try:
        client = docker.DockerClient(base_url=f"unix://{SOCKET}", timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (docker.errors.DockerException, OSError):
        return False


def ensure_dockerd(timeout: float = 60.0) -> subprocess.Popen | None:
    """Start dockerd unless one answers; return the process this call started, else None."""
    if _answers():
        return None
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    if not os.path.exists(dockerd):
        raise RuntimeError("dockerd is not installed: run scripts/setup-system.sh (apt docker.io)")
    if os.geteuid() != 0:
        raise RuntimeError("starting dockerd needs root")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(
            [dockerd, "--host", f"unix://{SOCKET}", "--pidfile", "/var/run/docker.pid"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own session: a Ctrl-C aimed at pytest must not take the machine's daemon down.
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (CACHE / "dockerd.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"dockerd exited with {proc.returncode}:\n{tail}")
        if _answers(timeout=1.0):
            return proc
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    raise RuntimeError(f"dockerd did not answer within {timeout:.0f}s (log: {CACHE}/dockerd.log)")


try:
    import pytest
except ImportError:  # pragma: no cover - script use without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def docker_engine() -> Iterator[object]:
        """A Docker SDK client for the real engine (started if needed, see module docstring)."""
        import docker

        started = ensure_dockerd()
        client = docker.DockerClient(base_url=f"unix://{SOCKET}", timeout=600)
        try:
            yield client
        finally:
            client.close()
            if started is not None and os.environ.get("APPLIANCE_STOP_DOCKERD") == "1":
                started.send_signal(signal.SIGTERM)
                started.wait(timeout=60)

    @pytest.fixture(scope="session")
    def appliance_images(docker_engine) -> dict[str, object]:
        """The CPU images, built (or found already built) through ``appliance.images.build``:
        ``{"cpu-mtp": BuildResult, "cpu-pre-mtp": ..., "cpu-broken": ...}``, tagged per the
        scheme (``gemma4-vllm:0.32.0-mtp``/``mtp``/``latest``, ``gemma4-vllm:0.19.0``/``pre-mtp``,
        ``gemma4-vllm:0.32.0-mtp-broken``). Cold: a few minutes each; warm: a label lookup."""
        from appliance.images import build

        return {
            name: build.build(docker_engine, name)
            for name in ("cpu-mtp", "cpu-pre-mtp", "cpu-broken")
        }


if __name__ == "__main__":
    p = ensure_dockerd()
    print("dockerd started, pid", p.pid if p else None, "" if p else "(already running)")


def tiny_rootfs(note: str) -> bytes:
    """A one-file rootfs tarball for small labelled test images (``docker import``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = f"{note}\n".encode()
        info = tarfile.TarInfo("README")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
