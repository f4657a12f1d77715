"""A fleet host's agent proves itself to the central server with credentials from files, never
from the URL or a command line, and its config is root's alone (issue 45 §4, review S9).

The proof is the real Prometheus (Debian's, in agent mode) running the generated config and
remote-writing to a receiver of this test's own on 127.0.0.1, which records what it was sent.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugins.cli import invoke
from plugins.observability import PROMETHEUS, PROMTOOL

from appliance.engine.local import free_port

SECRET = "s3cret-in-a-file"


class _Receiver(http.server.BaseHTTPRequestHandler):
    """The central server's remote-write endpoint: keeps the first request's Authorization."""

    got: list[str]
    first: threading.Event

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.got.append(self.headers.get("Authorization") or "")
        self.first.set()
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _receiver() -> Iterator[tuple[str, list[str], threading.Event]]:
    got: list[str] = []
    first = threading.Event()
    handler = type("Handler", (_Receiver,), {"got": got, "first": first})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/api/v1/write", got, first
    finally:
        server.shutdown()
        server.server_close()


def _scrape_config(out: Path, url: str, *args: str):
    argv = ["fleet", "scrape-config", "--host", "l4-01", "--remote-write", url, *args]
    return invoke([*argv, "--out", str(out)], code=None)


def test_the_agent_sends_basic_auth_read_from_a_file_and_its_config_is_roots_alone(tmp_path):
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "remote-write-password").write_text(SECRET + "\n")
    (folder / "remote-write-password").chmod(0o600)
    out = folder / "prometheus.yml"
    with _receiver() as (url, got, first):
        res = _scrape_config(
            out,
            url,
            "--remote-write-user",
            "l4-01",
            "--remote-write-password-file",
            "remote-write-password",
        )
        assert (res.exit_code, res.output) == (0, f"wrote {out}\n")
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        assert SECRET not in out.read_text()
        port = free_port()
        agent = subprocess.Popen(
            [
                PROMETHEUS,
                "--enable-feature=agent",
                f"--config.file={out}",
                f"--storage.agent.path={tmp_path / 'wal'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # Its first batch: the loopback targets' `up` series, a few seconds after start.
            sent = first.wait(timeout=120)
        finally:
            agent.terminate()
            _, log = agent.communicate(timeout=30)
        assert sent, log[-3000:]
    token = base64.b64encode(f"l4-01:{SECRET}".encode()).decode()
    assert got[0] == f"Basic {token}"


def test_credentials_in_the_url_are_refused_without_echoing_them(tmp_path):
    out = tmp_path / "prometheus.yml"
    res = _scrape_config(out, f"http://l4-01:{SECRET}@central:9090/api/v1/write")
    assert res.exit_code == 2
    assert "carries credentials" in res.output and SECRET not in res.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--remote-write-user", "u"], "needs both the user and the password file"),
        (
            ["--remote-write-user", "u", "--remote-write-password-file", "pw"]
            + ["--remote-write-bearer-token-file", "pw"],
            "not both",
        ),
        (["--remote-write-bearer-token-file", "missing-token"], "missing-token: no such file"),
        (["--remote-write-cert-file", "pw"], "needs both its file and its key"),
    ],
)
def test_credentials_the_agent_could_not_use_are_refused(tmp_path, args, says):
    (tmp_path / "pw").write_text("x\n")
    out = tmp_path / "prometheus.yml"
    res = _scrape_config(out, "https://central:9090/api/v1/write", *args)
    assert res.exit_code == 2 and says in res.output, res.output
    assert not out.exists()


def test_a_bearer_token_and_tls_files_make_a_config_promtool_accepts(tmp_path):
    for name in ("ca", "client"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", str(tmp_path / f"{name}.key"),
             "-out", str(tmp_path / f"{name}.pem")],
            check=True, capture_output=True,
        )  # fmt: skip
    (tmp_path / "token").write_text("t0ken\n")
    out = tmp_path / "prometheus.yml"
    res = _scrape_config(
        out,
        "https://central.example:9090/api/v1/write",
        "--remote-write-bearer-token-file",
        "token",
        "--remote-write-ca-file",
        "ca.pem",
        "--remote-write-cert-file",
        "client.pem",
        "--remote-write-key-file",
        "client.key",
        "--remote-write-server-name",
        "central.example",
    )
    assert res.exit_code == 0, res.output
    check = subprocess.run(
        [PROMTOOL, "check", "config", "--agent", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    text = out.read_text()
    assert "t0ken" not in text and "PRIVATE KEY" not in text
    assert '      credentials_file: "token"\n' in text
    assert '      server_name: "central.example"\n' in text
