"""The start-time model check under real systemd: a broken model directory ends the unit `failed`
with exit status 78 after ONE start (RestartPreventExitStatus=78: no restart loop), and the
journal holds the serve script's one line naming the model and the fix.

Its own nspawn machine (tests/plugins/nspawn.py), "gemma4-modeltest": the cutover's systemd tests
use "gemma4-systest" at the same time. Instance "modeltest" of cpu-tiny-mtp, its MODEL_DIR a copy
of the tiny pair with the target's weights truncated, bound into the machine at the same path.
The check runs before the serve script's first docker call, so no engine container is created.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugins import nspawn
from plugins.systemd_instance import MTP_IMAGE

from appliance import units
from appliance.engine import devmodel
from appliance.engine.local import free_port

pytestmark = [pytest.mark.systemd, pytest.mark.docker]

INSTANCE = "modeltest"


def _show(m: nspawn.Machine, unit: str) -> dict[str, str]:
    out = m.systemctl(
        "show", "-p", "ActiveState,SubState,Result,ExecMainStatus,NRestarts", unit, check=False
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A scratch directory outside /tmp: the unit has PrivateTmp=yes, so a MODEL_DIR under the
    host's /tmp is an empty directory, or none, from inside the unit."""
    path = Path(tempfile.mkdtemp(prefix="modeltest-", dir=nspawn.CACHE.parent))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_broken_model_dir_fails_the_unit_once_with_78_and_one_line(host_dir, docker_engine):
    model_dir = host_dir / "models"
    shutil.copytree(devmodel.cached("copy").root, model_dir)
    weights = model_dir / "target" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    unit = units.unit_name(INSTANCE)
    with nspawn.boot("gemma4-modeltest", binds=[(str(model_dir), str(model_dir))]) as m:
        units.install(
            "cpu-tiny-mtp",
            INSTANCE,
            root=m.root,
            options=units.Options(image=MTP_IMAGE, model_dir=str(model_dir), port=free_port()),
        )
        m.daemon_reload()
        m.systemctl("start", unit, check=False, timeout=120)
        state = _show(m, unit)
        # Failed, and no restart scheduled: until RestartSec runs out, a restart to come shows as
        # ActiveState activating, SubState auto-restart.
        assert state == {
            "ActiveState": "failed",
            "SubState": "failed",
            "Result": "exit-code",
            "ExecMainStatus": "78",
            "NRestarts": "0",
        }, m.journal(unit)
        journal = m.run(
            "journalctl",
            "--no-pager",
            "-o",
            "cat",
            f"SYSLOG_IDENTIFIER=gemma4-vllm@{INSTANCE}",
            check=False,
        ).stdout
        lines = [line for line in journal.splitlines() if "models not ready" in line]
        want = (
            f"gemma4-vllm@{INSTANCE}: models not ready: target {model_dir}/target: file "
            f"model.safetensors is truncated ({size // 2} of {size} bytes) (fix: appliance "
            f"dev devmodel DIR (a new or empty directory), then MODEL_DIR=DIR in "
            f"/etc/gemma4-vllm/{INSTANCE}.env)"
        )
        assert lines == [want], journal
        m.systemctl("reset-failed", unit, check=False)
    # The check came before `docker run`: no container was ever made for the instance.
    ps = subprocess.run(
        ["docker", "ps", "-a", "--filter", f"name=^{units.container_name(INSTANCE)}$", "-q"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ps.stdout.strip() == ""
    assert Path(model_dir).is_dir()
