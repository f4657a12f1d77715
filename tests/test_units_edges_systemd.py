"""Where the units meet the host's other parts, under real systemd (the session's one machine,
tests/plugins/systemd_instance.py): the state timer leaves a Docker the operator stopped
stopped (issue 45 §4, review S7), and an instance whose models are on a late mount is started
again (§5, review S11)."""

from __future__ import annotations

import time

import pytest

from appliance import units
from appliance.engine.local import free_port

pytestmark = [pytest.mark.systemd, pytest.mark.docker, pytest.mark.engine]

STATE_SERVICE = f"{units.STATE_UNIT}.service"


def test_the_state_service_does_not_start_a_docker_the_operator_stopped(systemd_instance):
    """The machine's docker.service is the stub unit that stands for the host's (its engine is
    bound in from outside): stopped, it is what an operator's `systemctl stop docker` leaves. The
    instance only Wants= it, so it keeps serving; the state service runs, as its timer would."""
    m = systemd_instance.machine
    m.systemctl("stop", "docker.service")
    try:
        assert m.is_active("docker.service") == "inactive"
        # Its result does not matter here (the machine has no /usr/local/bin/appliance): what
        # its start job pulls in does.
        m.systemctl("start", STATE_SERVICE, check=False, timeout=120)
        assert m.is_active("docker.service") == "inactive"
    finally:
        m.systemctl("reset-failed", STATE_SERVICE, check=False)
        m.systemctl("start", "docker.service")
    assert m.is_active(systemd_instance.unit) == "active"


def test_an_instance_whose_models_are_not_mounted_yet_is_started_again(systemd_instance):
    """Review S11: a second instance whose MODEL_DIR is on a file system not mounted yet. The
    serve program exits 75 and systemd starts it again (it stayed `failed` on exit 78); systemd
    reads the instance's RequiresMountsFor= (its drop-in) for the folders it mounts first."""
    inst = systemd_instance
    m = inst.machine
    late = "/srv/gemma4-late-mount/models"
    unit = units.unit_name("late")
    units.install(
        "cpu-tiny-mtp",
        "late",
        root=inst.root,
        options=units.Options(port=free_port(), model_dir=late),
    )
    m.daemon_reload()
    try:
        mounts = m.systemctl("show", "-p", "RequiresMountsFor", "--value", unit).stdout.split()
        assert late in mounts, mounts
        m.systemctl("start", unit, check=False)
        deadline = time.monotonic() + 180
        while int(m.systemctl("show", "-p", "NRestarts", "--value", unit).stdout or 0) < 1:
            assert m.is_active(unit) != "failed", m.journal(unit)
            assert time.monotonic() < deadline, m.journal(unit)
            time.sleep(1)
        status = m.systemctl("show", "-p", "ExecMainStatus", "--value", unit).stdout.strip()
        assert status in ("0", "75"), status  # 0: the restarted start is running now
        assert "is not a directory (yet?)" in m.journal(unit)
    finally:
        m.systemctl("stop", unit, check=False)
        m.systemctl("reset-failed", unit, check=False)
        units.uninstall("late", root=inst.root)
        m.daemon_reload()
    assert m.is_active(inst.unit) == "active"
