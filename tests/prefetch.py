"""The suite's cold work, started by scripts/test.sh in the background before pytest.

On a brand-new machine the first tests of each stream would otherwise wait, one after the other,
for the Docker engine, the CPU images (a 4 GB wheelhouse download for the pre-MTP one), the
nspawn rootfs (a debootstrap), the tiny model pairs and the npm schema. Here they run side by
side while the lint and the first tests go on: downloads and disk writes, little CPU.

Each step is the same function the tests' fixtures call, idempotent and locked per machine: a
fixture that needs a thing before this script made it waits on the lock, then finds it done (or
makes it itself, and reports a failure as a test error). So this script only moves work earlier;
its own failures are printed and never fail the run.

Usage: ``python tests/prefetch.py`` (prints one line per step with its wall time).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plugins import docker_engine, nspawn, observability

from appliance import devmodel


def images() -> str:
    """dockerd, then every image, in the order the streams first need them."""
    import docker

    docker_engine.ensure_dockerd()
    client = docker.DockerClient(base_url=f"unix://{docker_engine.SOCKET}", timeout=600)
    try:
        mtp = docker_engine.build_image(client, "cpu-mtp")
        docker_engine.build_image(client, "cpu-broken")
        docker_engine.build_derived(client, mtp.image_id)
        docker_engine.build_derived(client, mtp.image_id, docker_engine.crash_recipe(mtp.image_id))
        docker_engine.build_image(client, "cpu-pre-mtp")
    finally:
        client.close()
    return "cpu-mtp, cpu-broken, derived, cpu-pre-mtp"


def rootfs() -> str:
    return str(nspawn.ensure_rootfs())


def models() -> str:
    return ", ".join(devmodel.cached(d).root.name for d in ("copy", "random"))


def schema() -> str:
    return str(observability.ensure_grafana_schema())


STEPS: dict[str, Callable[[], str]] = {
    "images": images,
    "rootfs": rootfs,
    "models": models,
    "grafana schema": schema,
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


def main() -> int:
    with concurrent.futures.ThreadPoolExecutor(len(STEPS)) as pool:
        futures = [pool.submit(_timed, name, step) for name, step in STEPS.items()]
        for fut in concurrent.futures.as_completed(futures):
            print(fut.result(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
