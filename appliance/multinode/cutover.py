"""A multi-node group as a cutover target: every node moves to the same image or none does.

The state machine is the instance's (:func:`appliance.cutover.flow.cutover`: the lock, signals,
history, saved env files and rollback slot, preflight, the output canary, the way back, recovery
after a kill, state metrics); :class:`GroupTarget` says what differs for a group:

- preflight: every host's env file names the same image (a split group is refused), the image
  is on every host with the SAME image ID, and no drop-in or other env file sets the image of a
  head or worker unit;
- write: VLLM_IMAGE on every host, workers first (a failed write puts back the ones written);
  the saved copy (for recovery) holds every host's bytes;
- move: restart worker hosts first, then the head's host (where the worker shares the head's
  host its restart takes the head with it: BindsTo=/PartOf=); gates ON THE HEAD (unit active on
  a new start, its container on the new image, /health, model and version, one generation, MTP
  counters moving), then every worker unit active on a new start with its container on the
  image.

Each host is a :class:`Host`: its root (``/`` on a real host), the systemd it runs and its
Docker client. The history, lock, rollback slot and saved files live on the head's host.

A group whose workers run on other hosts is moved by the fleet's play
(``deploy/ansible/playbooks/multinode-cutover.yml``), one host at a time through this same state
machine: each worker host first (its own target: its worker units, gated on a new start on the
image; no API, so no canary), then the head (gated on generation, which needs every worker).
The head's own way back cannot be gated before those workers are back, so the head's step runs
with ``rollback=False`` and the play's rescue moves every node back, workers first
(gotchas/multinode-cross-host-cutover.md).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import apikey, imageref, profiles
from .. import canary as canaries
from ..cutover import flow, gates, recovery
from ..cutover.context import Context, PreflightError
from ..cutover.history import Entry, Gate
from ..cutover.preflight import (
    ImageInfo,
    check_compatible,
    check_overrides,
    env_overrides,
    inspect_image,
)
from ..cutover.target import Snapshot
from ..errors import UsageError
from ..fsutil import write_atomic
from ..host import envfile
from ..host.systemd import Systemd, SystemdError
from ..host.values import base_url
from . import (
    Node,
    api_key_path,
    check_group,
    container_name,
    env_path,
    require_multinode,
    require_one_image,
    unit_name,
)

DEFAULT_TIMEOUT = 900.0


@dataclass
class Host:
    """One host of the group, as the cutover reaches it."""

    name: str
    node: Node
    root: Path = Path("/")
    systemd: Systemd = field(default_factory=Systemd.from_env)
    docker_client: object | None = None  # None: the head context's client

    def env_file(self, group: str) -> Path:
        return Path(self.root) / env_path(group)


@dataclass
class GroupTarget:
    """A group, as :mod:`appliance.cutover.flow` moves it (a ``cutover.target.Target``): the
    nodes ``hosts`` run. ``head`` is None on a host that runs only workers; ``remote_ranks``
    are the worker ranks that run elsewhere (moved by the fleet's play, not by this target)."""

    name: str
    head: Host | None
    workers: list[Host]  # hosts running a worker and no head
    hosts: list[Host]
    profile: profiles.Profile
    base_url: str
    key_path: Path | None
    remote_ranks: tuple[int, ...] = ()
    noun = "group"

    @property
    def served_model(self) -> str:
        return self.profile.served_model_name

    @property
    def env_files(self) -> str:
        return f"the env files of {self.name}"

    def api_key(self) -> str | None:
        return apikey.read(self.key_path) if self.key_path else None

    def read(self) -> Snapshot:
        files = {h.name: envfile.read(h.env_file(self.name)) for h in self.hosts}
        require_one_image({n: e.get(envfile.IMAGE_KEY) for n, e in files.items()})
        return Snapshot(files)

    def write(self, content: Mapping[str, bytes]) -> None:
        _write_all(self, content)

    def save(self, path: Path, snap: Snapshot) -> None:
        body = {n: base64.b64encode(e.raw).decode() for n, e in snap.files.items()}
        write_atomic(path, json.dumps({"hosts": body}) + "\n", mode=0o600)

    def saved(self, path: Path) -> dict[str, bytes] | None:
        try:
            body = json.loads(path.read_text())["hosts"]
            return {n: base64.b64decode(v) for n, v in body.items()}
        except (OSError, ValueError, KeyError, TypeError, binascii.Error):
            return None

    def inspect(self, ctx: Context, ref: str) -> ImageInfo:
        return _inspect_everywhere(ctx, self, ref)

    def check_overrides(self, ctx: Context, *, allow: bool) -> None:
        own = "/" + env_path(self.name)
        checks = {}
        for h in self.hosts:
            for role in h.node.roles:
                unit = unit_name(self.name, role)
                checks[f"{unit} on {h.name}"] = functools.partial(
                    env_overrides, h.systemd, Path(h.root), unit, own
                )
        check_overrides(ctx, checks, f"{self.name}.env", allow)

    def move(
        self, ctx: Context, image: ImageInfo, api_key: str | None, timeout: float, restart: bool
    ) -> list[Gate]:
        return _gates(ctx, self, image, api_key, timeout, restart)

    def runs(self, ctx: Context, image: ImageInfo) -> bool:
        for h in self.hosts:
            client = h.docker_client or ctx.docker()
            for role in h.node.roles:
                if h.systemd.state(unit_name(self.name, role)).active != "active":
                    return False
                if _running_image(client)(container_name(self.name, role)) != image.id:
                    return False
        return True

    def journal(self, ctx: Context, lines: int) -> str:
        host = self.head or self.hosts[0]
        role = "head" if self.head else "worker"
        unit = unit_name(self.name, role)
        return f"last journal lines of the {role}:\n{host.systemd.journal(unit, lines)}"

    def command(self, verb: str, *args: str, root: Path = Path("/")) -> str:
        root_opt = "" if root == Path("/") else f" --root {root}"
        return " ".join(["appliance", "multinode", verb, self.name, *args]) + root_opt


def target(group: str, hosts: Sequence[Host]) -> GroupTarget:
    """The group ``group`` as the cutover reaches it through ``hosts``: at most one runs the head,
    each worker rank at most once. Ranks no host of ``hosts`` runs are the target's
    ``remote_ranks`` (see :func:`cutover`)."""
    check_group(group)
    if not hosts:
        raise UsageError(f"group {group}: no host to move", fix="name the hosts of the group")
    heads = [h for h in hosts if "head" in h.node.roles]
    if len(heads) > 1:
        raise UsageError(f"group {group}: {len(heads)} hosts run the head", fix="exactly one")
    head = heads[0] if heads else None
    env = envfile.read((head or hosts[0]).env_file(group))
    prof = require_multinode(profiles.get(env.get("APPLIANCE_PROFILE") or ""))
    assert prof.multinode is not None
    every = list(range(1, prof.multinode.nodes))
    ranks = sorted(h.node.rank for h in hosts if "worker" in h.node.roles)
    if len(set(ranks)) != len(ranks) or not set(ranks) <= set(every):
        raise UsageError(
            f"group {group}: worker ranks {ranks}, profile {prof.name} has "
            f"{prof.multinode.nodes} nodes",
            fix=f"name every worker host once, ranks 1..{prof.multinode.nodes - 1}",
        )
    url = base_url(env.get("VLLM_HOST") or "127.0.0.1", env.get("VLLM_PORT"))
    workers = [h for h in hosts if "head" not in h.node.roles]
    key = Path(head.root) / api_key_path(group, "head") if head else None
    remote = tuple(r for r in every if r not in ranks) if head else ()
    return GroupTarget(group, head, workers, list(hosts), prof, url, key, remote)


def _require_way_back(tgt: GroupTarget, rollback: bool) -> None:
    """A head whose workers run elsewhere moves only without its own way back: that way back is
    gated on generation, which needs those workers back first (the fleet's play does both)."""
    if tgt.remote_ranks and rollback:
        ranks = ", ".join(str(r) for r in tgt.remote_ranks)
        raise UsageError(
            f"group {tgt.name}: the worker(s) of rank {ranks} run on other hosts, which this "
            "host does not move; the head's way back would be gated before they are back",
            fix="move the group with deploy/ansible/playbooks/multinode-cutover.yml (workers "
            "first, gates on the head, every node back on failure), or pass --no-rollback and "
            "move the workers yourself",
        )


def _inspect_everywhere(ctx: Context, plan: GroupTarget, ref: str) -> ImageInfo:
    """The image on the head's Docker; every other host must hold the same image ID."""
    info = inspect_image(ctx, ref)
    for h in plan.hosts:
        if h.docker_client is None or h.docker_client is ctx.docker_client:
            continue
        other = inspect_image(Context(docker_client=h.docker_client), ref)
        if other.id != info.id:
            raise PreflightError(
                f"image {ref} is {other.id[:19]} on {h.name} but {info.id[:19]} on "
                f"{(plan.head or plan.hosts[0]).name}: the nodes would run different engines",
                fix="load the same image on every host (docker save | docker load)",
            )
    return info


def _running_image(client) -> Callable[[str], str | None]:
    import docker

    def image_of(container: str) -> str | None:
        try:
            return client.containers.get(container).attrs.get("Image")
        except docker.errors.NotFound:
            return None

    return image_of


def _write_all(plan: GroupTarget, content: Mapping[str, bytes]) -> None:
    """Write each host's env file (workers first); on a failure put back those written."""
    done: list[tuple[Host, bytes]] = []
    try:
        for h in [*plan.workers, *([plan.head] if plan.head else [])]:
            path = h.env_file(plan.name)
            before = path.read_bytes()
            write_atomic(path, content[h.name])
            done.append((h, before))
    except OSError:
        for h, before in reversed(done):
            with contextlib.suppress(OSError):
                write_atomic(h.env_file(plan.name), before)
        raise


def _restart(ctx: Context, plan: GroupTarget, timeout: float) -> dict[str, str]:
    """Restart the group in order (jobs still pending on its units settled first, within
    ``timeout``); returns the InvocationID of every unit before it."""
    g = plan.name
    before = {}
    try:
        for h in plan.hosts:
            for role in h.node.roles:
                h.systemd.settle(unit_name(g, role), timeout)
                before[f"{h.name}/{role}"] = h.systemd.invocation_id(unit_name(g, role))
                # Every unit the restart reaches, not only the one restarted: a head restarted
                # through its worker (PartOf=) would count this start against its start limit,
                # and a cutover and its rollback would leave it one worker death from `failed`.
                h.systemd.reset_failed(unit_name(g, role))
        for h in plan.workers:
            ctx.progress(f"restarting {unit_name(g, 'worker')} on {h.name}")
            h.systemd.restart(unit_name(g, "worker"))
        head = plan.head
        if head is not None:
            # Where the worker shares the head's host, its restart reaches the head (PartOf=).
            role = "worker" if head.node.colocated else "head"
            ctx.progress(f"restarting {unit_name(g, role)} on {head.name}")
            head.systemd.restart(unit_name(g, role))
    except SystemdError as exc:
        gate = Gate("restart", False, 0.0, str(exc))
        raise gates.GateFailed("restart", str(exc), [gate]) from exc
    return before


def _gates(
    ctx: Context,
    plan: GroupTarget,
    image: ImageInfo,
    api_key: str | None,
    timeout: float,
    restart: bool = True,
) -> list[Gate]:
    """Restart the group (unless ``restart`` is False: any start counts) and run the gates on
    the head, then check every worker."""
    t0 = time.monotonic()
    before = _restart(ctx, plan, timeout) if restart else {}
    head = plan.head
    passed = [] if head is None else _head_gates(ctx, plan, head, image, api_key, timeout, before)
    for h in plan.hosts:
        if "worker" not in h.node.roles:
            continue
        previous = before.get(f"{h.name}/worker", "")
        passed.append(_worker_gate(ctx, plan, h, image, previous, t0, timeout))
        if not passed[-1].ok:
            raise gates.GateFailed(passed[-1].name, passed[-1].detail, passed)
    return passed


def _head_gates(
    ctx: Context,
    plan: GroupTarget,
    head: Host,
    image: ImageInfo,
    api_key: str | None,
    timeout: float,
    before: dict[str, str],
) -> list[Gate]:
    """The instance's gates, on the head (generation among them: it needs every worker)."""
    client = head.docker_client or ctx.docker()
    expect = gates.Expect(
        unit=unit_name(plan.name, "head"),
        base_url=plan.base_url,
        served_model=plan.served_model,
        vllm_version=image.vllm_version,
        mtp=plan.profile.mtp and image.mtp,
        api_key=api_key,
        previous_invocation=before.get(f"{head.name}/head", ""),
        container=container_name(plan.name, "head"),
        image=image.ref,
        image_id=image.id,
    )
    return gates.wait(
        head.systemd,
        expect,
        timeout=timeout,
        progress=ctx.progress,
        running_image=_running_image(client),
    )


def _worker_gate(
    ctx: Context,
    plan: GroupTarget,
    h: Host,
    image: ImageInfo,
    previous: str,
    t0: float,
    timeout: float,
) -> Gate:
    """The worker unit on ``h`` active on a new start, its container running ``image``; waited
    for until ``timeout`` (a worker host's own target checks right after the restart, when its
    container may not run yet), failed at once by a unit that failed."""
    unit = unit_name(plan.name, "worker")
    container = container_name(plan.name, "worker")
    image_of = _running_image(h.docker_client or ctx.docker())
    name = f"worker {h.name}"
    while True:
        st = h.systemd.state(unit)
        got = image_of(container)
        secs = round(time.monotonic() - t0, 2)
        if st.active != "active" or not st.invocation or st.invocation == previous:
            why = f"{unit} is {st.active} ({st.sub}), not a new start"
        elif got != image.id:
            why = f"its container runs {got or 'nothing'}, not {image.ref}"
        else:
            detail = f"{unit} active on a new start, container on {image.ref}"
            ctx.progress(f"{name}: ok ({detail})")
            return Gate(name, True, secs, detail)
        if st.active == "failed" or secs >= timeout:
            return Gate(name, False, secs, why)
        time.sleep(gates.POLL)


def cutover(
    ctx: Context,
    group: str,
    image: str,
    hosts: Sequence[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    rollback: bool = True,
    allow_no_mtp: bool = False,
    canary: bool | None = None,
    canary_files: tuple[Path, ...] = (),
    canary_timeout: float = canaries.DEFAULT_TIMEOUT,
    canary_before: Path | None = None,
    allow_unit_overrides: bool = False,
) -> Entry:
    """Move the nodes of ``group`` that ``hosts`` run to ``image``: gates on the head (and the
    output canary when on), on each worker a new start on the image; on failure, every node back
    to the image it ran (not with ``rollback=False``, which a head whose workers run on other
    hosts requires). A target without the head runs no canary (no API); such a head judges
    the new image against ``canary_before``, the answers recorded before its workers moved (the
    old head cannot answer once they have). ``ctx.layout`` is the
    root of the host that keeps the record (history, lock, rollback slot, saved files). Raises
    PreflightError (nothing touched), CutoverFailed (rolled back) or RollbackFailed (not rolled
    back, or the way back failed too)."""
    tgt = target(group, hosts)
    _require_way_back(tgt, rollback)
    if tgt.head is None:
        canary = False
    return flow.cutover(
        ctx,
        tgt,
        image,
        timeout=timeout,
        rollback=rollback,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_files,
        canary_timeout=canary_timeout,
        canary_before=canary_before,
        allow_unit_overrides=allow_unit_overrides,
    )


def rollback(
    ctx: Context,
    group: str,
    hosts: Sequence[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    to: str | None = None,
) -> Entry:
    """The nodes of ``group`` that ``hosts`` run back to ``to`` (default: the image in the
    group's rollback slot), same gates; after a killed cutover, back to where it started (the
    saved env files), closing its entry. A head whose workers run elsewhere is gated with them
    already back (the fleet's play moves them first) and has no way back of its own."""
    tgt = target(group, hosts)
    return recovery.rollback(ctx, tgt, timeout=timeout, to=to, way_back=not tgt.remote_ranks)


def record_canary(
    ctx: Context,
    group: str,
    hosts: Sequence[Host],
    out: Path,
    *,
    canary_files: tuple[Path, ...] = (),
    within: float = canaries.DEFAULT_TIMEOUT,
) -> canaries.Record:
    """The head's answers to the output canary set on the image the group runs, saved to
    ``out``: the before-record of a move across hosts (:func:`cutover`'s ``canary_before``),
    taken while every node still runs that image."""
    tgt = target(group, hosts)
    if tgt.head is None:
        raise UsageError(
            f"this host runs no head of group {group}: the canary asks the head's API",
            fix="run it on the head's host",
        )
    plan = canaries.plan(tgt.profile, root=ctx.layout.root, enabled=True, files=canary_files)
    return canaries.before(
        plan,
        tgt.base_url,
        tgt.served_model,
        api_key=tgt.api_key(),
        image=tgt.read().image,
        save_to=out,
        progress=ctx.progress,
        within=within,
    )


def check(
    ctx: Context,
    group: str,
    image: str,
    hosts: Sequence[Host],
    *,
    allow_no_mtp: bool = False,
    allow_unit_overrides: bool = False,
) -> dict[str, object]:
    """The cutover's preflight for the nodes ``hosts`` run, touching nothing: ``image`` valid,
    present (the same ID on every host given), compatible with the profile, no unit override;
    the env files agree on one image. Returns what the fleet's play compares across hosts (the
    image IDs, the image the nodes name now) and whether this host already runs ``image``."""
    tgt = target(group, hosts)
    imageref.validate(image)
    new = tgt.inspect(ctx, image)
    check_compatible(new, tgt.profile, allow_no_mtp=allow_no_mtp)
    tgt.check_overrides(ctx, allow=allow_unit_overrides)
    current = tgt.read().image
    return {
        "group": group,
        "roles": sorted({r for h in hosts for r in h.node.roles}),
        "ranks": sorted(h.node.rank for h in hosts if "worker" in h.node.roles),
        "remote_ranks": list(tgt.remote_ranks),
        "image": image,
        "image_id": new.id,
        "env_image": current,
        # The way back must be on this host too (the play checks it is the same image).
        "env_image_id": tgt.inspect(ctx, current).id if current else None,
        "runs_image": current == image and tgt.runs(ctx, new),
        # The head's output canary (the profile's [canary]): the play records its answers
        # before any worker moves.
        "canary": tgt.head is not None and tgt.profile.canary.enabled,
    }
