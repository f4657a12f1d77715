"""A fleet's hosts: one host's status for the fleet playbooks, and Prometheus targets for all.

:func:`host_status` is what ``appliance fleet status INSTANCE --json`` prints on each host (the
playbook collects it): the env file's image, the running container's image (they differ while a
restart is pending or after a hand edit), the unit, health, MTP state and the acceptance since
the server started.

:func:`targets_from_inventory` turns ``ansible-inventory --list`` output into a Prometheus
file_sd JSON: one group per host, labelled ``host`` (the inventory name) as well as ``instance``
(the appliance instance) and ``profile``; :func:`state_targets_from_inventory` does the same for
each host's appliance state. The ``host`` label is what keeps two hosts' series apart: a fleet
usually runs the same instance name everywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cutover.context import Context
from ..cutover.status import status
from ..errors import ApplianceError, UsageError
from ..host import reach
from ..host.layout import Layout
from ..host.names import check_instance
from ..host.systemd import Systemd
from ..observability import file_sd
from ..observability.file_sd import EngineTarget
from ..units.instance import read as read_instance
from . import soak

DEFAULT_GROUP = "gemma4"


@dataclass
class HostStatus:
    """One instance on one host, for the fleet's status table."""

    instance: str
    unit_state: str
    env_image: str | None
    container_image: str | None
    healthy: bool | None
    mtp: bool | None
    acceptance: float | None  # since the server started; None without MTP traffic
    tokens_per_step: float | None
    rollback_image: str | None
    last: str | None  # the last cutover/rollback: "kind outcome from -> to"
    error: str | None = None
    container: str = ""  # the container asked: the serving one (a group's head where it runs)
    # What this host was not asked, and why (a tree that is not the host: host/reach.py).
    not_asked: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def host_status(instance: str, root: Path = Path("/")) -> HostStatus:
    """Gather :class:`HostStatus` for ``instance`` (read only); a name this host has never
    seen is a UsageError, as for ``appliance status``."""
    # The tree's own systemd and Docker only: never the host's for a tree (host/reach.py).
    ctx = Context(layout=Layout(root), systemd=Systemd.of_tree(root))
    st = status(ctx, instance, last=1)
    last = None
    if st.entries:
        e = st.entries[-1]
        last = f"{e.kind} {e.outcome} {e.from_image or '-'} -> {e.to_image}"
    out = HostStatus(
        instance=instance,
        unit_state=st.unit_state,
        env_image=st.image,
        container_image=st.running_ref,  # the shape's serving container, asked as status asks
        healthy=st.healthy,
        mtp=st.speculative,
        acceptance=None,
        tokens_per_step=None,
        rollback_image=st.rollback_image,
        last=last,
        error=st.instance_error,
        container=st.container,
    )
    said = (st.running_error, st.health_note, *(f"{u}: {v}" for u, v in st.units.items()))
    out.not_asked = [w for w in said if w and reach.NOT_ASKED in w]
    if st.healthy and st.url:
        try:
            key = read_instance(ctx.layout.root, instance).api_key()
            since_start = soak.window(None, soak.read(st.url, key)).spec
            out.acceptance = since_start.acceptance
            out.tokens_per_step = since_start.tokens_per_step
        except ApplianceError as exc:
            out.error = str(exc)
    return out


def targets_from_inventory(inventory: dict, group: str = DEFAULT_GROUP) -> list[dict]:
    """file_sd groups for the hosts of ``group`` in ``ansible-inventory --list`` output.

    Per host: the scrape address is ``appliance_scrape_address`` if set, else ``ansible_host``,
    else the inventory name; the port is ``appliance_port``; ``appliance_instance`` and
    ``appliance_profile`` become labels.
    """
    groups = []
    for name, hv in _hostvars(inventory, group):
        missing = [k for k in ("appliance_instance", "appliance_port") if k not in hv]
        if missing:
            raise UsageError(f"host {name}: no {', '.join(missing)} in the inventory")
        port = _port(name, hv, "appliance_port")
        instance = check_instance(str(hv["appliance_instance"]))
        profile = str(hv.get("appliance_profile", ""))
        groups.append(EngineTarget(instance, profile, _address(name, hv), port, node=name).group())
    return groups


def state_targets_from_inventory(inventory: dict, group: str = DEFAULT_GROUP) -> list[dict]:
    """file_sd groups for each host's appliance state (node_exporter's textfile collector, port
    ``appliance_state_port``, default 9100), labelled ``host`` like the engines: the dashboards
    join an engine to its running image on host and instance."""
    return [
        {
            "targets": [f"{_address(name, hv)}:{_port(name, hv, 'appliance_state_port', 9100)}"],
            "labels": {"host": name},
        }
        for name, hv in _hostvars(inventory, group)
    ]


def _hostvars(inventory: dict, group: str) -> list[tuple[str, dict]]:
    """(name, variables) of every host of ``group``, sorted by name."""
    if not isinstance(inventory, dict) or "_meta" not in inventory:
        raise UsageError(
            "not `ansible-inventory --list` output (no _meta)",
            fix="ansible-inventory -i INVENTORY --list > inventory.json",
        )
    hostvars = inventory["_meta"].get("hostvars", {})
    hosts = _hosts_of(inventory, group)
    if not hosts:
        raise UsageError(f"no hosts in group {group!r} of the inventory")
    return [(name, hostvars.get(name, {})) for name in sorted(hosts)]


def _address(name: str, hv: dict) -> str:
    return str(hv.get("appliance_scrape_address") or hv.get("ansible_host") or name)


def _port(name: str, hv: dict, key: str, default: int | None = None) -> int:
    try:
        port = int(hv[key] if default is None else hv.get(key, default))
    except (TypeError, ValueError):
        raise UsageError(f"host {name}: {key} is not a number") from None
    if not 0 < port < 65536:
        raise UsageError(f"host {name}: {key} {port} is not a TCP port")
    return port


def _hosts_of(inventory: dict, group: str) -> set[str]:
    """Every host of ``group`` and of its child groups."""
    seen: set[str] = set()
    stack, hosts = [group], set()
    while stack:
        g = stack.pop()
        if g in seen:
            continue
        seen.add(g)
        entry = inventory.get(g) or {}
        hosts.update(entry.get("hosts", []))
        stack.extend(entry.get("children", []))
    return hosts


def render_targets(groups: list[dict]) -> str:
    """The file_sd JSON text (stable bytes): the format ``appliance instance install`` writes."""
    return file_sd.dump(groups)
