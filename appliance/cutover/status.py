"""What an instance is doing now: image, labels, unit state, health, MTP, and its history.

After a cutover was killed half-way, the history's last entry is ``interrupted`` and
:attr:`Status.interrupted` says which env file is in place: the old one or the new one (the env
file is replaced atomically, so it is always one of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ApplianceError, EngineError
from ..units.template import unit_name
from ..vllm_client import VLLMClient
from . import envfile, history
from . import lock as locks
from .flow import Context, ImageInfo, inspect_image, rollback_image, target
from .history import Entry
from .paths import check_instance


@dataclass
class Status:
    """One instance, now."""

    instance: str
    unit: str
    image: str | None
    image_info: ImageInfo | None = None
    image_error: str | None = None
    unit_state: str = "unknown"
    url: str | None = None
    healthy: bool | None = None
    speculative: bool | None = None
    rollback_image: str | None = None
    in_progress: locks.Holder | None = None
    interrupted: str | None = None
    # Why the instance's URL or key could not be read (e.g. installed by an older appliance).
    instance_error: str | None = None
    entries: list[Entry] = field(default_factory=list)


def status(ctx: Context, instance: str, *, last: int = 5) -> Status:
    """Gather the status of ``instance`` (read only: touches nothing)."""
    check_instance(instance)
    layout = ctx.layout
    env = envfile.read(layout.env_file(instance))  # a clear error when not installed
    unit = unit_name(instance)
    st = Status(instance, unit, env.get(envfile.IMAGE_KEY))
    st.unit_state = ctx.systemd.active_state(unit)
    st.rollback_image = rollback_image(layout, instance)
    st.in_progress = locks.current_holder(layout.lock_file(instance))
    live = frozenset(
        {st.in_progress.entry_id} if st.in_progress and st.in_progress.entry_id else ()
    )
    all_entries = history.entries(layout.history_file(instance), live_ids=live)
    st.entries = all_entries[-last:]
    if all_entries and all_entries[-1].outcome == "interrupted":
        st.interrupted = _which(all_entries[-1], env)
    if st.image:
        try:
            st.image_info = inspect_image(ctx, st.image)
        except ApplianceError as exc:
            st.image_error = str(exc)
    try:
        tgt = target(ctx, instance)
        api_key = tgt.api_key()
    except ApplianceError as exc:
        st.instance_error = str(exc)
        return st
    st.url = tgt.base_url
    with VLLMClient(tgt.base_url, timeout=3.0, api_key=api_key) as client:
        try:
            st.healthy = client.health()
            if st.healthy:
                st.speculative = client.snapshot().speculative
        except EngineError:
            st.healthy = False if st.healthy is None else st.healthy
    return st


def _which(entry: Entry, env: envfile.EnvFile) -> str:
    """Which side of an interrupted cutover the env file is on."""
    image = env.get(envfile.IMAGE_KEY)
    if image == entry.to_image and image != entry.from_image:
        return f"new: the env file names {entry.to_image} (the cutover's target)"
    if image == entry.from_image:
        return f"old: the env file names {entry.from_image} (as before the cutover)"
    move = f"{entry.from_image} -> {entry.to_image}"
    return f"neither: the env file names {image}, the cutover was {move}"
