"""Write and remove an instance's files: atomically, with their modes, idempotently.

:func:`write_tree` is the one writer (``render --out`` uses it too): every file is replaced by
:func:`appliance.fsutil.write_atomic`, so a reader (systemd, a cutover) sees the old file or the
new one. Everything is rendered and validated before the first write: a bad input leaves the
tree untouched. :func:`install` keeps what the operator set (image, host, port, GPUs, paths);
:func:`uninstall` is its pair.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from ..errors import UsageError
from ..fsutil import write_atomic
from ..host import envfile
from ..host import lock as locks
from ..host.envfile import PORT_KEY, PROFILE_KEY
from ..host.layout import Layout, Node, Shape
from ..host.names import probe_timer
from ..host.systemd import Systemd
from ..observability import file_sd
from ..profiles import Profile, get, installed, is_file_ref, operators_file
from . import instance as instances
from .template import (
    MODE_ARGS,
    MODE_SECRET,
    Options,
    RenderedFile,
    env_values,
    options_from_env,
    render,
)


@dataclass
class WriteResult:
    """What a write did, by absolute path."""

    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    first_install: bool = False  # the instance had no env file: it was never enabled

    @property
    def changed(self) -> bool:
        return bool(self.written or self.removed)


def _rel(path: str) -> PurePosixPath:
    return PurePosixPath(path).relative_to("/")


def write_tree(root: Path, files: dict[str, RenderedFile]) -> WriteResult:
    """Write ``files`` under ``root`` in their order (what others refer to first); a file
    already identical in content and mode is left as it is."""
    result = WriteResult()
    for rel, rendered in files.items():
        path = Path(root) / rel
        data = rendered.content
        data = data.encode() if isinstance(data, str) else data
        try:
            same = path.read_bytes() == data and (path.stat().st_mode & 0o7777) == rendered.mode
        except FileNotFoundError:
            same = False
        if same:
            result.unchanged.append(path)
        else:
            write_atomic(path, data, mode=rendered.mode)
            result.written.append(path)
    return result


def named_profile(root: Path | str, instance: str) -> str | None:
    """The profile an installed instance's env file names (None: not installed, or none)."""
    return _existing_env(Path(root), instance).get(PROFILE_KEY) or None


def _existing_env(root: Path, instance: str) -> dict[str, str]:
    path = Layout(root).env_file(instance)
    if not path.exists():
        return {}
    return envfile.read(path).values


# ---- install and uninstall -----------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """What an install would install: the profile, the options with the env file's kept values
    and the port chosen, the env file as it is (empty: a first install), the operator's profile
    file's bytes (when installed from one), and ``node``: the node(s) of a multi-node group this
    host runs (None: a single-node instance)."""

    instance: str
    root: Path
    profile: Profile
    options: Options
    existing: dict[str, str]
    own: bytes | None
    node: Node | None = None

    @property
    def shape(self) -> Shape:
        """What ``instance`` is on this host once installed."""
        return Shape(self.instance, self.node.roles if self.node else ())

    @property
    def key_files(self) -> tuple[Path, ...]:
        """The API key file of each unit installed (created once, kept 0600), the one guarding
        the API first: a group's head's, else the instance's own."""
        layout = Layout(self.root)
        if self.node is None:
            return (layout.api_key_file(self.instance),)
        return tuple(layout.node_api_key_file(self.instance, r) for r in self.node.roles)

    def env_values(self) -> dict[str, str]:
        """The env file's assignments install would write."""
        return env_values(self.profile, self.instance, self.options)


def planned(
    profile: str | Profile | None,
    instance: str,
    *,
    root: Path | str = Path("/"),
    options: Options | None = None,
    node: Node | None = None,
) -> Planned:
    """Resolve an install's inputs without writing: the profile (``None``: the one the env file
    names; an operator's file; the copy installed before), the kept values, the node(s) of a
    group (``node``, else those this host runs already, else the head) and the port, chosen
    across every NAME installed here, of either shape."""
    root = Path(root)
    layout = Layout(root)
    existing = _existing_env(root, instance)
    explicit = options or Options()
    opts = options_from_env(existing, explicit)
    if profile is None:
        if not existing.get(PROFILE_KEY):
            raise UsageError(
                f"instance {instance} names no profile in {layout.env_file(instance)}",
                fix="say which: --profile NAME",
            )
        profile = existing[PROFILE_KEY]
    own: bytes | None = None  # the operator's profile file, installed next to the instance
    if isinstance(profile, str) and is_file_ref(profile):
        prof, own = operators_file(profile)
    elif isinstance(profile, str) and profile == existing.get(PROFILE_KEY):
        prof = installed(root, instance, profile)  # the copy installed before, if any: kept
        if layout.profile_copy(instance).exists():
            own = layout.profile_copy(instance).read_bytes()
    elif isinstance(profile, str):
        prof = get(profile)
    else:
        prof = profile
    node = node_for(prof, layout, instance, node)
    answers = Shape(instance, node.roles if node else ()).answers
    port = _choose_port(root, instance, prof.port, opts.port, explicit.port, answers=answers)
    opts = replace(opts, port=port)
    return Planned(instance, root, prof, opts, dict(existing), own, node)


def node_for(prof: Profile, layout: Layout, name: str, node: Node | None) -> Node | None:
    """The node(s) of group ``name`` this install lays down: the ones asked for, else those
    this host runs already, else the head; None for a profile that serves one host (a
    UsageError when a node was asked for it, or when NAME is installed here as the other
    shape: its files would be left beside the new ones)."""
    shape = layout.shape(name)
    single = layout.args_file(name).exists()  # an instance's (a group's nodes have their own)
    if (prof.multinode is None and shape.group) or (prof.multinode is not None and single):
        now, then = ("instance", "group") if shape.group else ("group", "instance")
        raise UsageError(
            f"{name} is installed here as {'a group' if shape.group else 'an instance'}; "
            f"profile {prof.name} would make it {'an' if shape.group else 'a'} {now}",
            fix=f"give the profile of the {then}, or `appliance instance uninstall {name}` first",
        )
    if prof.multinode is None:
        if node is not None:
            raise UsageError(
                f"profile {prof.name} serves one host (it has no [multinode] table): --role "
                "and --rank apply to a group's profile"
            )
        return None
    if node is not None:
        return node
    return instances.host_node(layout, shape) if shape.group else Node()


def write(plan: Planned, files: dict[str, RenderedFile]) -> WriteResult:
    """Install ``files`` (rendered from ``plan``) under its root, holding NAME's lock: the
    files, the operator's profile copy (or the old copy removed), each unit's API key (created
    once, tightened to 0600), and the host's scrape targets. Refused (LockBusy, exit 3) before
    the first write while a cutover or rollback of NAME holds the lock. Calls no systemctl."""
    root, name = plan.root, plan.instance
    layout = Layout(root)
    # Held whether or not a cutover ever ran here: one starting meanwhile would otherwise read
    # the env file before this write and write its old values back (its lock file is created
    # here, as the cutover creates it; a purge removes it).
    with locks.hold(layout.lock_file(name), name, "install"):
        # The plan kept the env file's values as it read them, before the lock: a cutover or
        # rollback that ended since then moved VLLM_IMAGE, and writing would move it back.
        if _existing_env(root, name) != plan.existing:
            raise locks.LockBusy(
                f"instance {name} changed while this install was planned (a cutover or "
                "rollback ended meanwhile): nothing written",
                fix="run the install again",
            )
        copy = layout.profile_copy(name)
        if plan.own is not None:
            files = {str(copy.relative_to(root)): RenderedFile(plan.own, MODE_ARGS), **files}
        result = write_tree(root, files)
        if plan.own is None and copy.exists():
            copy.unlink()  # now serving a shipped profile: the old copy would mislead
            result.removed.append(copy)
        result.first_install = not plan.existing
        for key in plan.key_files:
            _key(key, result)
        write_scrape_targets(root, result)
    return result


def _key(key: Path, result: WriteResult) -> None:
    """Create ``key`` (a new secret, 0600) or tighten it; never replace or show it."""
    if not key.exists():
        write_atomic(key, (secrets.token_urlsafe(32) + "\n").encode(), mode=MODE_SECRET)
        result.written.append(key)
    elif key.stat().st_mode & 0o7777 != MODE_SECRET:
        os.chmod(key, MODE_SECRET)  # a key readable by others is a leaked key: tighten it
        result.written.append(key)
    else:
        result.unchanged.append(key)


def install(
    profile: str | Profile | None,
    instance: str,
    *,
    root: Path | str = Path("/"),
    options: Options | None = None,
    preflight: Callable[[Planned], None] | None = None,
) -> WriteResult:
    """Install single-node ``instance`` under ``root``: the shared unit and serve program, the
    instance's env file, args file, mounts drop-in and API key (:func:`planned`, then
    :func:`write`; :func:`appliance.instance.installer.install` is the same pipeline for either
    shape, with the image and GPU choice).

    ``preflight`` sees what is about to be installed (:class:`Planned`) once it is valid and
    before anything is written; it raises to refuse (the host check).

    ``profile`` None re-installs the profile the env file names. Re-running is idempotent
    (identical files are not rewritten). Values already in the env file (``VLLM_IMAGE`` above
    all, host, port, GPUs, paths) are kept unless given in ``options``. The API key file (mode
    0600) is created once and never overwritten or shown. Does not call systemctl: ``root``
    may be an image being built.
    """
    plan = planned(profile, instance, root=root, options=options)
    files = render(plan.profile, instance, plan.options)  # validates before the first write
    if preflight is not None:
        preflight(plan)
    return write(plan, files)


def _choose_port(
    root: Path,
    instance: str,
    default: int,
    kept: int | None,
    asked: int | None,
    *,
    answers: bool = True,
) -> int:
    """NAME's port: the one asked for (refused when another NAME serves on it), else the one
    its env file keeps, else the profile's or, when another NAME serves on that, the next free
    one (several instances of one profile, e.g. the four MIG slices of a card). Every NAME
    installed here counts, instance or group, but a host that runs only a group's worker
    serves no API: its port is the head's, elsewhere (``answers`` False: taken as it comes)."""
    if not answers:
        return asked if asked is not None else kept if kept is not None else default
    layout = Layout(root)
    taken: dict[int, str] = {}
    for name in layout.installed():
        shape = layout.shape(name)
        if name == instance or not shape.answers:
            continue
        try:
            port = int(_existing_env(root, name).get(PORT_KEY, ""))
        except (UsageError, ValueError):
            continue  # unreadable: install and the serve program refuse it with its own words
        taken.setdefault(port, f"{shape.noun} {name}")
    if asked is not None and asked in taken:
        free = _next_free(asked, taken)
        raise UsageError(
            f"port {asked} is already {taken[asked]}'s",
            fix=f"give another: --port {free} is free",
        )
    if kept is not None:
        return kept
    return _next_free(default, taken)


def _next_free(port: int, taken: dict[int, str]) -> int:
    while port in taken:
        port += 1
    if port > 65535:
        raise UsageError("no free port above the profile's", fix="give one: --port N")
    return port


def scrape_targets_file(root: Path | str) -> Path:
    """The Prometheus file_sd file listing this host's engines (observability/file_sd.py)."""
    return Path(root) / _rel(file_sd.TARGETS_DIR) / file_sd.ENGINE_FILE


def write_scrape_targets(root: Path, result: WriteResult) -> None:
    """Rewrite the engines' scrape targets from the installed instances and the heads of the
    groups installed here (a worker serves no API); an instance whose env file cannot be read
    is left out with a warning (it does not serve as installed either)."""
    layout = Layout(root)
    targets = []
    for name in layout.installed():
        if not layout.shape(name).answers:
            continue
        try:
            inst = instances.read(root, name)
        except UsageError as e:
            result.warnings.append(f"instance {name} left out of the scrape targets: {e}")
            continue
        targets.append(file_sd.EngineTarget(name, inst.profile.name, inst.host, inst.port))
    path = scrape_targets_file(root)
    if not targets:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            result.removed.append(path)
        return
    data = file_sd.render(targets).encode()
    try:
        same = path.read_bytes() == data
    except FileNotFoundError:
        same = False
    if same:
        result.unchanged.append(path)
    else:
        write_atomic(path, data, mode=0o644)
        result.written.append(path)


def uninstall(
    name: str,
    *,
    root: Path | str = Path("/"),
    purge: bool = False,
    systemd: Systemd | None = None,
) -> WriteResult:
    """Remove what ``install`` wrote for ``name`` (an instance, or the nodes of a group this
    host runs) under ``root``.

    With ``systemd`` (the CLI passes one when ``root`` is ``/``) its units are stopped and
    disabled first, and systemd reloaded after. Its env file, args and API key files, drop-ins
    and enablement links go; its cutover history and rollback slot stay unless ``purge``. A unit
    template goes with the last instance of its shape, the serve program and the state units
    with the last instance. Refused while a cutover of ``name`` is in progress (its lock is
    held), and before anything is removed when ``name`` is not installed here.
    """
    root = Path(root)
    layout = Layout(root)
    shape = layout.shape(name)
    mine = [layout.env_file(name), *_own_files(layout, shape, root)]
    mine += [layout.wants_link(u) for u in _enabled_units(shape)]
    state = list(layout.state_files(name))
    if not any(os.path.lexists(f) for f in mine) and not (purge and any(f.exists() for f in state)):
        raise envfile.unknown_instance(name, layout.env_file(name))
    result = WriteResult()
    # A cutover in progress holds the lock file; with none, no cutover ever ran here.
    lock_path = layout.lock_file(name)
    held = locks.hold(lock_path, name, "uninstall") if lock_path.exists() else None
    # The lock file goes last, by its holder (InstanceLock.remove): unlinked any earlier, a
    # rollback started meanwhile would lock a new file and run beside the purge.
    state.remove(lock_path)
    with held or contextlib.nullcontext() as holding:
        if systemd is not None:
            systemd.stop_and_disable(*_enabled_units(shape))
        for path in mine + (state if purge else []):
            _remove(path, result)
        for dropin in {p.parent for p in mine if p.parent.name.endswith(".service.d")}:
            with contextlib.suppress(OSError):
                dropin.rmdir()  # only when empty: an operator's own drop-in keeps it
        _remove_shared(layout, systemd, result)
        write_scrape_targets(root, result)
        if purge and holding is not None:
            holding.remove()
            result.removed.append(lock_path)
    if purge and not layout.installed():
        _leave_as_found(layout, name, result)
    if systemd is not None:
        systemd.daemon_reload()
    return result


def _own_files(layout: Layout, shape: Shape, root: Path) -> list[Path]:
    """The files install wrote for ``shape`` alone (not the shared units and program)."""
    name = shape.name
    if not shape.group:
        own = [layout.args_file(name), layout.api_key_file(name), layout.profile_copy(name)]
        return [*own, layout.mounts_dropin(name)]
    files = [layout.profile_copy(name)]
    for role in shape.roles:
        files += [layout.node_args_file(name, role), layout.node_api_key_file(name, role)]
        files += [layout.node_dropin(name, role), layout.mounts_dropin(name, role)]
    if "worker" in shape.roles:
        files.append(layout.rendezvous_dropin(name))
    return files


def _enabled_units(shape: Shape) -> list[str]:
    """The units ``systemctl enable`` may have linked for ``shape``."""
    units = list(shape.units)
    if "head" in shape.roles:
        units.append(probe_timer(shape.name))
    return units


def _remove(path: Path, result: WriteResult) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        result.removed.append(path)


def _remove_shared(layout: Layout, systemd: Systemd | None, result: WriteResult) -> None:
    """The unit templates no installed instance uses any more; with the last instance of any
    shape, the serve program and the state units (the timer stopped first)."""
    shapes = [layout.shape(n) for n in layout.installed()]
    roles = {r for s in shapes for r in s.roles}
    unused = []
    if not any(not s.group for s in shapes):
        unused.append(layout.unit_template)
    for role in ("head", "worker"):
        if role not in roles:
            unused.append(layout.node_template(role))
    if "head" not in roles:
        unused += list(layout.probe_units)
    if not shapes:
        service, timer = layout.state_units
        if systemd is not None:
            systemd.stop_and_disable(timer.name)
        unused += [layout.serve_program, service, timer, layout.wants_link(timer.name)]
    for path in unused:
        _remove(path, result)
    with contextlib.suppress(OSError):
        layout.serve_program.parent.rmdir()  # only when empty


def _leave_as_found(layout: Layout, name: str, result: WriteResult) -> None:
    """After the last instance's purge: the state textfile (it would keep the last instance's
    series) and the folders install, cutovers and the state timer made, each only when nothing
    else is in it (an operator's own file, e.g. the Hub token, keeps its folder)."""
    textfile = layout.metrics_textfile()
    _remove(textfile, result)
    folders = [*layout.private_dirs(name), textfile.parent, layout.state_dir]
    folders += [layout.root / _rel(file_sd.TARGETS_DIR), layout.env_dir]
    # usr/local/libexec: a minimal Debian has none until install makes it.
    folders.append(layout.serve_program.parent.parent)
    for folder in folders:
        with contextlib.suppress(OSError):  # not empty, or already gone
            folder.rmdir()
            result.removed.append(folder)


def render_to(
    profile: str | Profile, instance: str, out: Path | str, options: Options | None = None
) -> WriteResult:
    """Render ``instance``'s files into ``out`` (same layout as under ``/``), no API key."""
    return write_tree(Path(out), render(profile, instance, options))
