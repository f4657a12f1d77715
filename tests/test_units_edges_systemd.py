"""Where the units meet the host's other parts, under real systemd (the session's one machine,
tests/plugins/systemd_instance.py): the state timer leaves a Docker the operator stopped
stopped (issue 45 §4, review S7)."""

from __future__ import annotations

import pytest

from appliance import units

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
