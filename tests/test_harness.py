"""The suite's own sharing rules, checked: what two streams or two fixtures run side by side
never share (a compile cache, a port range), and a read of a container that failed never passes
for a value."""

from __future__ import annotations

import pytest
from conftest import STREAMS, stream_ports
from plugins import fleet, fleet_group, multinode, systemd_instance
from plugins.docker_engine import inspect_container
from test_bare_host_systemd import VLLM_CACHE as BARE_HOST_CACHE

from appliance.engine import local


def test_each_fixture_has_its_own_compile_cache():
    caches = [
        systemd_instance.VLLM_CACHE,
        multinode.VLLM_CACHE,
        fleet.VLLM_CACHE,
        fleet_group.VLLM_CACHE,
        BARE_HOST_CACHE,
    ]
    assert len(set(caches)) == len(caches), caches


def test_the_streams_pick_ports_from_ranges_that_do_not_meet():
    low, high = local.PORT_RANGE
    machines, host = (stream_ports(s, (low, high)) for s in STREAMS)
    # Two halves of the one range, side by side: a port of one is never the other's.
    assert (host[0], host[1], machines[1]) == (low, machines[0], high), (host, machines)


@pytest.mark.docker
def test_a_container_that_cannot_be_read_raises(docker_engine):
    with pytest.raises(RuntimeError, match="No such"):
        inspect_container("gemma4-harness-test-no-such-container", "{{.Image}}")
