"""A small interface over ``systemctl`` and ``journalctl`` for one unit at a time.

Commands run as ``[*prefix, "systemctl", ...]``. On a host the prefix is empty; the tests set it
to enter a systemd booted in systemd-nspawn (e.g. ``nsenter -t PID -m -p --``), and an operator
can point it at another systemd the same way, through ``APPLIANCE_SYSTEMD_PREFIX``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError, UsageError
from . import reach

PREFIX_ENV = reach.SYSTEMD_ENV


class SystemdError(ApplianceError):
    """systemctl or journalctl could not be run, or refused."""


class SystemdNotNamed(SystemdError, UsageError):
    """A tree other than ``/`` whose systemd is not named (:func:`.reach.refusal`): bad input,
    exit 2, as the same refusal for its Docker engine."""


@dataclass(frozen=True)
class UnitState:
    """What ``systemctl show`` says about a unit now."""

    active: str  # active, activating, deactivating, inactive, failed, ...
    sub: str  # running, start-post, auto-restart, dead, ...
    job: str  # the pending job's id, empty when none
    restarts: int  # NRestarts: automatic restarts after a failure
    invocation: str  # InvocationID: new for every start
    status: str = ""  # StatusText: what the main process said last (sd_notify STATUS=)


@dataclass(frozen=True)
class Systemd:
    """systemctl/journalctl, optionally run through ``prefix``."""

    prefix: tuple[str, ...] = ()
    timeout: float = 120.0
    refusal: str = ""  # set: every call raises SystemdError with it (a tree with no systemd)

    @classmethod
    def from_env(cls) -> Systemd:
        """The prefix from ``APPLIANCE_SYSTEMD_PREFIX`` (shell words), empty when unset."""
        return cls(tuple(shlex.split(os.environ.get(PREFIX_ENV, ""))))

    @classmethod
    def for_root(cls, root: Path) -> Systemd | None:
        """The systemd that runs the units of the tree under ``root``: the host's for ``/``,
        the one ``APPLIANCE_SYSTEMD_PREFIX`` enters for another root (a machine's, seen from
        the host); None for a tree with none named (a test tree, an image being built), where
        a command touches nothing outside the tree (:mod:`.reach`)."""
        return cls.from_env() if reach.systemd(root) else None

    @classmethod
    def of_tree(cls, root: Path) -> Systemd:
        """:meth:`for_root`, or one that refuses every call in one line naming what to set."""
        found = cls.for_root(root)
        return found if found is not None else cls(refusal=str(reach.refusal(root, "systemd")))

    def _run(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        if self.refusal:
            raise SystemdNotNamed(self.refusal)
        cmd = [*self.prefix, *args]
        try:
            return subprocess.run(
                cmd, check=False, capture_output=True, text=True, timeout=timeout or self.timeout
            )
        except FileNotFoundError as exc:
            raise SystemdError(f"cannot run {cmd[0]}: not found") from exc
        except subprocess.TimeoutExpired as exc:
            raise SystemdError(f"{shlex.join(args)} did not return in {exc.timeout:.0f} s") from exc

    def _check(self, *args: str, timeout: float | None = None) -> str:
        proc = self._run(*args, timeout=timeout)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise SystemdError(f"{shlex.join(args)} failed: {msg[-1] if msg else proc.returncode}")
        return proc.stdout

    def restart(self, unit: str) -> None:
        """Queue a restart of ``unit`` and return at once, clearing a failed state first.

        ``--no-block``: the unit's start waits for the engine's /health (minutes for a 31B
        load); the gates watch it instead, with progress and one deadline.
        """
        # After a crash loop the unit hits its start limit and refuses a plain restart; the
        # way back must not be blocked by the failure it is recovering from.
        self.reset_failed(unit)
        self._check("systemctl", "restart", "--no-block", unit)

    def settle(self, unit: str, timeout: float) -> None:
        """Stop ``unit`` if a job is pending on it (waiting at most ``timeout`` seconds), so that
        the next restart is one job of its own.

        A restart queued while an earlier start job runs (a killed cutover's, say) is merged
        into it and re-run as a restart: systemd stops the start just begun, and a gate that
        read the unit before would take the next start for a crash. A blocking stop cancels
        the pending job and returns once the unit is down."""
        if self.state(unit).job:
            self._check("systemctl", "stop", unit, timeout=timeout)

    def reset_failed(self, unit: str) -> None:
        """Clear ``unit``'s failed state and its start-limit count (a unit systemd does not
        know, or one not failed, is left as it is)."""
        self._run("systemctl", "reset-failed", unit)

    def stop_and_disable(self, *units: str) -> None:
        """Stop ``units`` together (one job transaction, waiting for their ExecStop) and disable
        them, and clear a failed state they end in (a group's head may exit non-zero as its
        worker goes: the unit being removed must not linger as `failed`); units systemd does not
        know are left alone."""
        known = [u for u in units if self.show(u, "LoadState").get("LoadState") != "not-found"]
        if not known:
            return
        self._check("systemctl", "disable", "--now", *known)
        for unit in known:
            self.reset_failed(unit)

    def daemon_reload(self) -> None:
        """Make systemd read the unit files again (after installing or removing one)."""
        self._check("systemctl", "daemon-reload")

    def invocation_id(self, unit: str) -> str:
        """The unit's current ``InvocationID`` (a new one for every start; empty if none)."""
        try:
            return self.show(unit, "InvocationID").get("InvocationID", "")
        except SystemdError:
            return ""

    def active_state(self, unit: str) -> str:
        """``active``, ``activating``, ``failed``, ``inactive``, ...; ``not asked`` for a tree
        whose systemd is not named, ``unknown`` when systemd cannot be asked (never raises)."""
        try:
            return self._run("systemctl", "is-active", unit).stdout.strip() or "unknown"
        except SystemdNotNamed:
            return reach.NOT_ASKED
        except SystemdError:
            return "unknown"

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """Unit properties (``systemctl show -p``) as strings."""
        out = self._check("systemctl", "show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def show_all(self, unit: str, prop: str) -> list[str]:
        """Every value systemd prints for ``prop`` (list properties such as ``EnvironmentFiles``
        come one line per item)."""
        out = self._check("systemctl", "show", unit, f"--property={prop}")
        head = f"{prop}="
        return [line[len(head) :] for line in out.splitlines() if line.startswith(head)]

    def state(self, unit: str) -> UnitState:
        """Active state, pending job, restart count and invocation of ``unit``, in one call."""
        try:
            p = self.show(
                unit, "ActiveState", "SubState", "Job", "NRestarts", "InvocationID", "StatusText"
            )
        except SystemdError:
            return UnitState("unknown", "", "", 0, "")
        try:
            restarts = int(p.get("NRestarts") or 0)
        except ValueError:
            restarts = 0
        return UnitState(
            p.get("ActiveState", "unknown"),
            p.get("SubState", ""),
            p.get("Job", ""),
            restarts,
            p.get("InvocationID", ""),
            p.get("StatusText", ""),
        )

    def restarts(self, unit: str) -> int:
        """How many times systemd has restarted ``unit`` after a failure (``NRestarts``)."""
        try:
            return int(self.show(unit, "NRestarts").get("NRestarts", "0") or 0)
        except (ValueError, SystemdError):
            return 0

    def journal(self, unit: str, lines: int = 20) -> str:
        """The unit's last ``lines`` journal lines (empty when the journal has none)."""
        proc = self._run("journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat")
        return proc.stdout.rstrip()
