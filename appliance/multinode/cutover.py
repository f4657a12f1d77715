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

Each host is a :class:`Host`: its root (``/`` on a real host), the systemd it runs (a prefix
such as ``ssh HOST`` reaches another host's systemctl, see ``appliance.host.systemd``) and
its Docker client. The history, lock, rollback slot and saved files live on the head's host.
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

from .. import apikey, profiles
from .. import canary as canaries
from ..cutover import flow, gates, recovery
from ..cutover.context import Context, PreflightError
from ..cutover.history import Entry, Gate
from ..cutover.preflight import ImageInfo, check_overrides, env_overrides, inspect_image
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
    """A group, as :mod:`appliance.cutover.flow` moves it (a ``cutover.target.Target``)."""

    name: str
    head: Host
    workers: list[Host]  # hosts running a worker and no head
    hosts: list[Host]
    profile: profiles.Profile
    base_url: str
    key_path: Path
    noun = "group"

    @property
    def served_model(self) -> str:
        return self.profile.served_model_name

    @property
    def env_files(self) -> str:
        return f"the env files of {self.name}"

    def api_key(self) -> str | None:
        return apikey.read(self.key_path)

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
        unit = unit_name(self.name, "head")
        return f"last journal lines of the head:\n{self.head.systemd.journal(unit, lines)}"

    def command(self, verb: str, *args: str, root: Path = Path("/")) -> str:
        root_opt = "" if root == Path("/") else f" --root {root}"
        return " ".join(["appliance", "multinode", verb, self.name, *args]) + root_opt


def target(group: str, hosts: Sequence[Host]) -> GroupTarget:
    """The group ``group`` as the cutover reaches it through ``hosts`` (one runs the head; the
    workers' ranks cover the profile's nodes)."""
    check_group(group)
    heads = [h for h in hosts if "head" in h.node.roles]
    if len(heads) != 1:
        raise UsageError(f"group {group}: {len(heads)} hosts run the head", fix="exactly one")
    head = heads[0]
    env = envfile.read(head.env_file(group))
    prof = require_multinode(profiles.get(env.get("APPLIANCE_PROFILE") or ""))
    ranks = sorted(h.node.rank for h in hosts if "worker" in h.node.roles)
    assert prof.multinode is not None
    if ranks != list(range(1, prof.multinode.nodes)):
        raise UsageError(
            f"group {group}: worker ranks {ranks}, profile {prof.name} has "
            f"{prof.multinode.nodes} nodes",
            fix=f"name every worker host once, ranks 1..{prof.multinode.nodes - 1}",
        )
    url = base_url(env.get("VLLM_HOST") or "127.0.0.1", env.get("VLLM_PORT"))
    workers = [h for h in hosts if "head" not in h.node.roles]
    key = Path(head.root) / api_key_path(group, "head")
    return GroupTarget(group, head, workers, list(hosts), prof, url, key)


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
                f"{plan.head.name}: the nodes would run different engines",
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
        for h in [*plan.workers, plan.head]:
            path = h.env_file(plan.name)
            before = path.read_bytes()
            write_atomic(path, content[h.name])
            done.append((h, before))
    except OSError:
        for h, before in reversed(done):
            with contextlib.suppress(OSError):
                write_atomic(h.env_file(plan.name), before)
        raise


def _restart(ctx: Context, plan: GroupTarget) -> dict[str, str]:
    """Restart the group in order; returns the InvocationID of every unit before it."""
    g = plan.name
    before = {}
    for h in plan.hosts:
        for role in h.node.roles:
            before[f"{h.name}/{role}"] = h.systemd.invocation_id(unit_name(g, role))
            # Every unit the restart reaches, not only the one restarted: a head restarted
            # through its worker (PartOf=) would count this start against its start limit, and
            # a cutover and its rollback would leave it one worker death from `failed`.
            h.systemd.reset_failed(unit_name(g, role))
    try:
        for h in plan.workers:
            ctx.progress(f"restarting {unit_name(g, 'worker')} on {h.name}")
            h.systemd.restart(unit_name(g, "worker"))
        head = plan.head
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
    before = _restart(ctx, plan) if restart else {}
    head = plan.head
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
    passed = gates.wait(
        head.systemd,
        expect,
        timeout=timeout,
        progress=ctx.progress,
        running_image=_running_image(client),
    )
    for h in plan.hosts:
        if "worker" not in h.node.roles:
            continue
        previous = before.get(f"{h.name}/worker", "")
        passed.append(_worker_gate(ctx, plan, h, image, previous, t0))
        if not passed[-1].ok:
            raise gates.GateFailed(passed[-1].name, passed[-1].detail, passed)
    return passed


def _worker_gate(
    ctx: Context, plan: GroupTarget, h: Host, image: ImageInfo, previous: str, t0: float
) -> Gate:
    unit = unit_name(plan.name, "worker")
    st = h.systemd.state(unit)
    got = _running_image(h.docker_client or ctx.docker())(container_name(plan.name, "worker"))
    name = f"worker {h.name}"
    secs = round(time.monotonic() - t0, 2)
    if st.active != "active" or not st.invocation or st.invocation == previous:
        return Gate(name, False, secs, f"{unit} is {st.active} ({st.sub}), not a new start")
    if got != image.id:
        return Gate(name, False, secs, f"its container runs {got or 'nothing'}, not {image.ref}")
    detail = f"{unit} active on a new start, container on {image.ref}"
    ctx.progress(f"{name}: ok ({detail})")
    return Gate(name, True, secs, detail)


def cutover(
    ctx: Context,
    group: str,
    image: str,
    hosts: Sequence[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    allow_no_mtp: bool = False,
    canary: bool | None = None,
    canary_files: tuple[Path, ...] = (),
    canary_timeout: float = canaries.DEFAULT_TIMEOUT,
    allow_unit_overrides: bool = False,
) -> Entry:
    """Move every node of ``group`` to ``image`` through the gates on the head (and the output
    canary when on); on failure, every node back to the image they ran. ``ctx.layout`` is the
    head's root (history, lock, rollback slot, saved files). Raises PreflightError (nothing
    touched), CutoverFailed (rolled back) or RollbackFailed (the way back failed too)."""
    return flow.cutover(
        ctx,
        target(group, hosts),
        image,
        timeout=timeout,
        allow_no_mtp=allow_no_mtp,
        canary=canary,
        canary_files=canary_files,
        canary_timeout=canary_timeout,
        allow_unit_overrides=allow_unit_overrides,
    )


def rollback(
    ctx: Context, group: str, hosts: Sequence[Host], *, timeout: float = DEFAULT_TIMEOUT
) -> Entry:
    """Every node of ``group`` back to the image in the group's rollback slot, same gates; after
    a killed cutover, back to where it started (the saved env files), closing its entry."""
    return recovery.rollback(ctx, target(group, hosts), timeout=timeout)
