"""The observability files the one generator (:mod:`appliance.dev.generate`) writes.

The JSON in ``grafana/dashboards/`` and the YAML in ``prometheus/`` are produced here from
:mod:`.dashboards`, :mod:`.rules` and :mod:`.scrape`, deterministically; :func:`problems` adds
what a byte comparison cannot see: recorded series used but defined by no rule.
"""

from __future__ import annotations

import json

from . import metric_check, rules, scrape
from .dashboards import DASHBOARDS

DASHBOARD_DIR = "grafana/dashboards"
RULES_DIR = "prometheus/rules"
# Folders whose every file the generator must produce (besides a README.md).
FOLDERS = (DASHBOARD_DIR, RULES_DIR)


def outputs() -> dict[str, str]:
    """Repository path -> exact file content."""
    out: dict[str, str] = {}
    for fname, build in sorted(DASHBOARDS.items()):
        out[f"{DASHBOARD_DIR}/{fname}"] = (
            json.dumps(build().to_json(), indent=2, sort_keys=True) + "\n"
        )
    out[f"{RULES_DIR}/gemma4-mtp-recording.yml"] = rules.render(rules.recording_groups())
    out[f"{RULES_DIR}/gemma4-mtp-alerts.yml"] = rules.render(rules.alert_groups())
    out["prometheus/prometheus.yml"] = scrape.render()
    return out


def problems() -> list[str]:
    """Recorded series that dashboards or alerts use but no recording rule defines."""
    undefined = metric_check.undefined_recorded()
    return [f"recorded series used but not defined: {sorted(undefined)}"] if undefined else []
