"""The host check's records: one :class:`Finding` per question, gathered in a :class:`Report`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from ..host import reach

Status = Literal["ok", "warn", "blocker"]


@dataclass(frozen=True)
class Finding:
    """One answer about the host: ``blocker`` means the instance cannot run here as it is;
    ``fix`` is the one command or step that clears it (empty when ``ok``)."""

    name: str
    status: Status
    message: str
    fix: str = ""

    def line(self) -> str:
        fix = f" (fix: {self.fix})" if self.fix and self.status != "ok" else ""
        return f"{self.status.upper():<7} {self.name}: {self.message}{fix}"


@dataclass(frozen=True)
class Report:
    """Every finding for one host and profile (and instance, when named)."""

    profile: str | None  # None: no profile to judge (the host alone)
    instance: str | None
    findings: tuple[Finding, ...]

    @property
    def blockers(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "blocker"]

    @property
    def ok(self) -> bool:
        """True when nothing blocks (warnings allowed): the exit status is 0 exactly then."""
        return not self.blockers

    def get(self, name: str) -> Finding | None:
        return next((f for f in self.findings if f.name == name), None)

    def to_dict(self) -> dict:
        return {
            "profile": self.profile,
            "instance": self.instance,
            "ok": self.ok,
            "findings": [asdict(f) for f in self.findings],
        }

    def text(self) -> str:
        lines = [f.line() for f in self.findings]
        warns = sum(f.status == "warn" for f in self.findings)
        unasked = sum(reach.unasked(f.message) for f in self.findings)
        if self.ok and unasked:  # a tree: what this host was not asked is not ready either
            lines.append(f"host check: no blocker, {unasked} not asked ({warns} warning(s))")
        elif self.ok:
            lines.append(f"host check: ready ({warns} warning(s))")
        else:
            lines.append(f"host check: {len(self.blockers)} blocker(s), {warns} warning(s)")
        return "\n".join(lines)
