"""Secrets stay secret, and the engine container runs with least privilege.

Under real systemd (the shared nspawn instance, tests/plugins/systemd_instance.py) serving the
real CPU image: the instance's key file is mounted read-only into the container, whose entry
point hands it to vLLM, so the key is in no ``docker inspect`` output, no ``/proc/*/cmdline`` on
the host, no journal field, no ``systemctl show`` and no output of the serve program.
The key file has CRLF line endings here on purpose: the engine and the appliance's Python
clients must read the same key from it. The container runs with no capabilities, no new
privileges, an init, a pids limit and a private /dev/shm, and still serves; media URLs on
loopback are never fetched.

The key file's bytes go to the container on the stdin of ``docker run -i``, not as a bind
mount: under nspawn (as with a remote DOCKER_HOST) dockerd resolves a mount's source on its own
filesystem, and a missing one becomes an empty directory (seen here first).

The docker-tier test at the end runs the serve program's ``print`` against a small image without
the key-file label (an image built by an older appliance): the documented old path, where the
key goes by name and still never reaches the output. The serve program is Python: there is no
shell trace to leak it (``bash -x`` of the old script was checked here).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from plugins.systemd_instance import MTP_IMAGE, SystemdInstance

from appliance import units
from appliance.engine.local import free_port
from appliance.host import apikey, envfile
from appliance.host.layout import Layout
from appliance.oci import labels

SERVE = "/usr/local/libexec/gemma4-vllm/serve"


@pytest.fixture(scope="module")
def crlf_instance(systemd_instance: SystemdInstance):
    """The shared instance on the MTP image; its key file has had CRLF line endings since the
    session set it up (tests/plugins/systemd_instance.py), so no restart is needed here."""
    inst = systemd_instance
    key_path = Layout(inst.root).api_key_file(inst.instance)
    assert key_path.read_bytes().endswith(b"\r\n")
    inst.ensure(MTP_IMAGE)
    return inst, key_path.read_bytes().decode().strip()


def _host_cmdlines() -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return out


def _inspect(inst: SystemdInstance) -> tuple[str, dict]:
    raw = subprocess.run(
        ["docker", "inspect", inst.container], capture_output=True, text=True, check=True
    ).stdout
    return raw, json.loads(raw)[0]


@pytest.mark.systemd
@pytest.mark.docker
@pytest.mark.engine
def test_the_key_is_nowhere_but_in_its_file(crlf_instance):
    inst, key = crlf_instance
    assert len(key) >= 32
    # The engine takes exactly the stripped key, as every Python client reads it.
    assert apikey.resolve(instance=inst.instance, root=inst.root).value == key
    assert inst.chat("with the key", max_tokens=4, key=key).status_code == 200
    assert inst.chat(key=None).status_code == 401
    assert inst.chat(key="not-the-key").status_code == 401

    raw, info = _inspect(inst)
    assert key not in raw
    assert not [e for e in info["Config"]["Env"] if e.startswith("VLLM_API_KEY")]
    assert f"{labels.API_KEY_STDIN_ENV}=1" in info["Config"]["Env"]
    assert info["Config"]["OpenStdin"] is True and info["Config"]["StdinOnce"] is True

    cmdlines = _host_cmdlines()
    assert any(f"--port {inst.port}" in c for c in cmdlines)  # the engine is among them
    assert [c for c in cmdlines if key in c] == []

    # Every field of every entry of the machine's whole journal (_CMDLINE, _EXE, ...).
    journal = inst.machine.run("journalctl", "--no-pager", "-o", "export", check=False).stdout
    assert "vLLM healthy" in journal and key not in journal
    shown = inst.machine.systemctl("show", inst.unit).stdout
    assert f"{SERVE} {inst.instance} run" in shown and key not in shown

    # The serve program as an operator debugging the unit would run it (print does all that run
    # does, key handling included, except the exec).
    shown = inst.machine.run(
        "bash",
        "-c",
        f"set -a; . /etc/gemma4-vllm/{inst.instance}.env; set +a; {SERVE} {inst.instance} print",
        check=False,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.rstrip().endswith(f"< /etc/gemma4-vllm/{inst.instance}.api-key")
    assert key not in shown.stdout + shown.stderr


@pytest.mark.systemd
@pytest.mark.docker
@pytest.mark.engine
def test_the_engine_runs_without_privileges_and_fetches_no_media_urls(crlf_instance):
    inst, key = crlf_instance
    _raw, info = _inspect(inst)
    host = info["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["Init"] is True and host["PidsLimit"] == 4096
    assert host["IpcMode"] != "host" and host["ShmSize"] == 1 << 30
    # vLLM's processes have no capability at all (CapEff/CapPrm/CapBnd are zero).
    top = subprocess.run(
        ["docker", "top", inst.container, "-eo", "pid"], capture_output=True, text=True, check=True
    ).stdout.split()[1:]
    assert len(top) >= 3  # init, the API server, the engine core
    for pid in top:
        status = Path(f"/proc/{pid}/status").read_text()
        caps = dict(line.split(":\t") for line in status.splitlines() if line.startswith("Cap"))
        assert int(caps["CapEff"], 16) == int(caps["CapBnd"], 16) == 0, (pid, caps)
        assert "NoNewPrivs:\t1" in status
    print(f"\nthe engine container runs {_threads(top)} threads (pids limit 4096)")

    # The guard reached the engine (vLLM logs its non-default arguments) ...
    args = info["Args"]
    assert args[args.index("--allowed-media-domains") + 1].endswith(".invalid")
    invocation = inst.show("InvocationID")
    journal = inst.machine.run(
        "journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={invocation}", check=False
    ).stdout
    assert "allowed_media_domains" in journal
    # ... and a chat naming a loopback-only service as an image is refused without a request.
    # The tiny model is text-only, so vLLM refuses the image part before any fetch whatever the
    # flag says: tests/test_profile_args.py shows vLLM's own fetcher obeying the flag.
    import http.server
    import threading

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        resp = httpx.post(
            f"{inst.url}/v1/chat/completions",
            json={
                "model": "gemma4-tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "describe"},
                            {
                                "type": "image_url",
                                "image_url": {
                                    "url": f"http://127.0.0.1:{srv.server_port}/admin.png"
                                },
                            },
                        ],
                    }
                ],
                "max_tokens": 4,
            },
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
    finally:
        srv.shutdown()
        srv.server_close()
    print(f"image_url on loopback: HTTP {resp.status_code}: {resp.text[:300]}")
    assert 400 <= resp.status_code < 500
    assert seen == []
    assert inst.chat("still serving", max_tokens=4, key=key).status_code == 200


def _threads(pids: list[str]) -> int:
    n = 0
    for pid in pids:
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


# --- the old path: an image without the key-file label (docker tier, no engine) ----------------


@pytest.mark.docker
def test_an_unlabelled_image_gets_the_key_by_name_and_no_output_shows_it(tmp_path, serve_images):
    instance = f"secrets-{os.getpid()}"
    units.install(
        "cpu-tiny-mtp",
        instance,
        root=tmp_path,
        options=units.Options(port=free_port(), model_dir=str(tmp_path)),
    )
    key_path = Layout(tmp_path).api_key_file(instance)
    key = key_path.read_text().strip()
    key_path.write_text(f"{key}\r\n")
    env = {
        **envfile.read(Layout(tmp_path).env_file(instance)).values,
        "PATH": os.environ["PATH"],
        "APPLIANCE_ROOT": str(tmp_path),
        "VLLM_CACHE_DIR": str(tmp_path / "cache"),
    }
    script = str(Layout(tmp_path).serve_program)
    for tag, path_in_args in (("mtp-0.32", "--env VLLM_API_KEY"), ("nolabels", "--env")):
        proc = subprocess.run(
            [script, instance, "print"],
            env={**env, "VLLM_IMAGE": serve_images[tag]},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert path_in_args in proc.stdout and "--interactive" not in proc.stdout
        assert f"not labelled {labels.API_KEY_STDIN}=true" in proc.stderr
        assert key not in proc.stdout + proc.stderr
    # A key outside the safe set is refused before docker, in one line, without echoing it; a
    # NUL byte too (the old script's grep passed "abc\0def" and the entry point served "abcdef").
    for bad, shows in ((b"sp ace\n", "sp ace"), (b"abc\0def\n", "abc")):
        key_path.write_bytes(bad)
        proc = subprocess.run(
            [script, instance, "print"],
            env={**env, "VLLM_IMAGE": serve_images["mtp-0.32"]},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (proc.returncode, proc.stdout) == (78, ""), proc.stderr
        assert "holds characters outside the safe set" in proc.stderr
        assert shows not in proc.stderr.split(":", 1)[1].replace(str(key_path), "")
