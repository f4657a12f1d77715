"""Write (or, with ``check``, verify) the generated observability files.

The JSON in ``grafana/dashboards/`` and the YAML in ``prometheus/`` are produced here from
:mod:`.dashboards`, :mod:`.rules` and :mod:`.scrape`; ``--check`` fails on stale files, on
generated-looking files this code does not produce, and on recorded series nobody defines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError
from ..fsutil import write_atomic
from . import metric_check, rules, scrape
from .dashboards import DASHBOARDS

DASHBOARD_DIR = Path("grafana/dashboards")
RULES_DIR = Path("prometheus/rules")
FIX = "run: appliance observability generate"


class StaleError(ApplianceError):
    """Generated files differ from what the code produces."""


@dataclass(frozen=True)
class Result:
    written: list[Path]
    problems: list[str]


def outputs() -> dict[Path, str]:
    """Relative path -> exact file content, deterministic."""
    out: dict[Path, str] = {}
    for fname, build in sorted(DASHBOARDS.items()):
        out[DASHBOARD_DIR / fname] = json.dumps(build().to_json(), indent=2, sort_keys=True) + "\n"
    out[RULES_DIR / "gemma4-mtp-recording.yml"] = rules.render(rules.recording_groups())
    out[RULES_DIR / "gemma4-mtp-alerts.yml"] = rules.render(rules.alert_groups())
    out[Path("prometheus/prometheus.yml")] = scrape.render()
    return out


def generate(root: Path, *, check: bool = False) -> Result:
    """Write every output under ``root``; with ``check``, write nothing and list problems."""
    root = Path(root)
    files = outputs()
    problems: list[str] = []
    undefined = metric_check.undefined_recorded()
    if undefined:
        problems.append(f"recorded series used but not defined: {sorted(undefined)}")
    written: list[Path] = []
    for rel, text in files.items():
        path = root / rel
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if check:
            problems.append(f"{rel} is {'missing' if current is None else 'out of date'}")
        else:
            write_atomic(path, text, mode=0o644)
            written.append(rel)
    # Files in the generated folders that this code does not produce (renamed or hand-made).
    for folder, pattern in ((DASHBOARD_DIR, "*.json"), (RULES_DIR, "*.yml")):
        for extra in sorted((root / folder).glob(pattern)):
            if extra.relative_to(root) not in files:
                problems.append(f"{extra.relative_to(root)} is not produced by the generator")
    return Result(written, problems)


def check_or_raise(root: Path) -> None:
    """Raise :class:`StaleError` naming every problem, with the fix."""
    res = generate(root, check=True)
    if res.problems:
        raise StaleError("; ".join(res.problems), fix=FIX)
