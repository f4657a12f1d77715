"""A multi-node group as a cutover target: the nodes of the group this host runs move to one
image together, or none does.

The state machine is the instance's (:mod:`.flow`: the lock, signals, history, the saved env
file and rollback slot, preflight, the output canary, the way back, recovery after a kill, state
metrics); :class:`GroupTarget` says what differs for a group:

- the units: the head's and/or the worker's, as this host runs them (:class:`Shape`); no drop-in
  or other env file may set the image of either;
- move: the worker first, then the head (where the worker shares the head's host its restart
  takes the head with it: BindsTo=/PartOf=); gates ON THE HEAD (unit active on a new start, its
  container on the new image, /health, model and version, one generation, MTP counters moving),
  then the worker unit active on a new start with its container on the image;
- a host that runs only a worker serves no API: its gate is the worker's, and no canary runs.

A group whose nodes run on several hosts is moved by the fleet's play
(``deploy/ansible/playbooks/multinode-cutover.yml``), one host at a time through this same
target: the head stopped, each worker host, then the head (gated on generation, which needs every
worker); a worker started while a head runs would join that head's finished rendezvous.
The head's own way back cannot be gated before those workers are back, so the head moves only
without one (``--no-rollback``) and the play's rescue moves every node back, workers first
(gotchas/multinode-cross-host-cutover.md).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngineError, UsageError
from ..host import reach
from ..host.names import Role
from ..host.systemd import SystemdError
from ..serve import argsfile, health
from ..units.instance import Instance
from . import gates
from .context import Context
from .history import Gate
from .preflight import ImageInfo, check_overrides, env_overrides, inspect_image, running_image_id
from .target import EnvFileTarget


@dataclass(frozen=True)
class GroupTarget(EnvFileTarget):
    """The nodes of group ``name`` this host runs (``node``), as :mod:`.flow` moves them (a
    :class:`~.target.Target`). ``remote_ranks``: the worker ranks of a head's group that run on
    other hosts (moved by the fleet's play, not by this target)."""

    inst: Instance
    root: Path
    remote_ranks: tuple[int, ...] = ()
    noun = "group"

    def unit(self, role: Role) -> str:
        return self.shape.role_unit(role)

    def container(self, role: Role) -> str:
        return self.shape.role_container(role)

    def check_way_back(self, rollback: bool) -> None:
        """A head whose workers run elsewhere moves only without its own way back: that way
        back is gated on generation, which needs those workers back first."""
        if self.remote_ranks and rollback:
            ranks = ", ".join(str(r) for r in self.remote_ranks)
            raise UsageError(
                f"group {self.name}: the worker(s) of rank {ranks} run on other hosts, which "
                "this host does not move; the head's way back would be gated before they are back",
                fix="move the group with deploy/ansible/playbooks/multinode-cutover.yml (workers "
                "first, gates on the head, every node back on failure), or pass --no-rollback "
                "and move the workers yourself",
            )

    def check_peers(self) -> None:
        """A host that runs only a worker moves it while its head is down: a worker started
        beside a running head joins that head's finished rendezvous, and hangs there once the
        head restarts (gotchas/multinode-cross-host-cutover.md). The fleet's play stops the
        head first; a move by hand is refused while the head's rendezvous port answers."""
        if "head" in self.node.roles or not reach.ports(self.root):
            return
        head = argsfile.read(self.inst.args_path).rendezvous()
        if head is None or health.refused(*head) is not None:
            return
        raise UsageError(
            f"group {self.name}: its head's rendezvous at {head[0]}:{head[1]} answers, and a "
            "worker started beside a running head joins that head's finished rendezvous",
            fix="move the group with deploy/ansible/playbooks/multinode-cutover.yml (it stops "
            "the head first), or stop the head's unit on its host first",
        )

    @property
    def own_way_back(self) -> bool:
        return not self.remote_ranks

    def inspect(self, ctx: Context, ref: str) -> ImageInfo:
        return inspect_image(ctx, ref)

    def check_overrides(self, ctx: Context, *, allow: bool) -> None:
        own = "/" + str(self.env_path.relative_to(ctx.layout.root))
        checks = {
            self.unit(role): functools.partial(
                env_overrides, ctx.systemd, ctx.layout.root, self.unit(role), own
            )
            for role in self.node.roles
        }
        check_overrides(ctx, checks, self.env_path.name, allow)

    def move(
        self, ctx: Context, image: ImageInfo, api_key: str | None, timeout: float, restart: bool
    ) -> list[Gate]:
        """Restart the nodes (unless ``restart`` is False: any start counts) and run the gates
        on the head, then check the worker."""
        t0 = time.monotonic()
        before = _restart(ctx, self, timeout) if restart else {}
        passed = []
        if "head" in self.node.roles:
            passed = _head_gates(ctx, self, image, api_key, timeout, before.get("head", ""))
        if "worker" in self.node.roles:
            passed.append(_worker_gate(ctx, self, image, before.get("worker", ""), t0, timeout))
            if not passed[-1].ok:
                raise gates.GateFailed(passed[-1].name, passed[-1].detail, passed)
        return passed

    def runs(self, ctx: Context, image: ImageInfo) -> bool:
        for role in self.node.roles:
            if ctx.systemd.state(self.unit(role)).active != "active":
                return False
            try:
                if running_image_id(ctx, self.container(role)) != image.id:
                    return False
            except EngineError:
                return False
        return True

    def journal(self, ctx: Context, lines: int) -> str:
        role = "head" if self.answers else "worker"
        unit = self.unit(role)
        return f"last journal lines of the {role}:\n{ctx.systemd.journal(unit, lines)}"


def group_target(ctx: Context, inst: Instance) -> GroupTarget:
    """The group ``inst`` records, as this host runs it: its profile, the head's URL and key,
    and (on the head's host) the worker ranks other hosts run."""
    node = inst.node  # read for a group with its multi-node profile (units.instance.read)
    ranks = {node.rank} if "worker" in node.roles else set()
    nodes = inst.profile.multinode.nodes
    remote = tuple(r for r in range(1, nodes) if r not in ranks) if inst.answers else ()
    return GroupTarget(inst, ctx.layout.root, remote)


def _restart(ctx: Context, tgt: GroupTarget, timeout: float) -> dict[str, str]:
    """Restart the nodes in order (a job still pending on a unit settled first, within
    ``timeout``); returns each role's InvocationID before it."""
    before = {}
    try:
        for role in tgt.node.roles:
            unit = tgt.unit(role)
            ctx.systemd.settle(unit, timeout)
            before[role] = ctx.systemd.invocation_id(unit)
            # Every unit the restart reaches, not only the one restarted: a head restarted
            # through its worker (PartOf=) would count this start against its start limit,
            # and a cutover and its rollback would leave it one worker death from `failed`.
            ctx.systemd.reset_failed(unit)
        # Where the worker shares the head's host, its restart reaches the head (PartOf=).
        role = "worker" if "worker" in tgt.node.roles else "head"
        ctx.progress(f"restarting {tgt.unit(role)}")
        ctx.systemd.restart(tgt.unit(role))
    except SystemdError as exc:
        gate = Gate("restart", False, 0.0, str(exc))
        raise gates.GateFailed("restart", str(exc), [gate]) from exc
    return before


def _head_gates(
    ctx: Context,
    tgt: GroupTarget,
    image: ImageInfo,
    api_key: str | None,
    timeout: float,
    previous: str,
) -> list[Gate]:
    """The instance's gates, on the head (generation among them: it needs every worker)."""
    expect = gates.Expect(
        unit=tgt.unit("head"),
        base_url=tgt.base_url,
        served_model=tgt.served_model,
        vllm_version=image.vllm_version,
        mtp=tgt.profile.mtp and image.mtp,
        api_key=api_key,
        previous_invocation=previous,
        container=tgt.container("head"),
        image=image.ref,
        image_id=image.id,
    )
    return gates.wait(
        ctx.systemd,
        expect,
        timeout=timeout,
        progress=ctx.progress,
        running_image=lambda c: running_image_id(ctx, c),
    )


def _worker_gate(
    ctx: Context, tgt: GroupTarget, image: ImageInfo, previous: str, t0: float, timeout: float
) -> Gate:
    """The worker unit active on a new start, its container running ``image`` (or, its head
    down, its serve program waiting for the head with ``image`` checked); waited for
    until ``timeout`` (a worker host's own target checks right after the restart, when its
    container may not run yet), failed at once by a unit that failed."""
    unit = tgt.unit("worker")
    container = tgt.container("worker")
    name = f"worker rank {tgt.node.rank}"
    while True:
        st = ctx.systemd.state(unit)
        got = running_image_id(ctx, container)
        secs = round(time.monotonic() - t0, 2)
        if st.active != "active" or not st.invocation or st.invocation == previous:
            why = f"{unit} is {st.active} ({st.sub}), not a new start"
        elif not got and health.image_waiting_for_head(st.status) == image.ref:
            # Its head is down (a way back moves the workers first): the worker checked the
            # image and waits to join; the head's gates, a generation, judge the group.
            detail = f"{unit} active on a new start, {st.status}"
            ctx.progress(f"{name}: ok ({detail})")
            return Gate(name, True, secs, detail)
        elif got != image.id:
            why = f"its container runs {got or 'nothing'}, not {image.ref}"
        else:
            detail = f"{unit} active on a new start, container on {image.ref}"
            ctx.progress(f"{name}: ok ({detail})")
            return Gate(name, True, secs, detail)
        if st.active == "failed" or secs >= timeout:
            return Gate(name, False, secs, why)
        time.sleep(gates.POLL)
