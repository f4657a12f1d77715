"""The suite's cold work, started by scripts/test.sh in the background before pytest.

On a brand-new machine the first tests of each stream would otherwise wait, one after the other,
for the CPU images (a rootfs bootstrap, a 4 GB wheel download, the builds), the nspawn rootfs
(another bootstrap), the tiny model pairs and the npm schema. Here they run side by side, in two
stages:

- ``system``: what needs only the standard library, started before the project's venv exists
  (the two rootfs bootstraps and the wheelhouses download while scripts/setup.sh installs);
- ``venv``: what needs the venv, started right after it (dockerd, the image builds, the tiny
  models, the npm schema), while the lint and the first tests run.

Each step is the same function the tests' fixtures call, idempotent and locked per machine: a
fixture that needs a thing before this script made it waits on the lock, then finds it done (or
makes it itself, and reports a failure as a test error). So this script only moves work earlier;
its own failures are printed and never fail the run.

Usage: ``python3 tests/prefetch.py system|venv`` (one line per step with its wall time).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path[:0] = [str(TESTS), str(REPO)]


def base_rootfs() -> str:
    from appliance.images import base, build

    return base.make_rootfs_tar(build.docker_folder(), build.system_cache()).name


def nspawn_rootfs() -> str:
    from plugins import nspawn

    return str(nspawn.ensure_rootfs())


def wheelhouses() -> str:
    from appliance.images import build, wheelhouse

    locks = sorted((build.docker_folder() / "cpu").glob("vllm-*.lock"))
    with concurrent.futures.ThreadPoolExecutor(len(locks)) as pool:
        done = pool.map(lambda p: wheelhouse.ensure_wheelhouse(p, build.system_cache()), locks)
        return ", ".join(f"{p.name} -> {d.name}" for p, d in zip(locks, done, strict=True))


def images() -> str:
    """dockerd, then every image, in the order the streams first need them."""
    from plugins import docker_engine

    import docker

    docker_engine.ensure_dockerd()
    client = docker.DockerClient(base_url=f"unix://{docker_engine.SOCKET}", timeout=600)
    try:
        mtp = docker_engine.build_image(client, "cpu-mtp")
        docker_engine.build_image(client, "cpu-broken")
        docker_engine.build_derived(client, mtp.image_id)
        for recipe in (docker_engine.crash_recipe, docker_engine.degraded_recipe):
            docker_engine.build_derived(client, mtp.image_id, recipe(mtp.image_id))
        docker_engine.build_image(client, "cpu-pre-mtp")
    finally:
        client.close()
    return "cpu-mtp, cpu-broken, derived, cpu-pre-mtp"


def models() -> str:
    from appliance.engine import devmodel

    return ", ".join(devmodel.cached(d).root.name for d in ("copy", "partial", "random"))


def schema() -> str:
    from plugins import observability

    return str(observability.ensure_grafana_schema())


STAGES: dict[str, dict[str, Callable[[], str]]] = {
    "system": {"base rootfs": base_rootfs, "nspawn rootfs": nspawn_rootfs, "wheels": wheelhouses},
    "venv": {"images": images, "models": models, "grafana schema": schema},
}


def _timed(name: str, step: Callable[[], str]) -> str:
    start = time.monotonic()
    try:
        what = step()
    except Exception:  # noqa: BLE001 - the fixture that needs it redoes it and reports
        took = time.monotonic() - start
        return f"prefetch {name}: FAILED after {took:.0f} s (its tests redo it)\n" + (
            traceback.format_exc(limit=3)
        )
    return f"prefetch {name}: {time.monotonic() - start:.0f} s ({what})"


def main(stage: str) -> int:
    steps = STAGES[stage]
    # Imported here, before the threads: dataclasses reads the typing module from sys.modules
    # without the import lock, and a step that defined a dataclass while another thread was
    # still importing typing failed ("partially initialized module 'typing' has no attribute
    # 'ClassVar'": the models step of a brand-new run, 2026-12-06).
    import typing  # noqa: F401

    with concurrent.futures.ThreadPoolExecutor(len(steps)) as pool:
        futures = [pool.submit(_timed, name, step) for name, step in steps.items()]
        for fut in concurrent.futures.as_completed(futures):
            print(fut.result(), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in STAGES:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(STAGES)}")
    sys.exit(main(sys.argv[1]))
