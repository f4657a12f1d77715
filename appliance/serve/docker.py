"""The docker client calls of the serve program: image labels, stop, remove.

The unit talks to dockerd through the ``docker`` client on the host's PATH (the engine's
container is the client's child, so its exit status is the unit's). Errors come back as the
client's own words on one line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from ..errors import ApplianceError, UsageError

STOP_GRACE_S = 60  # docker stop's SIGTERM-to-SIGKILL grace (the unit allows 90 s)
# vLLM's --shutdown-timeout: how long in-flight requests may finish after the SIGTERM. The rest
# of the grace is for vLLM's own teardown (its engine processes) before docker's SIGKILL.
DRAIN_S = STOP_GRACE_S - 10
STOP_TRIES = 3  # docker stop clients killed by a stop's SIGTERM sweep before one is let run
# How a docker client ends at a SIGTERM: killed by it while its Go runtime starts (-15), or
# exiting 128 + 15 once its own handler is set, which cancels the request to the daemon.
SIGTERMED = (-signal.SIGTERM, 128 + signal.SIGTERM)
REMOVE_WAIT_S = 30  # how long `remove` waits for Docker to finish an auto-removal


class DockerError(ApplianceError):
    """A docker call failed (the daemon does not answer, or refused)."""


def _docker(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise UsageError("no docker client on this host's PATH", fix="install docker") from None


def _words(proc: subprocess.CompletedProcess) -> str:
    return " ".join(proc.stderr.split()) or f"exit {proc.returncode}"


def _gone(proc: subprocess.CompletedProcess) -> bool:
    return "No such container" in proc.stderr


def image_labels(image: str) -> dict[str, str] | None:
    """The labels of ``image`` on this host; None when the image is not there."""
    proc = _docker("image", "inspect", "--format", "{{json .Config.Labels}}", image)
    if proc.returncode != 0:
        if "No such image" in proc.stderr or "no such image" in proc.stderr.lower():
            return None
        raise DockerError(f"docker image inspect {image} failed: {_words(proc)}")
    try:
        found = json.loads(proc.stdout or "null")
    except ValueError:
        raise DockerError(f"docker image inspect {image} printed no labels") from None
    return {str(k): str(v) for k, v in (found or {}).items()}


def cdi_spec_dirs() -> tuple[str, ...]:
    """The CDI spec folders Docker reads, as ``docker info`` lists them (``CDISpecDirs``): none
    where CDI is off in the daemon, or where Docker is older than the field (before 25)."""
    proc = _docker("info", "--format", "{{json .CDISpecDirs}}", timeout=30)
    if proc.returncode != 0:
        return ()
    try:
        found = json.loads(proc.stdout or "null")
    except ValueError:
        return ()
    return tuple(d for d in found or () if isinstance(d, str) and d.startswith("/"))


def stop(container: str) -> str:
    """Stop ``container``, giving vLLM ``STOP_GRACE_S`` to drain; what happened, as a line. A
    container already gone is fine (the engine exited and ``--rm`` removed it)."""
    start = time.monotonic()
    for _ in range(STOP_TRIES):
        proc = _docker("stop", "-t", str(STOP_GRACE_S), container)
        # A stop while the unit is activating: systemd signals the wait, then every process of
        # the unit's cgroup, reading it again until no new one shows, and the client started
        # here in answer can be one of them, the container left running. The sweep signals
        # each process once and docker stop is idempotent: ask again.
        if proc.returncode not in SIGTERMED:
            break
    took = time.monotonic() - start
    if proc.returncode == 0:
        if took >= STOP_GRACE_S:
            return (
                f"vLLM did not drain within {STOP_GRACE_S} s: docker killed container {container}"
            )
        return f"container {container} stopped after {took:.0f} s"
    if _gone(proc):
        return f"container {container} already gone"
    raise DockerError(f"docker stop {container} failed: {_words(proc)}")


def remove(container: str) -> None:
    """Remove a container left behind by a crash or a killed daemon. One Docker is still
    auto-removing (``--rm``: "removal ... already in progress") is waited for; a daemon that
    does not answer, or a removal that fails, raises."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    while _docker("container", "inspect", "--format", "{{.Id}}", container).returncode == 0:
        proc = _docker("rm", "--force", container)
        if proc.returncode == 0 or _gone(proc):
            return
        if "already in progress" not in proc.stderr:
            raise DockerError(f"docker rm {container} failed: {_words(proc)}")
        if time.monotonic() >= deadline:
            raise DockerError(
                f"container {container} is still being removed after {REMOVE_WAIT_S} s: "
                f"{_words(proc)}"
            )
        time.sleep(1)
    # Only "no such container" is fine: a daemon that does not answer fails the start.
    proc = _docker("version", "--format", "{{.Server.Version}}")
    if proc.returncode != 0:
        raise DockerError(f"the Docker daemon does not answer: {_words(proc)}")
