"""Doctor's records: one :class:`Check` per question, gathered in a :class:`DoctorReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """One doctor check and the evidence behind its verdict."""

    name: str
    status: Status
    summary: str
    evidence: dict = field(default_factory=dict)


@dataclass
class DoctorReport:
    """Every check run against one server (and instance)."""

    url: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed): the exit status is 0 exactly then."""
        return all(c.status != "fail" for c in self.checks)

    def get(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict:
        return {"url": self.url, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}

    def text(self, evidence: bool = False) -> str:
        """One line per check; a warning's or failure's evidence in brackets, a passed check's
        only with ``evidence`` (``appliance -v``: the mtp.counters line alone is 400 characters,
        and the whole of it is in ``--json``)."""
        lines = []
        for c in self.checks:
            shown = c.evidence if evidence or c.status != "ok" else {}
            ev = ", ".join(f"{k}={v}" for k, v in shown.items() if v not in (None, "", {}))
            lines.append(
                f"{c.status.upper():<4} {c.name}: {c.summary}" + (f" [{ev}]" if ev else "")
            )
        lines.append("doctor: " + ("no failures" if self.ok else "FAILED"))
        return "\n".join(lines)
