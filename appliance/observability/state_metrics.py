"""The appliance's state as Prometheus metrics, written as a node_exporter textfile.

The cutover command calls :func:`write_textfile` after every cutover or rollback; the
node's Prometheus reads it through node_exporter's textfile collector (``honor_labels`` keeps
our ``instance`` label, the appliance instance name). Grafana draws the image per instance and
annotates cutovers and rollbacks from these series.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ..errors import UsageError
from ..fsutil import shared_dir, write_atomic

IMAGE_INFO = "gemma4_appliance_image_info"
CUTOVER_EVENTS = "gemma4_appliance_cutover_events"  # exposed as ..._total
LAST_CUTOVER = "gemma4_appliance_last_cutover_timestamp_seconds"
# The last output canary a cutover ran: when, its verdict and figures as labels (for
# the dashboards' annotation text), and its figures as values.
LAST_CANARY = "gemma4_appliance_last_canary_timestamp_seconds"
CANARY_OK = "gemma4_appliance_canary_ok"
CANARY_PARITY = "gemma4_appliance_canary_parity"
CANARY_PASS_RATE = "gemma4_appliance_canary_pass_rate"
CANARY_SECONDS = "gemma4_appliance_canary_seconds"
# The instance's unit as `systemctl show` reports it: a crash loop that hit the start
# limit leaves the unit `failed`, which nothing else on the dashboards would show.
UNIT_STATE = "gemma4_appliance_unit_state"
# The instance's acceptance baseline: its last passing canary record that drafted.
# The alert Gemma4AcceptanceBelowBaseline compares the engine's live acceptance with it.
ACCEPTANCE_BASELINE = "gemma4_appliance_acceptance_baseline"
TOKENS_PER_STEP_BASELINE = "gemma4_appliance_tokens_per_step_baseline"
UNIT_RESTARTS = "gemma4_appliance_unit_restarts"
# 0 when the appliance refuses the instance's env file (a line systemd may read differently):
# its other series are then missing, and cutover, rollback and status refuse it, while the
# unit runs on what systemd reads. The other instances' series are written all the same.
ENV_FILE_READABLE = "gemma4_appliance_env_file_readable"
# systemd's ActiveState values: one series each, 1 for the current one.
UNIT_STATES = ("active", "activating", "deactivating", "reloading", "inactive", "failed")

KINDS = ("cutover", "rollback")
OUTCOMES = ("ok", "rolled_back", "failed")


@dataclass(frozen=True)
class CanaryState:
    """The instance's last output canary (the figures a cutover keeps in its history entry)."""

    timestamp: float  # unix seconds the cutover that ran it ended
    verdict: str  # pass, warn, fail (or error: the after-run did not complete)
    ok: bool
    identical: int | None = None
    outputs: int | None = None
    parity: float | None = None
    pass_rate_before: float | None = None
    pass_rate_after: float | None = None
    tasks: str = ""  # "3/5->2/5", for the annotation
    vllm: str = ""  # "0.19.0->0.32.0" or "0.32.0"
    seconds_before: float | None = None
    seconds_after: float | None = None

    @classmethod
    def from_figures(cls, timestamp: float, f: Mapping) -> CanaryState:
        """From :meth:`appliance.canary.Result.figures` as kept in a history entry."""
        tasks = int(f.get("tasks") or 0)
        rb, ra = f.get("pass_rate_before"), f.get("pass_rate_after")
        tasks_txt = (
            f"{round(rb * tasks)}/{tasks}->{round(ra * tasks)}/{tasks}"
            if tasks and rb is not None and ra is not None
            else ""
        )
        vb, va = f.get("vllm_before") or "", f.get("vllm_after") or ""
        verdict = str(f.get("verdict") or "error")
        return cls(
            timestamp=timestamp,
            verdict=verdict,
            ok=verdict in ("pass", "warn"),
            identical=f.get("identical"),
            outputs=f.get("outputs"),
            parity=f.get("parity"),
            pass_rate_before=rb,
            pass_rate_after=ra,
            tasks=tasks_txt,
            vllm=va if vb == va else f"{vb}->{va}",
            seconds_before=f.get("seconds_before"),
            seconds_after=f.get("seconds_after"),
        )


@dataclass(frozen=True)
class BaselineState:
    """The instance's acceptance baseline: draft acceptance (0..1) and tokens per step (>= 1)."""

    acceptance: float
    tokens_per_step: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise UsageError(f"baseline acceptance must be within 0..1, not {self.acceptance}")
        if self.tokens_per_step < 1.0:
            raise UsageError(
                f"baseline tokens_per_step must be at least 1, not {self.tokens_per_step}"
            )


@dataclass(frozen=True)
class UnitStatus:
    """An instance's unit now: ``ActiveState``, ``SubState``, ``Result`` and ``NRestarts``."""

    active: str  # one of UNIT_STATES, or "unknown" (systemd did not say)
    sub: str = ""  # running, auto-restart, dead, failed, ...
    result: str = ""  # success, exit-code, start-limit-hit, timeout, ...
    restarts: int = 0  # automatic restarts since the last start by hand or reset-failed

    @classmethod
    def from_show(cls, props: Mapping[str, str]) -> UnitStatus:
        """From ``systemctl show`` properties (``{"ActiveState": "failed", ...}``)."""
        try:
            restarts = int(props.get("NRestarts") or 0)
        except ValueError:
            restarts = 0
        return cls(
            active=props.get("ActiveState") or "unknown",
            sub=props.get("SubState", ""),
            result=props.get("Result", ""),
            restarts=restarts,
        )


SHOW_PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts")


def unit_status(systemd, unit: str) -> UnitStatus:
    """``unit``'s status from ``systemctl show`` through ``systemd`` (an
    :class:`appliance.host.systemd.Systemd`); ``unknown`` when systemctl cannot say."""
    from ..errors import ApplianceError

    try:
        return UnitStatus.from_show(systemd.show(unit, *SHOW_PROPERTIES))
    except ApplianceError:
        return UnitStatus("unknown")


@dataclass(frozen=True)
class InstanceState:
    """One appliance instance: the image it runs now and its cutover history counts."""

    instance: str
    image: str
    vllm_version: str
    mtp: bool
    # (kind, outcome) -> how many times; kinds in KINDS, outcomes in OUTCOMES.
    events: Mapping[tuple[str, str], int] = field(default_factory=dict)
    last_cutover: float | None = None  # unix seconds of the last cutover or rollback
    canary: CanaryState | None = None  # the last cutover that ran the output canary
    unit: UnitStatus | None = None  # the unit's state when the textfile was written
    baseline: BaselineState | None = None  # the acceptance baseline, when one is kept
    env_error: str | None = None  # why the appliance refuses its env file (image then unknown)
    gpus: str = ""  # the env file's VLLM_GPUS: the devices it is given (empty: a CPU instance)


def build_registry(states: Iterable[InstanceState] = ()) -> CollectorRegistry:
    """A fresh registry with the state metrics registered and set from ``states``."""
    reg = CollectorRegistry()
    info = Gauge(
        IMAGE_INFO,
        "The image an appliance instance runs (value 1), and the GPUs it is given.",
        ["instance", "image", "vllm_version", "mtp", "gpus"],
        registry=reg,
    )
    events = Counter(
        CUTOVER_EVENTS,
        "Cutovers and rollbacks by outcome.",
        ["instance", "kind", "outcome"],
        registry=reg,
    )
    last = Gauge(
        LAST_CUTOVER,
        "Unix time of the instance's last cutover or rollback.",
        ["instance"],
        registry=reg,
    )
    canary_ts = Gauge(
        LAST_CANARY,
        "Unix time of the instance's last output canary (labels: its "
        "verdict, identical outputs, task pass counts, vLLM versions).",
        ["instance", "verdict", "identical", "tasks", "vllm"],
        registry=reg,
    )
    canary_ok = Gauge(
        CANARY_OK,
        "1 when the last output canary passed (or passed with warnings), 0 when it failed.",
        ["instance"],
        registry=reg,
    )
    parity = Gauge(
        CANARY_PARITY,
        "Share of the last canary's outputs identical before and after the cutover (0..1).",
        ["instance"],
        registry=reg,
    )
    pass_rate = Gauge(
        CANARY_PASS_RATE,
        "The last canary's task pass rate (0..1) before and after the cutover.",
        ["instance", "side"],
        registry=reg,
    )
    seconds = Gauge(
        CANARY_SECONDS,
        "What the last canary's run cost, before and after.",
        ["instance", "side"],
        registry=reg,
    )
    unit_state = Gauge(
        UNIT_STATE,
        "1 for the instance's unit's current systemd ActiveState, 0 for the others "
        "(failed: the engine crashed and systemd gave up, e.g. at the start limit).",
        ["instance", "state", "result"],
        registry=reg,
    )
    unit_restarts = Gauge(
        UNIT_RESTARTS,
        "Automatic restarts of the instance's unit (systemd NRestarts; 0 after reset-failed).",
        ["instance"],
        registry=reg,
    )
    baseline_acc = Gauge(
        ACCEPTANCE_BASELINE,
        "Draft acceptance (0..1) of the instance's acceptance baseline: its last passing "
        "output canary that drafted.",
        ["instance"],
        registry=reg,
    )
    baseline_tps = Gauge(
        TOKENS_PER_STEP_BASELINE,
        "Tokens per engine step (1 + accepted / drafts) of the instance's acceptance baseline.",
        ["instance"],
        registry=reg,
    )
    env_ok = Gauge(
        ENV_FILE_READABLE,
        "1 when the appliance reads the instance's env file, 0 when it refuses it (its image "
        "is then unknown, and cutover, rollback and status refuse the instance).",
        ["instance"],
        registry=reg,
    )
    for s in states:
        env_ok.labels(s.instance).set(0 if s.env_error else 1)
        if (b := s.baseline) is not None:
            baseline_acc.labels(s.instance).set(b.acceptance)
            baseline_tps.labels(s.instance).set(b.tokens_per_step)
        if (u := s.unit) is not None:
            for state in UNIT_STATES:
                unit_state.labels(s.instance, state, u.result if state == u.active else "").set(
                    1 if state == u.active else 0
                )
            unit_restarts.labels(s.instance).set(u.restarts)
        if s.env_error is None:
            mtp = "true" if s.mtp else "false"
            info.labels(s.instance, s.image, s.vllm_version, mtp, s.gpus).set(1)
        for (kind, outcome), count in sorted(s.events.items()):
            if kind not in KINDS or outcome not in OUTCOMES:
                raise UsageError(
                    f"unknown cutover event {kind}/{outcome} for {s.instance}",
                    fix=f"kind in {KINDS}, outcome in {OUTCOMES}",
                )
            if count < 0:
                raise UsageError(f"negative event count {count} for {s.instance}")
            events.labels(s.instance, kind, outcome).inc(count)
        if s.last_cutover is not None:
            last.labels(s.instance).set(s.last_cutover)
        if (c := s.canary) is not None:
            ident = f"{c.identical}/{c.outputs}" if c.outputs else ""
            canary_ts.labels(s.instance, c.verdict, ident, c.tasks, c.vllm).set(c.timestamp)
            canary_ok.labels(s.instance).set(1 if c.ok else 0)
            if c.parity is not None:
                parity.labels(s.instance).set(c.parity)
            for side, rate, secs in (
                ("before", c.pass_rate_before, c.seconds_before),
                ("after", c.pass_rate_after, c.seconds_after),
            ):
                if rate is not None:
                    pass_rate.labels(s.instance, side).set(rate)
                if secs is not None:
                    seconds.labels(s.instance, side).set(secs)
    return reg


def write_textfile(
    path: str | Path, states: Iterable[InstanceState], *, top: Path | None = None
) -> Path:
    """Write the textfile for ``states`` atomically (temp file + rename, as node_exporter needs).

    node_exporter reads only ``*.prom`` files, so ``path`` must end in ``.prom``. It runs as
    another user: the file is 0644 and its folder 0755 whatever the caller's umask (a cutover
    from a shell with umask 077 made it root's alone), and the folders above it up to ``top``
    (the state directory) are made enterable.
    """
    path = Path(path)
    if path.suffix != ".prom":
        raise UsageError(f"{path}: the textfile collector reads only *.prom files")
    shared_dir(path.parent, top=top)
    write_atomic(path, generate_latest(build_registry(list(states))), mode=0o644)
    return path
