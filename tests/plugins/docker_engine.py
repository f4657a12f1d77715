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

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from appliance.images.files import held

SOCKET = Path("/var/run/docker.sock")
CACHE = Path(os.environ.get("APPLIANCE_SYSTEM_CACHE", "/var/cache/gemma4-appliance")) / "docker"


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """An exclusive lock per machine (``flock`` on a file in the cache): scripts/test.sh runs two
    pytest processes at once, and only one may start dockerd or build (or import) an image at a
    time; the other then finds it done."""
    with held(CACHE / f"{name}.lock"):
        yield


def inspect_container(name: str, fmt: str) -> str:
    """``docker inspect --format FMT NAME`` on the host's engine; raises when it fails (no such
    container included): a read that failed never passes for a value."""
    proc = subprocess.run(
        ["docker", "inspect", "--format", fmt, name], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"docker inspect {name} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout.strip()


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
    """Start dockerd unless one answers; return the process this call started, else None.

    It is also named the Docker of the trees the tests give ``--root`` (``DOCKER_HOST``): a
    command on a tree asks no Docker unless one is named (appliance/host/reach.py), and the
    tests' trees run their containers on this engine."""
    os.environ.setdefault("DOCKER_HOST", f"unix://{SOCKET}")
    if _answers():
        return None
    with machine_lock("dockerd"):
        return _start_dockerd(timeout)


def _start_dockerd(timeout: float) -> subprocess.Popen | None:
    if _answers():  # the other pytest started it while this one waited
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
    def appliance_images(docker_engine) -> Images:
        """The CPU images, each built (or found already built) through
        ``appliance.images.build`` when a test first asks for it: ``images["cpu-mtp"]`` is a
        BuildResult, tagged per the scheme (``gemma4-vllm:0.32.0-mtp-cpu``/``mtp-cpu``/
        ``latest-cpu``; ``cpu-pre-mtp``: ``gemma4-vllm:0.19.0-cpu``/``pre-mtp-cpu``;
        ``cpu-broken``: ``gemma4-vllm:0.32.0-mtp-broken-cpu``). Cold: a few minutes each; warm:
        a label lookup and the tags (a machine with the old scheme's tags gets the new ones)."""
        return Images(docker_engine)


IMAGE_TARGETS = ("cpu-mtp", "cpu-broken", "cpu-pre-mtp")


class Images(Mapping):
    """The suite's CPU images by target, each built on first use under the machine's lock of
    that image: the other pytest process, or tests/prefetch.py, then finds it built (a label
    lookup). Lazy, so that tests of the MTP image need not wait for the 9 GB pre-MTP one."""

    def __init__(self, client) -> None:
        self.client = client
        self.built: dict[str, object] = {}

    def __getitem__(self, target: str):
        if target not in IMAGE_TARGETS:
            raise KeyError(target)
        if target not in self.built:
            self.built[target] = build_image(self.client, target)
        return self.built[target]

    def __iter__(self) -> Iterator[str]:
        return iter(IMAGE_TARGETS)

    def __len__(self) -> int:
        return len(IMAGE_TARGETS)


def build_image(client, target: str):
    """Build one of the suite's CPU images (or find it built), under the machine's lock of that
    image: a test that needs the MTP image finds it while the 9 GB pre-MTP one still builds
    (one lock for all kept the first multinode test waiting 6 minutes on a brand-new host)."""
    from appliance.images import build

    with machine_lock(f"image-{target}"):
        return build.build(client, target)


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


# ---- small images derived from the real MTP image (the cutover's output canary) ----------

CANARY_TEST_REPO = "gemma4-canary-test"
CANARY_DIGEST_LABEL = "io.gemma4-appliance.test-digest"
BUILD_DIGEST_LABEL = "io.gemma4-appliance.build-digest"  # appliance.images.scheme.BUILD_DIGEST
NO_MTP_TAG = "0.32.0-mtp-label-off"
CHANGED_TEMPLATE_TAG = "0.32.0-mtp-changed-template"
CHANGED_TEMPLATE_PATH = "/opt/gemma4-appliance/changed-chat-template.jinja"


def _changed_chat_template() -> str:
    """The tiny model's chat template with the generation prompt ending in ``>>`` instead of a
    newline: the target greedily repeats its last input token, so every answer changes."""
    from appliance.engine import devmodel

    old = "<start_of_turn>model\n{% endif %}"
    assert old in devmodel.CHAT_TEMPLATE, "devmodel's chat template changed: update this image"
    return devmodel.CHAT_TEMPLATE.replace(old, "<start_of_turn>model\n>>{% endif %}")


def _derived_recipes(parent_id: str) -> dict[str, dict[str, bytes]]:
    """tag -> build context files of each image derived from the MTP image ``parent_id``."""
    head = f"FROM {parent_id}\n"
    return {
        # The same image and engine with MTP switched off by its label: the serve script passes
        # no speculative config (MTP on/off within one vLLM version).
        NO_MTP_TAG: {
            "Dockerfile": (
                head + 'LABEL io.gemma4-appliance.mtp="false" '
                'org.opencontainers.image.description="cpu-mtp with the MTP label off (tests)"\n'
            ).encode()
        },
        # The same engine, labels and MTP, serving another chat template: it serves, passes
        # every other gate, and answers differently (what the canary must catch).
        CHANGED_TEMPLATE_TAG: {
            "Dockerfile": (
                head + f"COPY changed-chat-template.jinja {CHANGED_TEMPLATE_PATH}\n"
                "COPY entrypoint-changed.sh /usr/local/bin/gemma4-entrypoint-changed\n"
                'ENTRYPOINT ["/usr/local/bin/gemma4-entrypoint-changed"]\n'
                'LABEL org.opencontainers.image.description="cpu-mtp serving another chat '
                'template: its answers change (canary tests)"\n'
            ).encode(),
            "changed-chat-template.jinja": _changed_chat_template().encode(),
            "entrypoint-changed.sh": (
                "#!/bin/sh\n"
                'exec /usr/local/bin/gemma4-entrypoint "$@" '
                f"--chat-template {CHANGED_TEMPLATE_PATH}\n"
            ).encode(),
        },
    }


def _context_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# ---- an image that crashes right after becoming healthy (the unit's start limit) ----------

CRASH_TAG = "0.32.0-mtp-crash-after-health"
CRASH_EXIT = 3
CRASH_AFTER_S = 3  # past several of the unit's 0.5 s health polls; the crash loop is 3 of these

_CRASH_SERVER = f"""\
# The MTP image's labels with a stand-in for vLLM: /health answers 200 on the --host and --port
# the serve script passes, then the process exits {CRASH_EXIT} after {CRASH_AFTER_S} s. A test image
# (tests/plugins/docker_engine.py): an engine that dies right after start-up, without a minute of
# model loading per start of the crash loop.
import http.server, sys, threading, time
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.ThreadingHTTPServer((host, port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(f"crash-after-health: /health on {{host}}:{{port}}, exit in {CRASH_AFTER_S} s", flush=True)
time.sleep({CRASH_AFTER_S})
print("crash-after-health: exiting {CRASH_EXIT}", flush=True)
sys.exit({CRASH_EXIT})
"""


def crash_recipe(parent_id: str) -> dict[str, dict[str, bytes]]:
    return {
        CRASH_TAG: {
            "Dockerfile": (
                f"FROM {parent_id}\n"
                "COPY crash-after-health.py /opt/gemma4-appliance/crash-after-health.py\n"
                'ENTRYPOINT ["python3", "/opt/gemma4-appliance/crash-after-health.py"]\n'
                'LABEL org.opencontainers.image.description="cpu-mtp labels; becomes healthy, '
                'then exits 3 (unit start-limit tests)"\n'
            ).encode(),
            "crash-after-health.py": _CRASH_SERVER.encode(),
        }
    }


# ---- an image that drafts worse and answers the same (the acceptance gate) --------------------

DEGRADED_TAG = "0.32.0-mtp-degraded-drafter"
DEGRADED_DRAFTER = "/opt/gemma4-appliance/degraded-drafter"

_DEGRADED_ENTRY = f"""\
# A deliberate fault (tests/plugins/docker_engine.py): the MTP image serving its drafter from
# {DEGRADED_DRAFTER}, a random drafter of the same tiny target. Greedy verification keeps every
# answer the target's own; almost no draft is accepted (the regression of vLLM PR 49262, to the
# extreme). Everything else (labels, flags, engine) is the MTP image's.
import json, os, sys
args = sys.argv[1:]
i = args.index("--speculative-config") + 1
spec = json.loads(args[i])
spec["model"] = "{DEGRADED_DRAFTER}"
args[i] = json.dumps(spec)
os.execv("/usr/local/bin/gemma4-entrypoint", ["gemma4-entrypoint", *args])
"""


def degraded_recipe(parent_id: str) -> dict[str, dict[str, bytes]]:
    """The MTP image with the random drafter in place of the instance's: same answers, drafts
    almost never accepted."""
    from appliance.engine import devmodel

    drafter = devmodel.cached("random").root / "drafter"
    files = {f"drafter/{p.name}": p.read_bytes() for p in sorted(drafter.iterdir())}
    return {
        DEGRADED_TAG: {
            "Dockerfile": (
                f"FROM {parent_id}\n"
                f"COPY drafter/ {DEGRADED_DRAFTER}/\n"
                "COPY degraded-entry.py /opt/gemma4-appliance/degraded-entry.py\n"
                'ENTRYPOINT ["python3", "/opt/gemma4-appliance/degraded-entry.py"]\n'
                'LABEL org.opencontainers.image.description="cpu-mtp drafting with a random '
                'drafter: same answers, acceptance ~0 (a deliberate fault, canary tests)"\n'
            ).encode(),
            "degraded-entry.py": _DEGRADED_ENTRY.encode(),
            **files,
        }
    }


def build_derived(client, parent_id: str, recipes=None) -> dict[str, str]:
    """Build (or find by a digest label: a label lookup when present) the images derived from
    the MTP image (``recipes``: tag -> build context; the canary's by default); returns tag ->
    full reference."""
    with machine_lock("test-images"):
        return _build_derived(client, parent_id, recipes)


def _build_derived(client, parent_id: str, recipes) -> dict[str, str]:
    import hashlib

    refs = {}
    for tag, files in (recipes or _derived_recipes(parent_id)).items():
        ref = f"{CANARY_TEST_REPO}:{tag}"
        h = hashlib.sha256(b"v2\0" + parent_id.encode())
        for name, data in sorted(files.items()):
            h.update(name.encode() + b"\0" + data)
        want = h.hexdigest()[:32]
        found = client.images.list(filters={"label": f"{CANARY_DIGEST_LABEL}={want}"})
        if found:
            image = found[0]
        else:
            image, _log = client.images.build(
                fileobj=io.BytesIO(_context_tar(files)),
                custom_context=True,
                # The parent's build-digest label must not be inherited: the image builder finds
                # its images by it, and would take this one for the real cpu-mtp image.
                labels={CANARY_DIGEST_LABEL: want, BUILD_DIGEST_LABEL: f"test-{want}"},
                pull=False,
                rm=True,
                forcerm=True,
            )
        if ref not in image.tags:
            image.tag(CANARY_TEST_REPO, tag)
        refs[tag] = ref
    return refs


if pytest is not None:

    @pytest.fixture(scope="session")
    def canary_images(docker_engine, appliance_images) -> dict[str, str]:
        """``{"label-off": ref, "changed-template": ref}``: the MTP image with its MTP label off,
        and the MTP image serving another chat template (answers change). Built once per
        machine on top of the exact ``cpu-mtp`` image; warm: a label lookup."""
        refs = build_derived(docker_engine, appliance_images["cpu-mtp"].image_id)
        return {"label-off": refs[NO_MTP_TAG], "changed-template": refs[CHANGED_TEMPLATE_TAG]}


if pytest is not None:

    @pytest.fixture(scope="session")
    def degraded_image(docker_engine, appliance_images) -> str:
        """The MTP image drafting with a random drafter (a deliberate fault): every answer the
        same, acceptance about 0."""
        parent = appliance_images["cpu-mtp"].image_id
        return build_derived(docker_engine, parent, degraded_recipe(parent))[DEGRADED_TAG]

    @pytest.fixture(scope="session")
    def crash_image(docker_engine, appliance_images) -> str:
        """The MTP image's labels and serve arguments, with an engine that answers /health and
        exits 3 a few seconds later: every start of the unit succeeds, then crashes."""
        parent = appliance_images["cpu-mtp"].image_id
        return build_derived(docker_engine, parent, crash_recipe(parent))[CRASH_TAG]
