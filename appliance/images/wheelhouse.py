"""The wheels a CPU image installs: downloaded on the host, served to the build on 127.0.0.1.

A build container has neither this host's package-index trust (a local CA bundle, local wheel
folders in ``pip config``) nor its network setup, so the host downloads every wheel of a lock
into ``<cache>/wheels/<lock digest>/`` (once per machine and lock) and, during the build, serves
that folder over HTTP on 127.0.0.1. The build runs with ``--network host`` so its ``RUN pip
install --no-index --find-links $WHEELS_URL`` reaches it. Nothing of the wheelhouse lands in a
layer: no multi-stage copy, no build context of gigabytes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import ApplianceError
from .files import digest, held
from .lock import read_lock

# The build's installer, served beside the lock's wheels and installed in a throwaway venv of the
# build step: uv unpacks and byte-compiles the wheels in parallel, where pip does one file at a
# time (the pre-MTP lock's 9 GB of CUDA torch kept one core busy for minutes).
INSTALLER = "uv==0.13.9"


def _pins(lock: Path) -> list[str]:
    return [*read_lock(lock), INSTALLER]


def wheelhouse_dir(lock: Path, cache_dir: Path) -> Path:
    return cache_dir / "wheels" / digest("\n".join(_pins(lock)))


# pip downloads one wheel at a time; the CUDA-built torch of vLLM 0.19's lock alone is a dozen
# wheels of 0.2-1 GB (4 GB in all). Four pips side by side, each on its share of the lock.
DOWNLOADERS = 4


def ensure_wheelhouse(lock: Path, cache_dir: Path) -> Path:
    """Every wheel of ``lock``, and the :data:`INSTALLER`, in the machine's cache (downloaded
    with the host's pip if not)."""
    target = wheelhouse_dir(lock, cache_dir)
    if (target / ".complete").exists():
        return target
    with held(target.with_name(f".{target.name}.lock")):
        if not (target / ".complete").exists():  # made by the download we waited for
            _download_all(lock, target)
    return target


def _download_all(lock: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        pins = _pins(lock)
        shares = [pins[i::DOWNLOADERS] for i in range(DOWNLOADERS)]
        with concurrent.futures.ThreadPoolExecutor(DOWNLOADERS) as pool:
            procs = list(pool.map(lambda share: _download(share, staging), shares))
        failed = [p for p in procs if p.returncode != 0]
        if failed:
            tail = "\n".join(failed[0].stderr.strip().splitlines()[-10:])
            raise ApplianceError(f"downloading the wheels of {lock.name} failed:\n{tail}")
        (staging / ".complete").write_text("\n".join(pins) + "\n")
        if target.exists():  # a download killed half-way
            shutil.rmtree(target)
        staging.replace(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _download(pins: list[str], dest: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        *pins,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def preferred_port(directory: Path) -> int:
    """A port derived from the wheelhouse's name. The URL is a build argument that the venv's
    RUN step uses, so a stable URL lets Docker's layer cache reuse the venv layer when only a
    later step (entry point, wrapper, labels) changed."""
    return 20000 + int(digest(directory.name)[:8], 16) % 20000


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve ``directory`` on 127.0.0.1 for the duration; yields its URL. The port is
    :func:`preferred_port` when free, else any free port (the venv layer is then rebuilt)."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", preferred_port(directory)), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
