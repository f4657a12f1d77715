"""The live-acceptance gate on real engines under real traffic: the cutover's state machine
(appliance.cutover.flow) with the session's copy-drafter engine (acceptance ~1) and
random-drafter engine (~0) as the old and new images, and clients calling whichever serves.

- copy -> random: the rule says ``worse`` on the traffic and the cutover goes back;
- copy -> copy: ``not worse``, it stays;
- traffic that stops at the move, or none at all: the rule never decides (the gate passes
  saying so, or has nothing to judge), whatever the drafters.
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import Self

import httpx
import pytest

from appliance import profiles
from appliance.cutover import flow, history, live
from appliance.cutover.context import Context
from appliance.cutover.history import Gate
from appliance.cutover.preflight import ImageInfo
from appliance.cutover.target import EnvFileTarget
from appliance.errors import ApplianceError
from appliance.host.layout import Layout
from appliance.judge import noninferiority, traffic_acceptance
from appliance.oci import labels

pytestmark = pytest.mark.engine

COPY, RANDOM = "gemma4-vllm:0.32.0-mtp-cpu-copy", "gemma4-vllm:0.32.0-mtp-cpu-random"
NAME = "live1"

# Windows of half a second (the tiny engine drafts hundreds of tokens a second under two
# clients); fewer of them than on a real host, each side's least evidence still stated.
RULE = noninferiority.Rule(margin=0.05, min_samples=6, min_calls=6)
SETTINGS = live.Settings(
    rule=RULE,
    sampling=traffic_acceptance.Settings(window_s=0.5, min_draft_tokens=8),
    before_windows=10,
    before_s=60.0,
    idle_s=3.0,
    after_s=60.0,
)


class SwapTarget(EnvFileTarget):
    """FAKE, and why: a target whose "restart" points at another real engine already running.
    The gate under test reads the engines' real /metrics under real traffic; what a restart
    of a unit does is the systemd tier's (one CPU host cannot hold a unit per drafter). Each
    image reference names one of the session's engines."""

    noun = "instance"
    node = None
    remote_ranks = ()
    # Plain attributes where EnvFileTarget reads an installed record: this target has none.
    name = NAME
    env_path = profile = served_model = None
    answers = True  # it serves the API

    def __init__(self, root: Path, engines: dict[str, str], first: str, on_move=None) -> None:
        self.name = NAME
        self.root = root
        self.env_path = root / f"{NAME}.env"  # not under etc/: no installed instance to scan
        self.env_path.write_bytes(f"# test\nVLLM_IMAGE={first}\n".encode())
        self.profile = profiles.get("cpu-tiny-mtp")
        self.served_model = self.profile.served_model_name
        self.engines = engines
        self.serving = first
        self.moves: list[str] = []
        self.on_move = on_move

    @property
    def base_url(self) -> str:
        return self.engines[self.serving]

    def api_key(self) -> str | None:
        return None

    def inspect(self, ctx: Context, ref: str) -> ImageInfo:
        found = {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true", labels.VARIANT: "cpu"}
        digest = hashlib.sha256(ref.encode()).hexdigest()
        return ImageInfo(ref, f"sha256:{digest}", "0.32.0", True, found)

    def check_overrides(self, ctx: Context, *, allow: bool) -> None:
        return None

    def move(self, ctx, image: ImageInfo, api_key, timeout: float, restart: bool) -> list[Gate]:
        self.serving = image.ref
        self.moves.append(image.ref)
        if self.on_move is not None:
            self.on_move(image.ref)
        return [Gate("swap", True, 0.0, f"{image.ref} serves at {self.base_url}")]

    def runs(self, ctx, image: ImageInfo) -> bool:
        return self.serving == image.ref

    def journal(self, ctx, lines: int) -> str:
        return ""


class Calls:
    """Real chat completions, ``clients`` at a time, to whatever engine ``target`` serves now;
    bounded (``cap`` calls a client) and stopped when the block ends."""

    def __init__(self, target: SwapTarget, clients: int = 2, cap: int = 600) -> None:
        self.target, self.cap = target, cap
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _run(self, client: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i in range(self.cap):
                if self.stop.is_set():
                    return
                body = {
                    "model": self.target.served_model,
                    "messages": [{"role": "user", "content": f"client {client} call {i}: go on"}],
                    "max_tokens": 24 + 8 * (i % 4),
                    "temperature": 0.0,
                }
                url = self.target.base_url + "/v1/chat/completions"
                self.statuses.append(http.post(url, json=body).status_code)


@pytest.fixture
def engines(mtp_engine, mtp_random_engine) -> dict[str, str]:
    return {COPY: mtp_engine.url, RANDOM: mtp_random_engine.url}


def _context(tmp_path: Path, said: list[str]) -> Context:
    def progress(msg: str) -> None:
        said.append(msg)
        print("cutover:", msg, flush=True)

    return Context(layout=Layout(tmp_path), progress=progress)


def _cutover(ctx: Context, tgt: SwapTarget, image: str, settings=SETTINGS):
    return flow.cutover(ctx, tgt, image, timeout=120, canary=False, live_acceptance=settings)


def _counts(detail: str) -> tuple[int, int, int, int]:
    """windows and calls before, windows and calls after, from a gate's detail."""
    m = re.search(
        r"n (\d+) windows \((\d+) calls\) before, (\d+) windows \((\d+) calls\) after", detail
    )
    assert m, detail
    return tuple(int(g) for g in m.groups())


def _decided_on_enough(detail: str) -> None:
    wb, cb, wa, ca = _counts(detail)
    assert min(wb, wa) >= RULE.min_samples and min(cb, ca) >= RULE.min_calls, detail


def test_copy_to_random_under_traffic_is_rolled_back_by_the_live_rule(tmp_path, engines):
    said: list[str] = []
    tgt = SwapTarget(tmp_path, engines, COPY)
    env_before = tgt.env_path.read_bytes()
    with Calls(tgt) as calls, pytest.raises(flow.CutoverFailed) as failed:
        _cutover(_context(tmp_path, said), tgt, RANDOM)
    assert "failed gate 'live-acceptance'" in str(failed.value)
    assert f"rolled back to {COPY}" in str(failed.value)
    assert set(calls.statuses) == {200}, calls.statuses
    # The way back ran as for any gate: the old engine serves, the env file's bytes are back.
    assert tgt.moves == [RANDOM, COPY] and tgt.serving == COPY
    assert tgt.env_path.read_bytes() == env_before
    [entry] = history.entries(Layout(tmp_path).history_file(NAME))
    assert entry.outcome == "rolled_back"
    gate = entry.gates[-1]
    assert (gate.name, gate.ok) == ("live-acceptance", False)
    assert gate.detail.startswith("draft acceptance on the live traffic is worse: "), gate.detail
    _decided_on_enough(gate.detail)
    assert [g.name for g in entry.rollback_gates] == ["swap"]  # no live rule on the way back
    assert any(m.startswith("live acceptance before: ") for m in said), said


def test_copy_to_copy_under_traffic_stays(tmp_path, engines):
    said: list[str] = []
    tgt = SwapTarget(tmp_path, engines, COPY)
    other = "gemma4-vllm:0.32.0-mtp-cpu-copy2"
    tgt.engines[other] = engines[COPY]  # the same drafter under another name
    with Calls(tgt) as calls:
        entry = _cutover(_context(tmp_path, said), tgt, other)
    assert set(calls.statuses) == {200}, calls.statuses
    assert entry.outcome == "ok" and tgt.moves == [other]
    gate = entry.gates[-1]
    assert (gate.name, gate.ok) == ("live-acceptance", True)
    assert gate.detail.startswith("not worse: "), gate.detail
    _decided_on_enough(gate.detail)


def test_traffic_that_stops_at_the_move_is_never_judged(tmp_path, engines):
    """Before: traffic on the copy engine. The move stops every client, so the random engine
    serves nothing: a collapse the rule could not see, and it does not pretend to."""
    said: list[str] = []
    calls: list[Calls] = []
    tgt = SwapTarget(tmp_path, engines, COPY, on_move=lambda _ref: calls[0].__exit__())
    quick = live.Settings(
        rule=RULE, sampling=SETTINGS.sampling, before_windows=10, before_s=60.0, after_s=4.0
    )
    with Calls(tgt) as running:
        calls.append(running)
        entry = _cutover(_context(tmp_path, said), tgt, RANDOM, quick)
    gate = entry.gates[-1]
    assert entry.outcome == "ok", entry.error
    assert (gate.name, gate.ok) == ("live-acceptance", True)
    assert gate.detail.startswith("undecided within "), gate.detail
    assert "the canary decides: not enough calls yet (after has 0 of 6 windows" in gate.detail


def test_without_traffic_the_live_rule_has_nothing_to_judge(tmp_path, engines):
    said: list[str] = []
    tgt = SwapTarget(tmp_path, engines, COPY)
    other = "gemma4-vllm:0.32.0-mtp-cpu-copy2"
    tgt.engines[other] = engines[RANDOM]
    entry = _cutover(_context(tmp_path, said), tgt, other)
    assert entry.outcome == "ok"
    assert [g.name for g in entry.gates] == ["swap"]
    assert "live acceptance: nothing to judge (no traffic); the canary decides" in said


def test_a_margin_outside_0_1_is_refused_before_anything_is_touched(tmp_path):
    with pytest.raises(ApplianceError, match="margin must be within 0..1, not 2.0"):
        live.settings(True, 2.0)
