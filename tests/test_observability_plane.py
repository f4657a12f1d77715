"""`appliance observability write` over a plane the operator has worked in: their changes and
their files are kept (issue 45 §3, review S4). The plane's files are the real shipped ones; an
older release is a copy of them with files changed, written from by the same public API."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from appliance.observability import plane

ROOT = Path(__file__).resolve().parents[1]
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
RECEIVER = "prometheus/alertmanager.yml"
OURS = "http://alerts.example.com:8443/hook"


def _write(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [APPLIANCE, "observability", "write", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _edit_receiver(path: Path) -> str:
    text = path.read_text()
    edited = re.sub(r'url: "http://127\.0\.0\.1:\d+/gemma4-alerts"', f'url: "{OURS}"', text)
    assert edited != text
    path.write_text(edited)
    return edited


def _older_release(tmp_path: Path) -> Path:
    """The plane's files as a release before this one shipped them: the receiver file and the
    Prometheus config each differ by a line."""
    old = tmp_path / "older-release"
    for folder in plane.FOLDERS:
        shutil.copytree(ROOT / folder, old / folder, ignore=shutil.ignore_patterns("tests"))
    for rel in (RECEIVER, "prometheus/prometheus.yml"):
        (old / rel).write_text((old / rel).read_text() + "# an older release's line\n")
    return old


def test_a_second_write_keeps_the_operators_receiver_and_added_files(tmp_path):
    out = tmp_path / "plane"
    assert _write(out).returncode == 0
    edited = _edit_receiver(out / RECEIVER)
    secret = out / "prometheus" / "smtp-password"
    secret.write_text("hunter2\n")
    res = _write(out)
    assert res.returncode == 0, res.stderr
    assert (out / RECEIVER).read_text() == edited
    assert secret.read_text() == "hunter2\n"
    # Nothing new was shipped for the receiver: nothing to merge, nothing beside it.
    assert not (out / (RECEIVER + plane.NEW)).exists()
    assert "kept" not in res.stderr


def test_an_upgrade_replaces_untouched_files_and_keeps_a_changed_one_with_the_new_beside(
    tmp_path,
):
    out = tmp_path / "plane"
    plane.write(out, source=_older_release(tmp_path))
    edited = _edit_receiver(out / RECEIVER)
    res = _write(out)
    assert res.returncode == 0, res.stderr
    shipped = (ROOT / RECEIVER).read_text()
    # The operator did not touch prometheus.yml: it is the new release's.
    assert (out / "prometheus/prometheus.yml").read_text() == (
        ROOT / "prometheus/prometheus.yml"
    ).read_text()
    assert (out / RECEIVER).read_text() == edited
    assert (out / (RECEIVER + plane.NEW)).read_text() == shipped
    assert f'-      - url: "{OURS}"' in res.stdout
    assert "+# an older release's line" not in res.stdout
    assert "-# an older release's line" in res.stdout
    assert f"kept {out / RECEIVER} as you changed it" in res.stderr
    # Alertmanager and Prometheus read only their own names: the copy beside is inert.
    assert (
        yaml.safe_load((out / RECEIVER).read_text())["receivers"][0]["webhook_configs"][0]["url"]
        == OURS
    )

    forced = _write(out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / RECEIVER).read_text() == shipped
    assert (out / (RECEIVER + plane.OLD)).read_text() == edited
    assert f"yours is {Path(RECEIVER).name}{plane.OLD}" in forced.stderr


def test_a_plane_from_before_the_record_keeps_every_file_that_differs(tmp_path):
    """A plane an older appliance wrote has a marker without hashes: whatever differs from the
    shipped file may be the operator's, so it is kept."""
    out = tmp_path / "plane"
    plane.write(out)
    (out / plane.MARKER).write_text("written by `appliance observability write`\n")
    edited = _edit_receiver(out / RECEIVER)
    written = plane.write(out)
    assert (out / RECEIVER).read_text() == edited
    assert [k.path for k in written.kept] == [out / RECEIVER]


def test_the_plane_is_readable_by_its_containers_whatever_the_umask(tmp_path):
    out = tmp_path / "plane"
    old = os.umask(0o077)
    try:
        plane.write(out)
        (out / RECEIVER).unlink()
        plane.write(out)
    finally:
        os.umask(old)
    for path in [out, *out.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


def _ports_named(path: Path) -> set[int]:
    text = path.read_text(errors="replace")
    found = re.findall(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0):(\d{2,5})\b", text)
    found += re.findall(r"port\w*\s*[:=]\s*(\d{2,5})\b", text)
    return {int(p) for p in found}


def test_the_example_webhook_is_on_a_port_nothing_of_the_appliance_uses():
    config = yaml.safe_load((ROOT / RECEIVER).read_text())
    [hook] = config["receivers"][0]["webhook_configs"]
    port = int(re.match(r"http://127\.0\.0\.1:(\d+)/", hook["url"]).group(1))
    used: dict[int, list[str]] = {}
    kinds = {".py", ".toml", ".yml", ".yaml", ".j2", ".service"}
    for top in ("appliance", "deploy", "prometheus", "docker", "systemd"):
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in kinds and path != ROOT / RECEIVER:
                for p in _ports_named(path):
                    used.setdefault(p, []).append(str(path.relative_to(ROOT)))
    assert 9095 in used and 9093 in used  # the scan sees the agent's and Alertmanager's ports
    assert port not in used, used[port]
