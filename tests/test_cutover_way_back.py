"""The way back of a failed cutover, in milliseconds: the real flow (lock, history, saved env
file, rollback slot, the env file written back) with a scripted :class:`Target`.

FAKE, and why: the target's ``move`` (a restart and the gates) and ``inspect`` (Docker) are
scripted. The state machine's bookkeeping around them is what is proven here, and a real move
costs an engine start each way: tests/test_cutover_systemd.py runs the same way back with the
real unit, Docker and a broken image. Everything else is the product's own code: the env file is
read, written and saved by the shipped :class:`EnvFileTarget`, under a temp root.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from plugins.cutover import write_env

from appliance.cutover import flow, gates, history
from appliance.cutover import slot as slots
from appliance.cutover.context import Context, PreflightError
from appliance.cutover.history import Gate
from appliance.cutover.preflight import ImageInfo
from appliance.cutover.target import EnvFileTarget
from appliance.host.layout import Layout
from appliance.host.systemd import Systemd
from appliance.oci import labels
from appliance.units import instance
from appliance.units.instance import Instance

NAME = "i1"
OLD = "gemma4-cutover-test:0.32.0-mtp-cpu"
NEW = "gemma4-cutover-test:0.32.1-mtp-cpu"
OLDER = "gemma4-cutover-test:0.31.0-mtp-cpu"  # what an earlier cutover left in the slot
CPU_MTP = {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true", labels.VARIANT: "cpu"}
IMAGES = {
    OLD: ImageInfo(OLD, "sha256:" + "a" * 64, "0.32.0", True, CPU_MTP),
    NEW: ImageInfo(NEW, "sha256:" + "b" * 64, "0.32.0", True, CPU_MTP),
}
# What the new image's restart shows: the unit came up, then the engine died before /health.
FAILED = [
    Gate("unit", True, 1.5, "active"),
    Gate("image", True, 1.6, "runs " + IMAGES[NEW].id),
    Gate("health", False, 3.0, "the engine exited before /health answered"),
]
# The old image's gates on the way back, all passed.
PASSED = [
    Gate(name, True, 2.0 + i, "ok")
    for i, name in enumerate(("unit", "image", "health", "model", "generation", "mtp"))
]


@dataclass
class Move:
    """What one ``move`` saw: the image it gated, the env file's and the slot's bytes then."""

    image: str
    env: bytes
    slot: bytes | None


@dataclass
class ScriptedTarget(EnvFileTarget):
    """An instance whose moves go as scripted (``outcomes``: one gate list per move, the last
    failing one raising ``GateFailed``); it records what each move saw."""

    inst: Instance  # the record of the tree's env file (its URL never asked: no canary)
    root: Path
    outcomes: list[list[Gate]]
    noun: str = "instance"
    remote_ranks: tuple[int, ...] = ()
    moves: list[Move] = field(default_factory=list)

    def inspect(self, ctx: Context, ref: str) -> ImageInfo:
        if ref not in IMAGES:
            raise PreflightError(f"image {ref} is not on this host")
        return IMAGES[ref]

    def check_overrides(self, ctx: Context, *, allow: bool) -> None:
        return None

    def move(self, ctx, image: ImageInfo, api_key, timeout: float, restart: bool) -> list[Gate]:
        slot_path = Layout(self.root).rollback_slot(self.name)
        seen = slot_path.read_bytes() if slot_path.exists() else None
        self.moves.append(Move(image.ref, self.env_path.read_bytes(), seen))
        went = self.outcomes.pop(0)
        if not went[-1].ok:
            raise gates.GateFailed(went[-1].name, went[-1].detail, list(went))
        return list(went)

    def runs(self, ctx: Context, image: ImageInfo) -> bool:
        return False

    def journal(self, ctx: Context, lines: int) -> str:
        return "last journal lines of the scripted unit:\nengine exited"


def _tree(tmp_path: Path, slot_before: str | None, outcomes: list[list[Gate]]) -> tuple:
    env_path = write_env(tmp_path, NAME, OLD, "cpu-tiny-mtp")
    layout = Layout(tmp_path)
    if slot_before is not None:
        slots.write(layout, NAME, slot_before, "earlier-entry", "sha256:" + "c" * 64)
    said: list[str] = []
    ctx = Context(
        layout=layout,
        # No systemd here: the state metrics record the unit as unknown.
        systemd=Systemd(prefix=(str(tmp_path / "no-systemctl"),)),
        progress=said.append,
    )
    tgt = ScriptedTarget(instance.read(tmp_path, NAME), tmp_path, list(outcomes))
    assert tgt.env_path == env_path
    return ctx, tgt, said


def _slot_bytes(layout: Layout) -> bytes | None:
    path = layout.rollback_slot(NAME)
    return path.read_bytes() if path.exists() else None


@pytest.mark.parametrize("slot_before", [None, OLDER], ids=["first-cutover", "slot-kept"])
def test_a_failed_move_writes_the_env_bytes_back_restores_the_slot_and_says_so(
    tmp_path, slot_before
):
    ctx, tgt, said = _tree(tmp_path, slot_before, [FAILED, PASSED])
    layout = ctx.layout
    env_before, slot_bytes = tgt.env_path.read_bytes(), _slot_bytes(layout)

    with pytest.raises(flow.CutoverFailed) as failed:
        flow.cutover(ctx, tgt, NEW, canary=False, live_acceptance=None, timeout=5)

    detail = "the engine exited before /health answered"
    assert failed.value.message == (
        f"cutover of {NAME} failed: {NEW} failed gate 'health': {detail}; rolled back to "
        f"{OLD}, which passed the gates and is serving"
    )
    assert failed.value.exit_code == 1
    # The new image was gated with the new env file and the slot naming the way back; the way
    # back was gated with the old file's bytes (every line, comments and spacing as they were)
    # and the slot as it was before the cutover.
    new_env = env_before.replace(f"VLLM_IMAGE={OLD}".encode(), f"VLLM_IMAGE={NEW}".encode())
    assert [m.image for m in tgt.moves] == [NEW, OLD]
    assert tgt.moves[0].env == new_env != env_before
    assert json.loads(tgt.moves[0].slot)["image"] == OLD
    assert tgt.moves[1].env == env_before
    assert tgt.moves[1].slot == slot_bytes
    # Where it ended: the env file byte-identical, the slot as it was, nothing saved left.
    assert tgt.env_path.read_bytes() == env_before
    assert _slot_bytes(layout) == slot_bytes
    assert slots.rollback_image(layout, NAME) == slot_before
    assert not layout.saved_env(NAME).exists() and not layout.saved_slot(NAME).exists()
    # One history entry, closed: what failed and the way back's gates.
    (e,) = history.entries(layout.history_file(NAME))
    assert (e.kind, e.outcome, e.from_image, e.to_image) == ("cutover", "rolled_back", OLD, NEW)
    assert (e.from_image_id, e.to_image_id) == (IMAGES[OLD].id, IMAGES[NEW].id)
    assert e.gates == FAILED and e.rollback_gates == PASSED
    assert e.error == f"{NEW} failed gate 'health': {detail}"
    assert e.interrupted is None and e.finished is not None
    assert f"rolling back {NAME} to {OLD}" in said


def test_a_way_back_that_fails_too_still_leaves_the_old_bytes_and_slot(tmp_path):
    ctx, tgt, _ = _tree(tmp_path, OLDER, [FAILED, FAILED])
    layout = ctx.layout
    env_before, slot_bytes = tgt.env_path.read_bytes(), _slot_bytes(layout)

    with pytest.raises(flow.RollbackFailed) as failed:
        flow.cutover(ctx, tgt, NEW, canary=False, live_acceptance=None, timeout=5)

    assert failed.value.exit_code == 4
    assert f"the rollback to {OLD} ALSO failed gate 'health'" in failed.value.message
    assert "last journal lines of the scripted unit" in failed.value.message
    assert [m.image for m in tgt.moves] == [NEW, OLD]
    # The env file names the image that served before (the operator's `rollback` is not needed
    # to undo the write): only the engine is broken.
    assert tgt.env_path.read_bytes() == env_before
    assert _slot_bytes(layout) == slot_bytes
    (e,) = history.entries(layout.history_file(NAME))
    assert (e.outcome, e.gates, e.rollback_gates) == ("failed", FAILED, FAILED)
    assert e.error.startswith(f"{NEW} failed gate 'health'")
    assert f"rollback to {OLD} failed gate 'health'" in e.error
