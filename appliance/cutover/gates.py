"""The gates a restarted instance must pass before a cutover counts as done.

In order, against one deadline: the unit is active; the running container was started from the
target image (its image ID, so an override drop-in or a second env file that keeps the old image
cannot pass for the new one); ``/health`` answers 200; the expected model
is served (and, when the image's labels name a vLLM version, ``/version`` says that version, so
an old engine still answering cannot pass for the new one); one real generation returns tokens;
and for an image that runs Gemma 4 MTP, the speculative-decoding counters moved on that
generation. While waiting, a unit that fails or restarts (the engine exited) fails the gates at
once instead of at the deadline, and a progress line says what is awaited against the deadline
(``waiting for .../health ... 130 s of 2010 s``). A generation the engine turns away at its
queue bound (503: it is serving other clients) is sent again until the deadline
(:mod:`appliance.engine_api.shed`): an instance at its bound passes, and the gate says how many were
shed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine_api import probe, shed
from ..engine_api.vllm_client import VLLMClient
from ..errors import ApplianceError, EngineError
from ..host.systemd import Systemd
from ..units import timing
from .history import Gate
from .signals import Interrupted

Progress = Callable[[str], None]
POLL = 0.5
# A waiting gate says so at once, then every NOTE_EVERY_S.
NOTE_EVERY_S = 15.0
# The gates' default deadline covers the restart the unit allows: the old engine's stop, the new
# one's start to TimeoutStartSec (a new vLLM version starts with a cold compile cache: vLLM puts
# its version into the cache key, vllm/config/vllm.py), and the gates after it.
AFTER_START_S = 120
DEFAULT_TIMEOUT = float(timing.STOP_TIMEOUT_S + timing.START_TIMEOUT_S + AFTER_START_S)


@dataclass(frozen=True)
class Expect:
    """What the instance must show once restarted."""

    unit: str
    base_url: str
    served_model: str
    vllm_version: str | None = None
    mtp: bool = False
    api_key: str | None = None
    # The InvocationID before the restart: "active" counts only for a newer start.
    previous_invocation: str = ""
    # The container and the image it must run (reference and ID); no image gate when unset.
    container: str = ""
    image: str = ""
    image_id: str | None = None


# The ID of the image a container runs (None while there is no such container); EngineError
# when the engine cannot be asked.
RunningImage = Callable[[str], str | None]


class GateFailed(ApplianceError):
    """A gate failed or timed out; ``gates`` holds every gate up to and including it."""

    def __init__(self, gate: str, detail: str, gates: list[Gate]) -> None:
        super().__init__(f"gate {gate!r} failed: {detail}")
        self.gate = gate
        self.detail = detail
        self.gates = gates


@dataclass
class _Run:
    expect: Expect
    systemd: Systemd
    deadline: float
    progress: Progress
    timeout: float
    t0: float = field(default_factory=time.monotonic)
    gates: list[Gate] = field(default_factory=list)
    restarts0: int = 0
    invocation: str = ""  # the first start after our restart; another one means a crash

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def passed(self, name: str, detail: str) -> None:
        self.gates.append(Gate(name, True, self.elapsed(), detail))
        self.progress(f"[{self.elapsed():6.1f}s] {name}: ok ({detail})")

    def fail(self, name: str, detail: str) -> GateFailed:
        self.gates.append(Gate(name, False, self.elapsed(), detail))
        self.progress(f"[{self.elapsed():6.1f}s] {name}: FAILED ({detail})")
        return GateFailed(name, detail, self.gates)

    def unit_alive(self, name: str) -> None:
        """Fail ``name`` now if the unit failed, stopped, or was restarted since we began."""
        st = self.systemd.state(self.expect.unit)
        # "inactive" or "failed" with a job pending is the gap inside a restart, not a stop: a
        # multi-node head whose engine exits non-zero when its worker goes away shows "failed"
        # until the restart queued for it (PartOf=) runs.
        if st.active in ("failed", "inactive") and not st.job:
            raise self.fail(name, f"unit {self.expect.unit} is {st.active} ({st.sub})")
        # A start counts as ours only once no job is pending: a restart queued while an earlier
        # start job ran is re-run by systemd as a restart, which stops the start just begun (a
        # new invocation that is not a crash). Crashes after that show in NRestarts.
        fresh = st.invocation and st.invocation != self.expect.previous_invocation
        # A start of ours whose engine exited: systemd holds the unit in auto-restart for
        # RestartSec with no job, then starts it again. It failed now, not one start later.
        if fresh and st.sub == "auto-restart" and not st.job:
            raise self.fail(name, f"the engine exited and systemd will restart the unit ({st.sub})")
        if fresh and not st.job and not self.invocation:
            self.invocation = st.invocation
        moved = self.invocation and st.invocation != self.invocation
        if st.restarts > self.restarts0 or moved:
            raise self.fail(name, f"the engine exited and systemd restarted the unit ({st.sub})")

    def note(self, what: str) -> None:
        """A progress line: what is awaited, and how far into the deadline."""
        self.progress(
            f"[{self.elapsed():6.1f}s] waiting for {what} ... "
            f"{self.elapsed():.0f} s of {self.timeout:.0f} s"
        )

    def wait(self, name: str, probe: Callable[[], str | None], what: str) -> str:
        """Poll ``probe`` (a detail when passed, None to keep waiting) until the deadline."""
        last_note = None
        last_err = ""
        while True:
            try:
                got = probe()
            except EngineError as exc:
                got, last_err = None, str(exc)
            if got is not None:
                return got
            self.unit_alive(name)
            if time.monotonic() >= self.deadline:
                raise self.fail(
                    name, f"timed out waiting for {what}" + (f": {last_err}" if last_err else "")
                )
            if last_note is None or time.monotonic() - last_note >= NOTE_EVERY_S:
                last_note = time.monotonic()
                self.note(what)
            time.sleep(POLL)


def wait(
    systemd: Systemd,
    expect: Expect,
    *,
    timeout: float,
    progress: Progress = lambda _msg: None,
    running_image: RunningImage | None = None,
) -> list[Gate]:
    """Wait for every gate; returns them, or raises :class:`GateFailed` at the first failure.

    An :class:`~appliance.cutover.signals.Interrupted` on the way carries the gates so far."""
    run = _Run(expect, systemd, time.monotonic() + timeout, progress, timeout)
    try:
        return _wait(run, running_image)
    except Interrupted as exc:
        exc.gates = list(run.gates)
        raise


def _wait(run: _Run, running_image: RunningImage | None) -> list[Gate]:
    expect = run.expect
    run.restarts0 = run.systemd.restarts(expect.unit)
    with VLLMClient(expect.base_url, timeout=10.0, api_key=expect.api_key) as client:
        _unit_active(run)
        if running_image is not None and expect.image_id:
            _running_image(run, running_image)
        run.passed(
            "health",
            run.wait(
                "health", lambda: "200" if client.health() else None, f"{expect.base_url}/health"
            ),
        )
        _served(run, client)
        _generation_and_mtp(run, client)
    return run.gates


def _unit_active(run: _Run) -> None:
    unit = run.expect.unit

    def probe() -> str | None:
        st = run.systemd.state(unit)
        # Until the queued restart has stopped the old engine, "active" is the old one.
        new = st.invocation and st.invocation != run.expect.previous_invocation
        return "active" if st.active == "active" and new and not st.job else None

    run.passed("unit", run.wait("unit", probe, f"{unit} to be active"))


def _short(image_id: str) -> str:
    return image_id.removeprefix("sha256:")[:12]


def _running_image(run: _Run, running_image: RunningImage) -> None:
    """The container the unit started runs the target image (by ID, not by name)."""
    e = run.expect

    def probe() -> str | None:
        got = running_image(e.container)
        if got is None:
            return None  # between the unit's start and docker run: keep waiting
        if got != e.image_id:
            raise run.fail(
                "image",
                f"container {e.container} runs image {_short(got)}, not {e.image} "
                f"({_short(e.image_id)}): something else sets VLLM_IMAGE for the unit "
                "(a drop-in or a second EnvironmentFile: see `appliance status`)",
            )
        return f"{e.container} runs {e.image} ({_short(got)})"

    run.passed("image", run.wait("image", probe, f"container {e.container}"))


def _served(run: _Run, client: VLLMClient) -> None:
    want = run.expect.served_model
    try:
        ids = [m.id for m in client.models()]
        version = client.version() if run.expect.vllm_version else None
    except EngineError as exc:
        raise run.fail("model", str(exc)) from exc
    if want not in ids:
        raise run.fail("model", f"serves {ids}, expected {want!r}")
    detail = want
    if version is not None:
        if version != run.expect.vllm_version:
            raise run.fail(
                "model", f"engine is vLLM {version}, the image says {run.expect.vllm_version}"
            )
        detail += f", vLLM {version}"
    run.passed("model", detail)


def judge(expect: Expect, p: probe.Probe) -> list[tuple[str, bool, str]]:
    """The ``generation`` and ``mtp`` gates' outcomes from one probe: ``(gate, passed, detail)``,
    up to and including the first failure."""
    if p.stage == "before" or p.state == "failed":
        what = f"cannot read /metrics: {p.error}" if p.stage == "before" else p.error
        return [("generation", False, what)]
    if not p.completion_tokens:
        return [("generation", False, "returned no tokens")]
    out = [("generation", True, f"{p.completion_tokens} tokens{shed.noted(p.shed)}")]
    if p.stage == "after":
        return [*out, ("mtp", False, f"cannot read /metrics: {p.error}")]
    if not expect.mtp:
        spec = "off" if p.state == "absent" else "on"
        return [*out, ("mtp", True, f"not expected for this image (speculative decoding {spec})")]
    if not p.working:
        why = {
            "absent": "the engine exposes no speculative-decoding counters",
            "reset": "the counters reset during the generation",
        }.get(p.state, "no drafts")
        return [*out, ("mtp", False, f"counters did not move: {why}")]
    f = p.figures
    acc = f.acceptance
    return [
        *out,
        (
            "mtp",
            True,
            f"drafts +{f.drafts}, draft tokens +{f.draft_tokens}, accepted +{f.accepted}"
            + (f" (acceptance {acc:.2f})" if acc is not None else "")
            + f", {p.source}",
        ),
    ]


def probe_gates(
    client: VLLMClient, expect: Expect, timeout: float, tally: shed.Tally | None = None
) -> tuple[probe.Probe, list]:
    """Probe the engine (one real generation of the served model, sent again while the engine
    sheds it at its queue bound, within ``timeout``) and judge the gates."""
    within = max(5.0, timeout)
    p = probe.run(client, expect.served_model, timeout=within, within=within, tally=tally)
    return p, judge(expect, p)


def _generation_and_mtp(run: _Run, client: VLLMClient) -> None:
    tally = shed.Tally(note=lambda msg: run.note(f"a generation ({msg})"))
    _, outcomes = probe_gates(client, run.expect, run.deadline - time.monotonic(), tally)
    for name, passed, detail in outcomes:
        if not passed:
            raise run.fail(name, detail)
        run.passed(name, detail)
