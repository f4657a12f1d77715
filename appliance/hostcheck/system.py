"""The host itself: systemd runs and is recent enough for the unit, the user can install, the
instance's API key file is private."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from .findings import Finding

# The unit's ProtectProc=invisible and ProcSubset=pid arrived in systemd 247; an older systemd
# ignores them with a warning and runs the unit with less isolation.
MIN_SYSTEMD = 247


def systemd_finding(booted: Path = Path("/run/systemd/system")) -> Finding:
    try:
        out = subprocess.run(
            ["systemctl", "--version"], check=False, capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return Finding(
            "systemd",
            "blocker",
            "systemctl not found: the appliance runs as a systemd unit",
            "use a host booted with systemd",
        )
    m = re.match(r"systemd (\d+)", out)
    version = int(m.group(1)) if m else 0
    # sd_booted(): systemd is PID 1 exactly when this directory exists.
    if not booted.is_dir():
        return Finding(
            "systemd",
            "blocker",
            f"systemd {version or '?'} is installed but not running ({booted} is missing: "
            "PID 1 is not systemd), so the unit cannot start here",
            "use a host (or machine) booted with systemd",
        )
    if version < MIN_SYSTEMD:
        return Finding(
            "systemd",
            "warn",
            f"systemd {version} is older than {MIN_SYSTEMD}: the unit's ProtectProc= and "
            "ProcSubset= are ignored",
            "upgrade the OS",
        )
    return Finding("systemd", "ok", f"systemd {version} runs (>= {MIN_SYSTEMD})")


def user_finding() -> Finding:
    if os.geteuid() == 0:
        return Finding("user", "ok", "root")
    return Finding(
        "user",
        "blocker",
        f"uid {os.geteuid()}: install writes /etc and the serve program needs the root-owned "
        "Docker socket and key file",
        "run as root (sudo appliance ...)",
    )


def api_key_finding(path: Path) -> Finding:
    try:
        st = path.stat()
    except FileNotFoundError:
        return Finding(
            "api_key",
            "blocker",
            f"{path} is missing: the serve program refuses to start without it",
            "re-run appliance instance install (it creates the key)",
        )
    mode = st.st_mode & 0o7777
    if mode != 0o600:
        return Finding(
            "api_key",
            "blocker",
            f"{path} has mode {mode:o}: the key is readable beyond its owner",
            f"chmod 600 {path}",
        )
    return Finding("api_key", "ok", f"{path} is 600")


# The README's install line makes the appliance's own venv (`python3 -m venv`).
MIN_PYTHON = (3, 11)
# Debian splits ensurepip, which `python3 -m venv` needs, into python3-venv.
_PYTHON_PROBE = "import sys, ensurepip, venv; print('%d.%d' % sys.version_info[:2])"
# Debian's package names it prometheus-node-exporter; upstream's binary is node_exporter.
NODE_EXPORTERS = ("prometheus-node-exporter", "node_exporter")


def python_finding(python: str = "python3") -> Finding:
    """``python``: Python 3.11 or newer that can make a venv (what the install line runs)."""
    fix = "apt install python3 python3-venv (Python >= 3.11)"
    try:
        done = subprocess.run(
            [python, "-c", _PYTHON_PROBE], check=False, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return Finding("python", "warn", f"{python} not found: the install makes a venv", fix)
    if done.returncode != 0:
        return Finding(
            "python",
            "warn",
            f"{python} cannot make a venv (no ensurepip: Debian's python3-venv is missing)",
            fix,
        )
    found = tuple(int(p) for p in done.stdout.strip().split("."))
    wanted = ".".join(map(str, MIN_PYTHON))
    if found < MIN_PYTHON:
        return Finding(
            "python", "warn", f"{python} is {done.stdout.strip()}, older than {wanted}", fix
        )
    return Finding("python", "ok", f"{python} {done.stdout.strip()} with venv (>= {wanted})")


def node_exporter_finding() -> Finding:
    """node_exporter, which serves the state metrics' textfile (README, ADR 0016)."""
    for name in NODE_EXPORTERS:
        path = shutil.which(name)
        if path is not None:
            return Finding("node_exporter", "ok", f"{path}")
    return Finding(
        "node_exporter",
        "warn",
        "node_exporter not found: the state metrics the timer writes are not served",
        "apt install prometheus-node-exporter, and link the state textfile into its textfile "
        "directory (README, Monitoring)",
    )
