"""A stand-in for the Hugging Face Hub on 127.0.0.1 serving the tiny models, for ``appliance models
pull``: a real HTTP server, but the whole hub service is this file, not only its faults.

Why a stand-in: no hub is reachable from these machines or from CI (nothing outside the host is,
at test time), and the faults the pull must survive cannot be produced on demand on the real
hub: a gated repo answering 401 to a request without the token, a connection dropped midway
that the client must resume with a Range request, a download slow enough to kill midway.

It mimics the hub as seen by one client release, ``huggingface_hub`` :data:`HUB_CLIENT_VERSION`
(the version constraints.txt pins): the part of the API its ``snapshot_download`` uses, i.e.
repo info (``/api/models/R[/revision/REV]``, with ``sha`` and ``siblings``), the recursive tree
listing (``/api/models/R/tree/REV``), and ``/R/resolve/REV/PATH`` (HEAD and GET, ``ETag`` =
sha256 for LFS files and the git blob id otherwise, ``X-Repo-Commit``, ``Range`` answered with
206). Repos may be gated: then a request without the right bearer token gets the hub's 401
``X-Error-Code: GatedRepo``. Another client release may ask for other routes or headers, so
test_models.py fails when the installed ``huggingface_hub`` or the pin is not
:data:`HUB_CLIENT_VERSION`: an upgrade forces a look at this file (then bump the constant).

Faults, set per file on the running hub: ``throttle`` (bytes per second, so a test can kill a
download midway) and ``drop_after`` (close the connection once after N body bytes: the client
must resume with a Range request). Every request is logged (method, path, Range, status, body
bytes, whether the token came). The client is the real ``huggingface_hub`` with ``HF_ENDPOINT``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from appliance.engine import devmodel
from appliance.models import cache

TARGET_REPO = "appliance-test/gemma4-tiny-it"
DRAFTER_REPO = "appliance-test/gemma4-tiny-it-assistant"
HUB_TOKEN = "hf_testTokenNotASecret4d1e"  # guards a throwaway hub on 127.0.0.1
# The huggingface_hub release this stand-in answers as (constraints.txt pins the same).
HUB_CLIENT_VERSION = "2.4.0"


@dataclass
class HubFile:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(f"blob {len(self.data)}\0".encode() + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "path": path, "size": len(self.data)}
        if self.lfs:
            entry["oid"] = cache.lfs_pointer_oid(self.sha256, len(self.data))
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": 134}
        else:
            entry["oid"] = self.git_oid
        return entry


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    gated: bool = False

    @property
    def commit(self) -> str:
        h = hashlib.sha1(self.repo_id.encode())
        for path, f in sorted(self.files.items()):
            h.update(f"{path}\0{f.etag}\0".encode())
        return h.hexdigest()


def repo_from_dir(repo_id: str, directory: Path, *, gated: bool = False) -> HubRepo:
    """A hub repo holding every file of ``directory`` (safetensors as LFS files, as on the hub)."""
    files = {
        p.relative_to(directory).as_posix(): HubFile(p.read_bytes(), p.suffix == ".safetensors")
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
    return HubRepo(repo_id, files, gated)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    sent: int
    authorized: bool


@dataclass
class Hub:
    """The running hub: its URL, repos, request log and faults."""

    url: str
    repos: dict[str, HubRepo]
    token: str
    log: list[Request] = field(default_factory=list)
    throttle: dict[str, int] = field(default_factory=dict)  # file path -> bytes per second
    drop_after: dict[str, int] = field(default_factory=dict)  # file path -> body bytes, once
    streamed: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent so far
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, repo: HubRepo) -> HubRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def downloads(self, path_suffix: str = "") -> list[Request]:
        """GET requests of file content (``/resolve/``) whose path ends with ``path_suffix``."""
        with self.lock:
            return [
                r
                for r in self.log
                if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(path_suffix)
            ]

    def sent(self, path_suffix: str) -> int:
        return sum(r.sent for r in self.downloads(path_suffix))


def _handler(hub: Hub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _record(self, status: int, sent: int) -> Request:
            """Log the request BEFORE its body goes out: a client that has read the whole body
            may look at the log at once, before this thread runs on (seen under load: a
            download missing from the log)."""
            auth = self.headers.get("Authorization") == f"Bearer {hub.token}"
            req = Request(self.command, self.path, self.headers.get("Range"), status, sent, auth)
            with hub.lock:
                hub.log.append(req)
            return req

        def _json(self, status: int, body, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self._record(status, 0)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, extra=None) -> None:
            self._json(
                status,
                {"error": message},
                {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})},
            )

        def _repo(self, repo_id: str) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                return None
            if repo.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have "
                    "access to it and be authenticated to access it. Please log in.",
                )
                return None
            return repo

        def _revision(self, repo: HubRepo, rev: str) -> bool:
            if rev in ("main", repo.commit):
                return True
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return False

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = self._repo("/".join(parts[2:4]))
                if repo is None:
                    return
                rest = parts[4:]
                if not rest or rest[0] == "revision":
                    if rest and not self._revision(repo, rest[1]):
                        return
                    siblings = [
                        {"rfilename": p, "size": len(f.data)} for p, f in sorted(repo.files.items())
                    ]
                    self._json(
                        200,
                        {
                            "id": repo.repo_id,
                            "modelId": repo.repo_id,
                            "sha": repo.commit,
                            "private": False,
                            "gated": "manual" if repo.gated else False,
                            "siblings": siblings,
                        },
                    )
                    return
                if rest[0] == "tree" and self._revision(repo, rest[1]):
                    self._json(200, [f.tree_entry(p) for p, f in sorted(repo.files.items())])
                    return
                if rest[0] == "tree":
                    return
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo("/".join(parts[:2]))
                if repo is None or not self._revision(repo, parts[3]):
                    return
                path = "/".join(parts[4:])
                f = repo.files.get(path)
                if f is None:
                    self._error(
                        404,
                        "EntryNotFound",
                        f"{path} does not exist",
                        {"X-Repo-Commit": repo.commit},
                    )
                    return
                self._file(repo, path, f)
                return
            self._error(404, "NotFound", f"no route {self.path}")

        def _file(self, repo: HubRepo, path: str, f: HubFile) -> None:
            start, status = 0, 200
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and self.command == "GET":
                start = int(rng[6:].split("-")[0] or 0)
                status = 206
            body = f.data[start:]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{f.etag}"')
            self.send_header("X-Repo-Commit", repo.commit)
            if f.lfs:
                self.send_header("X-Linked-Etag", f'"{f.etag}"')
                self.send_header("X-Linked-Size", str(len(f.data)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(f.data) - 1}/{len(f.data)}")
            req = self._record(status, 0)
            self.end_headers()
            if self.command == "HEAD":
                return
            with hub.lock:
                drop = hub.drop_after.pop(path, None)
            rate = hub.throttle.get(path)
            sent = 0
            try:
                while sent < len(body):
                    step = 16384 if rate else len(body)
                    if drop is not None:
                        step = min(step, drop - sent)
                        if step <= 0:
                            # A real dropped connection: the client saw fewer bytes than promised.
                            self.close_connection = True
                            break
                    # Counted before the write, for the same reason as _record; taken back
                    # below if the write fails.
                    with hub.lock:
                        req.sent += step
                        hub.streamed[path] = hub.streamed.get(path, 0) + step
                    self.wfile.write(body[sent : sent + step])
                    self.wfile.flush()
                    sent += step
                    if rate:
                        time.sleep(step / rate)
                        rate = hub.throttle.get(path)  # lifted midway: go full speed
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                with hub.lock:
                    hub.streamed[path] -= req.sent - sent
                    req.sent = sent

    return Handler


@pytest.fixture()
def local_hub(tmp_path_factory) -> Iterator[Hub]:
    """A hub on 127.0.0.1 serving the tiny target (gated) and its copy drafter."""
    pair = devmodel.cached(drafter="copy")
    hub = Hub("", {}, HUB_TOKEN)
    hub.add(repo_from_dir(TARGET_REPO, pair.target, gated=True))
    hub.add(repo_from_dir(DRAFTER_REPO, pair.drafter))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    hub.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield hub
    srv.shutdown()
    srv.server_close()
