"""What an instance is doing now: image, labels, unit state, health, MTP, and its history.

Beside the env file's image it shows the image the running container was started from (by ID),
and flags a mismatch: something else (a drop-in, a second env file) sets the image.

After a cutover was killed half-way (SIGKILL, power loss), the history's last entry is
``interrupted``; :attr:`Status.interrupted` says which env file is in place (the old one or the
new one: it is replaced atomically, so it is always one of them) and what the container runs,
and :attr:`Status.recovery` is the one command that gets back to a gated state.

:attr:`Status.baseline` is the instance's acceptance baseline (its last passing canary record
that drafted): what a cutover from an image without MTP is judged against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..canary import baseline as baselines
from ..engine_api.vllm_client import VLLMClient
from ..errors import ApplianceError, EngineError
from ..host import envfile, reach
from ..host import lock as locks
from ..host.names import check_instance
from ..images import variant
from . import history
from .context import Context
from .history import Entry
from .preflight import ImageInfo, inspect_image, running_image
from .recovery import recovery_image
from .slot import rollback_image
from .target import command
from .targets import target


@dataclass
class Status:
    """One instance, now."""

    instance: str
    unit: str  # the first of ``units``: a group's head where this host runs it
    image: str | None
    gpus: str | None = None  # the env file's VLLM_GPUS: the devices it is given
    # Every unit that serves the instance here and its ActiveState: one for an instance, a
    # group's head and/or worker units (a group has no gemma4-vllm@GROUP).
    units: dict[str, str] = field(default_factory=dict)
    container: str = ""
    image_info: ImageInfo | None = None
    image_error: str | None = None
    unit_state: str = "unknown"
    url: str | None = None
    healthy: bool | None = None
    # Why /health was not asked (a tree whose port is not its own on this host): "not asked: ..."
    health_note: str | None = None
    speculative: bool | None = None
    rollback_image: str | None = None
    in_progress: locks.Holder | None = None
    interrupted: str | None = None
    # The one command that recovers an interrupted cutover, and what it does.
    recovery: str | None = None
    recovery_note: str | None = None
    # The running container's image: its ID, the tags that ID has here, and whether it differs
    # from the env file's image (None when either is unknown).
    running_id: str | None = None
    running_ref: str | None = None  # the reference the container was started from
    running_tags: list[str] = field(default_factory=list)
    running_error: str | None = None
    mismatch: bool | None = None
    # Why the instance's URL or key could not be read (e.g. installed by an older appliance).
    instance_error: str | None = None
    # The env file's image is the other build than the profile's (a CPU image for a GPU
    # profile: images/variant.py), with the fix; or it does not say which build it is.
    wrong_build: str | None = None
    build_warning: str | None = None
    entries: list[Entry] = field(default_factory=list)
    # The acceptance baseline's figures (Baseline.to_dict), None when there is none; why its
    # file cannot be read, when it cannot.
    baseline: dict | None = None
    baseline_error: str | None = None

    @property
    def serving(self) -> bool:
        """Every unit active, the API answering where this host serves it, its files read."""
        units_up = all(state == "active" for state in self.units.values())
        return units_up and self.healthy is not False and self.instance_error is None


def status(ctx: Context, instance: str, *, last: int = 5) -> Status:
    """Gather the status of ``instance`` (read only: touches nothing)."""
    check_instance(instance)
    layout = ctx.layout
    unusable = None
    try:
        env = envfile.read(layout.env_file(instance))
    except envfile.UnknownInstance:
        raise  # not installed: bad input, the one line every command says
    except ApplianceError as exc:
        # A line the parser refuses is the instance's problem, shown with the rest and not
        # serving (exit 1), as a port that is not one is: never a refusal of the whole status.
        env, unusable = None, str(exc)
    shape = layout.shape(instance)
    image, gpus = (env.get(envfile.IMAGE_KEY), env.get(envfile.GPUS_KEY)) if env else (None, None)
    st = Status(instance, shape.unit, image, gpus)
    st.units = {u: ctx.systemd.active_state(u) for u in shape.units}
    st.unit_state = st.units[shape.unit]
    # The container of the head where it runs here (it serves the API), else the worker's.
    st.container = shape.container
    st.rollback_image = rollback_image(layout, instance)
    st.in_progress = locks.current_holder(layout.lock_file(instance))
    try:
        kept = baselines.load(layout.canary_baseline(instance))
        st.baseline = kept.to_dict() if kept else None
    except ApplianceError as exc:
        st.baseline_error = str(exc)
    live = frozenset(
        {st.in_progress.entry_id} if st.in_progress and st.in_progress.entry_id else ()
    )
    all_entries = history.entries(layout.history_file(instance), live_ids=live)
    st.entries = all_entries[-last:]
    docker = ctx.docker_client is not None or reach.docker(layout.root)
    if st.image and not docker:
        st.image_error = reach.why_not(layout.root, reach.DOCKER_NOT)
    elif st.image:
        try:
            st.image_info = inspect_image(ctx, st.image)
        except ApplianceError as exc:
            st.image_error = str(exc)
    if docker:
        _running(ctx, st)
    else:
        st.running_error = reach.why_not(layout.root, reach.DOCKER_NOT)
    if all_entries and all_entries[-1].outcome == "interrupted":
        last = all_entries[-1]
        st.interrupted = _which(last, env) + "; " + _runs(st)
        back = recovery_image(last)
        if back:
            st.recovery = command(layout.root, "rollback", instance)
            saved = layout.saved_env(instance)
            how = (
                f"writes back {saved} (the env file before it)"
                if last.kind == "cutover" and saved.exists()
                else f"sets {envfile.IMAGE_KEY}={back}"
            )
            st.recovery_note = f"returns to {back} through the gates; {how}"
        else:
            st.recovery = command(layout.root, "cutover", instance, "IMAGE")
            st.recovery_note = "the interrupted cutover started from no image: choose one"
    if unusable is not None:
        st.instance_error = unusable
        return st
    try:
        tgt = target(ctx, instance)
        api_key = tgt.api_key()
    except ApplianceError as exc:
        st.instance_error = str(exc)
        return st
    if st.image_info is not None:
        built = variant.fit(
            st.image_info.ref, st.image_info.labels, tgt.profile.hardware.device, tgt.profile.name
        )
        st.wrong_build = f"{built.refusal} ({built.fix})" if built.refusal else None
        st.build_warning = built.warning
    if not tgt.answers:
        return st  # a group's worker host: the API is the head's, on another host
    st.url = tgt.base_url
    if not reach.ports(layout.root):
        st.health_note = reach.why_not(layout.root, reach.PORT_NOT)
        return st
    with VLLMClient(tgt.base_url, timeout=3.0, api_key=api_key) as client:
        try:
            st.healthy = client.health()
            if st.healthy:
                st.speculative = client.snapshot().speculative
        except EngineError:
            st.healthy = False if st.healthy is None else st.healthy
    return st


def _running(ctx: Context, st: Status) -> None:
    """Fill in the running container's image and whether it is the env file's."""
    try:
        st.running_id, st.running_ref = running_image(ctx, st.container)
    except ApplianceError as exc:
        st.running_error = str(exc)
        return
    if st.running_id is None:
        return
    try:
        st.running_tags = list(ctx.docker().images.get(st.running_id).tags or [])
    except Exception:  # noqa: BLE001 - the ID alone still answers the question
        st.running_tags = []
    if st.image_info is not None:
        st.mismatch = st.running_id != st.image_info.id


def _runs(st: Status) -> str:
    if st.running_id is None:
        return f"no container runs ({st.unit} is {st.unit_state})"
    return f"the container runs {describe_running(st)}"


def describe_running(st: Status) -> str:
    """The running container's image: its tags (or short ID)."""
    if st.running_id is None:
        return "-"
    short = st.running_id.removeprefix("sha256:")[:12]
    # The env file's reference when it is one of the running image's tags, else all of them.
    tags = [st.image] if st.image in st.running_tags else st.running_tags
    return f"{', '.join(tags)} ({short})" if tags else short


def _which(entry: Entry, env: envfile.EnvFile | None) -> str:
    """Which side of an interrupted cutover the env file is on."""
    if env is None:
        return "unknown: the env file cannot be read (see instance)"
    image = env.get(envfile.IMAGE_KEY)
    if image == entry.to_image and image != entry.from_image:
        return f"new: the env file names {entry.to_image} (the cutover's target, never gated)"
    if image == entry.from_image:
        return f"old: the env file names {entry.from_image} (as before the cutover)"
    move = f"{entry.from_image} -> {entry.to_image}"
    return f"neither: the env file names {image}, the cutover was {move}"
