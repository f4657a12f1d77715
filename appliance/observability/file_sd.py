"""Prometheus file-based service discovery for the engines this host serves.

The engine scrape job reads its targets from a JSON file (``file_sd_configs``) that
``appliance instance install`` and ``uninstall`` rewrite from the installed instances: the port
a profile serves on (8050 for the reference 4xL4 host, 8000 for others) reaches Prometheus
without anyone editing ``prometheus.yml``, and an instance added or removed is picked up within
Prometheus' file-watch interval, with no reload.

Each instance is one target group labelled ``instance`` (the appliance instance name the state
metrics carry, so engine figures join the running image) and ``profile``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

# Where install writes the file on a host, and where prometheus.yml looks for it: a relative
# file_sd path is resolved against the config file's directory (compose mounts the host
# directory there; a distro Prometheus links it).
TARGETS_DIR = "/etc/gemma4-vllm/prometheus"
ENGINE_FILE = "engines.json"
CONFIG_RELATIVE = f"targets/{ENGINE_FILE}"


@dataclass(frozen=True)
class EngineTarget:
    """One engine to scrape: the appliance instance, its profile and its address; ``node``,
    the inventory host, labels it across a fleet (instances of equal names on many hosts)."""

    instance: str
    profile: str
    host: str
    port: int
    node: str = ""

    @property
    def address(self) -> str:
        # An any-address bind is scraped on loopback, as the appliance itself calls it.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def group(self) -> dict:
        """This target's file_sd group: its address, labelled ``host`` (when a fleet's),
        ``instance`` and ``profile`` (when known)."""
        labels = {"host": self.node} if self.node else {}
        labels["instance"] = self.instance
        if self.profile:
            labels["profile"] = self.profile
        return {"targets": [self.address], "labels": labels}


def dump(groups: Iterable[dict]) -> str:
    """file_sd JSON text for ``groups``, stable bytes."""
    return json.dumps(list(groups), indent=2) + "\n"


def render(targets: Iterable[EngineTarget]) -> str:
    """The file_sd JSON for ``targets``: one group per target, sorted by host and instance."""
    return dump(t.group() for t in sorted(targets, key=lambda t: (t.node, t.instance)))
