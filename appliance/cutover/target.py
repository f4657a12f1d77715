"""What one cutover moves, in two shapes: a single-node instance (one unit) and the nodes of a
multi-node group this host runs (head and worker units, :mod:`.group`); :func:`target` picks
the shape the host layer says a name has.

The state machine (:mod:`.flow`: lock, signals, history, saved env file and rollback slot,
preflight, gates, canary, the way back, recovery after a kill, state metrics) is written once
against :class:`Target`; each shape says only which units it restarts, in what order, and what
its gates check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import EngineError
from ..fsutil import write_atomic
from ..host import envfile
from ..host.layout import Node, Shape
from ..host.systemd import SystemdError
from ..profiles import Profile
from ..units.instance import Instance
from . import gates
from .context import Context
from .history import Gate
from .preflight import ImageInfo, check_unit_overrides, inspect_image, running_image_id


@dataclass(frozen=True)
class Snapshot:
    """A target's env file as read at one moment (one file on this host, whatever the shape)."""

    env: envfile.EnvFile

    @property
    def image(self) -> str | None:
        """The image the env file names (None when it names none)."""
        return self.env.get(envfile.IMAGE_KEY)

    def with_image(self, image: str) -> bytes:
        """The file's bytes with ``VLLM_IMAGE=image``, every other line unchanged."""
        return self.env.with_value(envfile.IMAGE_KEY, image)

    def raw(self) -> bytes:
        return self.env.raw


class Target(Protocol):
    """One thing a cutover moves: a single-node instance or the nodes of a multi-node group this
    host runs. ``name`` keys its lock, history, rollback slot, saved env file and canary records
    under the state directory."""

    name: str
    profile: Profile
    base_url: str
    served_model: str
    env_path: Path  # the env file it reads
    noun: str  # "instance", "group": how messages name it
    node: Node | None  # a group's nodes this host runs; None for a single-node instance
    remote_ranks: tuple[int, ...]  # a group's worker ranks that run on other hosts

    @property
    def answers(self) -> bool:
        """It serves the API on this host (the canary and the model gates can ask it)."""
        ...

    @property
    def own_way_back(self) -> bool:
        """A failed move can be gated back on this host alone."""
        ...

    def check_way_back(self, rollback: bool) -> None:
        """Refuse a move with a way back it cannot gate (a UsageError naming what to do)."""
        ...

    def check_peers(self) -> None:
        """Refuse a move that nodes on other hosts would not survive (a UsageError naming what
        to do)."""
        ...

    def api_key(self) -> str | None: ...

    def read(self) -> Snapshot:
        """The env file now (read again under the lock)."""
        ...

    def write(self, content: bytes) -> None:
        """Write the env file's bytes."""
        ...

    def save(self, path: Path, snap: Snapshot) -> None:
        """Keep ``snap`` for the recovery of a killed cutover (private, atomic)."""
        ...

    def saved(self, path: Path) -> bytes | None:
        """What :meth:`save` kept (None when nothing was, or it cannot be read)."""
        ...

    def inspect(self, ctx: Context, ref: str) -> ImageInfo:
        """``ref`` as this host holds it."""
        ...

    def check_overrides(self, ctx: Context, *, allow: bool) -> None: ...

    def move(
        self, ctx: Context, image: ImageInfo, api_key: str | None, timeout: float, restart: bool
    ) -> list[Gate]:
        """Restart (unless ``restart`` is False: gate what runs) and run the gates for ``image``;
        raises ``gates.GateFailed``."""
        ...

    def runs(self, ctx: Context, image: ImageInfo) -> bool:
        """Every unit active with its container on ``image`` (recovery may skip the restart)."""
        ...

    def journal(self, ctx: Context, lines: int) -> str: ...

    def command(self, verb: str, *args: str) -> str:
        """The CLI line an operator types for ``verb`` (cutover, rollback) on this target."""
        ...


def command(root: Path, verb: str, name: str, *args: str) -> str:
    """The CLI line an operator types for ``verb`` on ``name`` under ``root`` (the same for
    both shapes)."""
    where = "" if root == Path("/") else f" --root {shlex.quote(str(root))}"
    return " ".join(["appliance", verb, name, *args]) + where


class EnvFileTarget:
    """What both shapes share: the installed record (``inst``, read through), one env file on
    this host, read, written, saved and put back byte for byte, and the operator's command line
    for a verb."""

    inst: Instance
    root: Path  # the host's root the env file is under (``/`` on a real host)
    own_way_back = True

    @property
    def name(self) -> str:
        return self.inst.name

    @property
    def env_path(self) -> Path:
        return self.inst.env_path

    @property
    def profile(self) -> Profile:
        return self.inst.profile

    @property
    def base_url(self) -> str:
        return self.inst.base_url

    @property
    def served_model(self) -> str:
        return self.inst.served_model

    @property
    def node(self) -> Node | None:
        return self.inst.node

    @property
    def shape(self) -> Shape:
        return self.inst.shape

    @property
    def answers(self) -> bool:
        return self.inst.answers

    def api_key(self) -> str | None:
        return self.inst.api_key()

    @property
    def env_files(self) -> str:
        return str(self.env_path)

    def check_way_back(self, rollback: bool) -> None:
        return None

    def check_peers(self) -> None:
        return None

    def read(self) -> Snapshot:
        return Snapshot(envfile.read(self.env_path))

    def write(self, content: bytes) -> None:
        write_atomic(self.env_path, content)

    def save(self, path: Path, snap: Snapshot) -> None:
        # The env file's own bytes: what an older appliance left is read the same way.
        write_atomic(path, snap.raw(), mode=0o600)

    def saved(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def command(self, verb: str, *args: str) -> str:
        return command(self.root, verb, self.name, *args)


@dataclass(frozen=True)
class InstanceTarget(EnvFileTarget):
    """A single-node instance: ``gemma4-vllm@NAME`` and its env file on this host."""

    inst: Instance
    root: Path = Path("/")
    noun = "instance"
    remote_ranks: tuple[int, ...] = ()

    @property
    def unit(self) -> str:
        return self.inst.unit

    def inspect(self, ctx: Context, ref: str) -> ImageInfo:
        return inspect_image(ctx, ref)

    def check_overrides(self, ctx: Context, *, allow: bool) -> None:
        check_unit_overrides(ctx, self.inst, allow=allow)

    def move(
        self, ctx: Context, image: ImageInfo, api_key: str | None, timeout: float, restart: bool
    ) -> list[Gate]:
        return restart_and_wait(
            ctx, self.unit, expect(self.inst, image, api_key), timeout, restart=restart
        )

    def runs(self, ctx: Context, image: ImageInfo) -> bool:
        if ctx.systemd.state(self.unit).active != "active":
            return False
        with contextlib.suppress(EngineError):
            return running_image_id(ctx, self.inst.container) == image.id
        return False

    def journal(self, ctx: Context, lines: int) -> str:
        return f"last journal lines of {self.unit}:\n{ctx.systemd.journal(self.unit, lines)}"


def expect(inst: Instance, image: ImageInfo, api_key: str | None) -> gates.Expect:
    """What the instance's unit must show once it runs ``image``."""
    return gates.Expect(
        unit=inst.unit,
        base_url=inst.base_url,
        served_model=inst.served_model,
        vllm_version=image.vllm_version,
        mtp=inst.profile.mtp and image.mtp,
        api_key=api_key,
        container=inst.container,
        image=image.ref,
        image_id=image.id,
    )


def restart_and_wait(
    ctx: Context, unit: str, expect: gates.Expect, timeout: float, *, restart: bool = True
) -> list[Gate]:
    """Restart ``unit`` (a job still pending on it settled first, within ``timeout``) and gate
    it; ``restart=False`` gates the engine already running (any start counts)."""
    if restart:
        ctx.progress(f"restarting {unit}")
        try:
            ctx.systemd.settle(unit, timeout)
            previous = ctx.systemd.invocation_id(unit)
            ctx.systemd.restart(unit)
        except SystemdError as exc:
            raise gates.GateFailed(
                "restart", str(exc), [Gate("restart", False, 0.0, str(exc))]
            ) from exc
        expect = dataclasses.replace(expect, previous_invocation=previous)
    return gates.wait(
        ctx.systemd,
        expect,
        timeout=timeout,
        progress=ctx.progress,
        running_image=lambda c: running_image_id(ctx, c),
    )
