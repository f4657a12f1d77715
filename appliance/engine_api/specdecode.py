"""Speculative-decoding counters: parsing vLLM's ``/metrics`` and the arithmetic on them.

Every ratio, delta and reset rule the appliance uses lives here, so the agent, the demo, doctor
and bench all agree. vLLM's own names and definitions (vllm/v1/spec_decode/metrics.py), the same
in every record and JSON output of the appliance:

- ``drafts`` (speculation steps), ``draft_tokens`` (tokens proposed), ``accepted`` (accepted
  tokens), ``accepted_per_pos`` (accepted tokens at each draft position);
- ``acceptance`` = accepted / draft_tokens (draft acceptance rate);
- ``tokens_per_step`` = 1 + accepted / drafts (mean acceptance length, counts the bonus token);
- ``per_position`` = accepted_per_pos[i] / drafts (per-position acceptance).

:meth:`Delta.to_dict` is the one projection of these figures; :func:`attribute` is the one rule
for which figures belong to one request.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:spec_decode_num_"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
RUNNING = "vllm:num_requests_running"

# Counter family names as prometheus_client reports them (it drops ``_total``).
SPEC_FAMILIES = (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS)

# vLLM serves /metrics through prometheus_client's ASGI app, which honours ``name[]`` filters on
# the mounted path (``/metrics/``; the bare ``/metrics`` ignores them). Asking for just these
# series makes a read ~4x cheaper for the server and ~40x smaller (measured 0.8 ms vs 3.5 ms, 1.4
# KB vs 56 KB on vLLM 0.32). A server that ignores the filter sends everything: parse() copes.
SNAPSHOT_PATH = "/metrics/"
SNAPSHOT_PARAMS = tuple(
    ("name[]", name)
    for name in (
        DRAFTS + "_total",
        DRAFTS + "_created",
        DRAFT_TOKENS + "_total",
        ACCEPTED + "_total",
        ACCEPTED_PER_POS + "_total",
        RUNNING,
    )
)


class MetricsParseError(ValueError):
    """The text is not a Prometheus exposition we can read."""


@dataclass(frozen=True)
class Counters:
    """Cumulative speculative-decoding counters of one engine (or a sum of engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()
    # ``*_created`` of the drafts counter: changes when the server restarts.
    created: float | None = None

    def __add__(self, other: Counters) -> Counters:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pos = tuple(
            _at(self.accepted_per_pos, i) + _at(other.accepted_per_pos, i) for i in range(width)
        )
        created = max((c for c in (self.created, other.created) if c is not None), default=None)
        return Counters(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted,
            pos,
            created,
        )


def _at(values: tuple[float, ...], i: int) -> float:
    return values[i] if i < len(values) else 0.0


@dataclass(frozen=True)
class Snapshot:
    """What one read of ``/metrics`` says about speculative decoding.

    ``series`` maps ``(model_name, engine)`` to that engine's counters. It is empty when the
    server has no speculative decoding (a pre-MTP image or a baseline profile): vLLM then exposes
    none of the series, which is not the same as zero acceptance.
    """

    series: dict[tuple[str, str], Counters] = field(default_factory=dict)
    running: float | None = None

    @property
    def speculative(self) -> bool:
        """True when the server exposes speculative-decoding counters."""
        return bool(self.series)

    def total(self, model_name: str | None = None) -> Counters | None:
        """Counters summed over engines (and over models unless ``model_name`` is given)."""
        if len(self.series) == 1:  # one engine, one model (the agent's case): no sort, no sum
            (((m, _), c),) = self.series.items()
            return c if model_name is None or model_name == m else None
        picked = [c for (m, _), c in sorted(self.series.items()) if model_name in (None, m)]
        if not picked:
            return None
        out = picked[0]
        for c in picked[1:]:
            out = out + c
        return out


DeltaStatus = Literal["ok", "absent", "reset"]


@dataclass(frozen=True)
class Delta:
    """Counter movement between two snapshots.

    ``status`` is ``ok`` when the figures are usable, ``absent`` when the server has no
    speculative decoding, and ``reset`` when a counter went backwards or the server restarted
    between the reads: the movement is then unknown and every figure is ``None``.
    """

    status: DeltaStatus
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted: int | None = None
    accepted_per_pos: tuple[int, ...] | None = None

    @property
    def acceptance(self) -> float | None:
        return acceptance(self.accepted, self.draft_tokens)

    @property
    def tokens_per_step(self) -> float | None:
        return tokens_per_step(self.accepted, self.drafts)

    @property
    def per_position(self) -> tuple[float, ...] | None:
        return per_position(self.accepted_per_pos, self.drafts)

    def to_dict(self) -> dict:
        """The figures and their ratios under vLLM's names: the one projection for JSON."""
        pos, per = self.accepted_per_pos, self.per_position
        return {
            "status": self.status,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_pos": None if pos is None else list(pos),
            "acceptance": self.acceptance,
            "tokens_per_step": self.tokens_per_step,
            "per_position": None if per is None else list(per),
        }


def summed(deltas: list[Delta]) -> Delta | None:
    """The figures of several requests added up (``ok`` ones only); ``None`` when there are none.

    The ratios of a sum are taken over the summed counts, never averaged per request.
    """
    usable = [d for d in deltas if d.status == "ok" and d.drafts is not None]
    if not usable:
        return None
    width = max(len(d.accepted_per_pos or ()) for d in usable)
    pos = tuple(sum(_at(d.accepted_per_pos or (), i) for d in usable) for i in range(width))
    return Delta(
        "ok",
        drafts=sum(d.drafts for d in usable),
        draft_tokens=sum(d.draft_tokens or 0 for d in usable),
        accepted=sum(d.accepted or 0 for d in usable),
        accepted_per_pos=tuple(round(p) for p in pos),
    )


def acceptance(accepted: float | None, draft_tokens: float | None) -> float | None:
    """Draft acceptance rate, vLLM's definition; ``None`` without draft tokens."""
    if accepted is None or not draft_tokens:
        return None
    return accepted / draft_tokens


def tokens_per_step(accepted: float | None, drafts: float | None) -> float | None:
    """Mean tokens per engine step, ``1 + accepted / drafts`` (the bonus token included)."""
    if accepted is None or not drafts:
        return None
    return 1.0 + accepted / drafts


def per_position(
    accepted_per_pos: tuple[float, ...] | None, drafts: float | None
) -> tuple[float, ...] | None:
    """Acceptance at each draft position, ``accepted_per_pos[i] / drafts``."""
    if accepted_per_pos is None or not drafts:
        return None
    return tuple(a / drafts for a in accepted_per_pos)


def delta(before: Snapshot, after: Snapshot, model_name: str | None = None) -> Delta:
    """The counters' movement from ``before`` to ``after``, safe across restarts."""
    b, a = before.total(model_name), after.total(model_name)
    if b is None and a is None:
        return Delta("absent")
    if b is None or a is None:
        # Series appeared or vanished: the server was replaced in between.
        return Delta("reset")
    return counters_delta(b, a)


def counters_delta(b: Counters, a: Counters) -> Delta:
    """Movement between two readings of the same counters; ``reset`` if they went backwards."""
    if b.created is not None and a.created is not None and a.created != b.created:
        return Delta("reset")
    ap, bp = a.accepted_per_pos, b.accepted_per_pos
    if len(ap) == len(bp):  # the same positions at both reads: no padding
        pos = tuple(map(operator.sub, ap, bp))
    else:
        pos = tuple(_at(ap, i) - _at(bp, i) for i in range(max(len(ap), len(bp))))
    drafts, tokens, accepted = (
        a.drafts - b.drafts,
        a.draft_tokens - b.draft_tokens,
        a.accepted - b.accepted,
    )
    if drafts < 0 or tokens < 0 or accepted < 0:
        return Delta("reset")
    for p in pos:  # a loop, not any(): no generator frame on the agent's thread
        if p < 0:
            return Delta("reset")
    return Delta("ok", round(drafts), round(tokens), round(accepted), tuple(map(round, pos)))


Source = Literal["request", "counters", "shared", "absent", "unknown"]


@dataclass(frozen=True)
class Attribution:
    """One request's figures and where they came from.

    ``source``: ``request`` (the response's own block: exact), ``counters`` (the /metrics delta
    around it with nothing else in flight: exact), ``shared`` (the delta also holds other
    requests' drafts), ``absent`` (no speculative decoding), ``unknown`` (counters reset).
    """

    source: Source
    delta: Delta

    @property
    def exact(self) -> bool:
        return self.source in ("request", "counters")

    @property
    def shared(self) -> bool:
        return self.source == "shared"


def attribute(
    before: Snapshot,
    after: Snapshot,
    model_name: str | None = None,
    *,
    request: Delta | None = None,
    overlapped: bool = False,
    alone: bool = False,
) -> Attribution:
    """The one rule for the figures of a request read between ``before`` and ``after``.

    The response's per-request block wins. Otherwise the counter delta, for ``model_name`` when
    the server labels its series with that name (else all models: a served-model alias may differ
    from the label); it is ``shared`` when this process knows of an overlapping request
    (``overlapped``) or the server's running-requests gauge shows one at either read (the first
    read precedes the request and the second follows its end, so any running request seen then
    is someone else's). ``alone``: the caller proved the window held this request alone by
    other means (the agent's token-counter proof, :func:`appliance.agent.rules.only_this_call`),
    which already accounts for requests running at either read: the gauge is not looked at.
    """
    if request is not None:
        return Attribution("request", request)
    if (
        model_name is not None
        and not _labelled(before, model_name)
        and not _labelled(after, model_name)
    ):
        model_name = None  # no series labelled so: an alias, all models
    d = delta(before, after, model_name)
    if d.status == "absent":
        return Attribution("absent", d)
    if d.status == "reset":
        return Attribution("unknown", d)
    if alone:
        return Attribution("counters", d)
    shared = overlapped or bool(before.running) or bool(after.running)
    return Attribution("shared" if shared else "counters", d)


def _labelled(snap: Snapshot, model_name: str) -> bool:
    """Whether a series of ``snap`` carries ``model_name`` (a loop: no generator frame)."""
    for m, _ in snap.series:
        if m == model_name:
            return True
    return False


def parse(text: str) -> Snapshot:
    """Parse a Prometheus exposition into a :class:`Snapshot` (see :func:`parse_with`)."""
    return parse_with(text)[0]


# The sample names parse_with reads, and the Counters field each one sets. A counter's sample
# is ``NAME_total`` (prometheus_client's exposition); a bare ``NAME`` is read the same way.
_FIELDS = {
    **{name: name for name in SPEC_FAMILIES},
    **{name + "_total": name for name in SPEC_FAMILIES},
    DRAFTS + "_created": "created",
}


def parse_with(
    text: str, totals: tuple[str, ...] = ()
) -> tuple[Snapshot, tuple[float | None, ...]]:
    """The :class:`Snapshot` of a Prometheus exposition and, in the same pass, the sum of each
    sample named in ``totals`` over its label sets (``None`` where the page has none).

    The agent reads the page around calls, on its own thread, so this is a narrow hand parser:
    it looks only at the sample lines of the series it needs and splits them by hand, ~5x
    cheaper than prometheus_client's parser on the filtered page, and reads the same values
    (tests/test_specdecode_parse.py: the captures and generated pages). A page with a backslash
    (an escaped label value) goes to prometheus_client's parser (:func:`parse_exposition`).
    """
    if "\\" in text:
        return parse_exposition(text), _totals_exposition(text, totals)
    raw: dict[tuple[str, str], dict] = {}
    running: float | None = None
    sums: list[float | None] = [None] * len(totals)
    for line in text.split("\n"):
        if not line.startswith((PREFIX, RUNNING, *totals)):
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.partition(" ")[0]
        field = _FIELDS.get(name)
        if field is None and name != RUNNING and name not in totals:
            continue  # e.g. another counter's _created: not read, not split
        value, labels = _sample(line, brace, field is not None)
        if field is None:
            if name == RUNNING:
                running = (running or 0.0) + value
            else:
                i = totals.index(name)
                sums[i] = (sums[i] or 0.0) + value
            continue
        slot = raw.setdefault(
            (labels.get("model_name", ""), labels.get("engine", "0")), {"pos": {}}
        )
        if field == ACCEPTED_PER_POS:
            try:
                slot["pos"][int(labels.get("position", "0"))] = value
            except ValueError:
                raise MetricsParseError(f"unparsable /metrics line: {line[:200]!r}") from None
        else:
            slot[field] = value
    if running is None and "# TYPE " + RUNNING not in text:
        # Every vLLM exposes its running-requests gauge; without it this is not vLLM's page.
        raise MetricsParseError("no vLLM series in /metrics")
    return _snapshot(raw, running), tuple(sums)


# A sample line's text before its last "}" (name and labels) -> what its value sets: the page
# of one engine has the same lines on every read, so each is looked at once. ``None``: a line
# only :func:`parse_with` reads (then it reads the whole page).
_Line = tuple[str, object, int | None] | None
_SEEN: dict[tuple[str, ...], dict[str, _Line]] = {}  # totals -> head -> what it sets
_SEEN_KEPT = 4096
_RUNNING, _TOTAL, _SKIP = "running", "total", ""


def _line(head: str, totals: tuple[str, ...]) -> _Line:
    """What a sample line whose text before its last "}" is ``head`` sets: (``running``, None,
    None), (``total``, its index in ``totals``, None), a ``Counters`` field with its
    ``(model_name, engine)`` and position (per-position counts only), or (``""``, ...) for a
    series the snapshot does not read; raises ValueError where parse_with would refuse it."""
    brace = head.find("{")
    if brace < 0:
        return None  # "}" without "{": parse_with's own reading of such a line
    name = head[:brace]
    if name == RUNNING:
        return (_RUNNING, None, None)
    if name in totals:
        return (_TOTAL, totals.index(name), None)
    field = _FIELDS.get(name)
    if field is None:
        return (_SKIP, None, None)
    labels = _split_labels(head[brace + 1 :])
    key = (labels.get("model_name", ""), labels.get("engine", "0"))
    pos = int(labels.get("position", "0")) if field == ACCEPTED_PER_POS else None
    return (field, key, pos)


def parse_seen(
    text: str, totals: tuple[str, ...] = ()
) -> tuple[Snapshot, tuple[float | None, ...]] | None:
    """What :func:`parse_with` reads from ``text``, each sample line looked up whole by its
    name and labels instead of split (an engine's page has the same lines at every read, and
    the agent reads it once per call on its own thread: issue 56 §2); ``None`` for a page with
    anything else (an escape, a timestamp, a line it cannot read), which parse_with then reads,
    or refuses, itself."""
    if "\\" in text:
        return None
    seen = _SEEN.get(totals)
    if seen is None:  # the totals' names are checked once, when first seen
        if not all(name.startswith("vllm:") for name in totals):
            return None
        seen = _SEEN.setdefault(totals, {})
    raw: dict[tuple[str, str], dict] = {}
    running: float | None = None
    sums: list[float | None] = [None] * len(totals)
    try:
        for line in text.split("\n"):
            if not line.startswith("vllm:"):  # every series read starts so (PREFIX, totals)
                continue
            close = line.rfind("}")
            if close < 0:
                return None
            head = line[:close]
            what = seen.get(head)
            if what is None:
                what = _line(head, totals)
                if what is None:
                    return None
                if len(seen) >= _SEEN_KEPT:  # a page of ever new lines: start over
                    seen.clear()
                seen[head] = what
            kind, key, pos = what
            if kind is _SKIP:
                continue
            value = float(line[close + 1 :])  # a timestamp after it: ValueError, parse_with
            if kind is _RUNNING:
                running = (running or 0.0) + value
            elif kind is _TOTAL:
                sums[key] = (sums[key] or 0.0) + value
            else:
                slot = raw.get(key)
                if slot is None:
                    slot = raw[key] = {"pos": {}}
                if pos is None:
                    slot[kind] = value
                else:
                    slot["pos"][pos] = value
    except (ValueError, IndexError):
        return None
    if running is None and "# TYPE " + RUNNING not in text:
        return None  # not vLLM's page: parse_with says so
    return _snapshot(raw, running), tuple(sums)


def _sample(line: str, brace: int, with_labels: bool) -> tuple[float, dict[str, str]]:
    """One sample line without escapes (``brace``: where its labels start, or -1): its value
    and, ``with_labels``, its labels (a dict shared by every line with the same label text:
    read it, never change it)."""
    try:
        if brace < 0:
            return float(line.partition(" ")[2].split(None, 1)[0]), _NO_LABELS
        close = line.rindex("}")
        value = float(line[close + 1 :].split(None, 1)[0])
        if not with_labels:
            return value, _NO_LABELS
        inner = line[brace + 1 : close]
        labels = _LABELS.get(inner)
        if labels is None:
            labels = _split_labels(inner)
            if len(_LABELS) >= _LABELS_KEPT:  # a page of ever new label sets: start over
                _LABELS.clear()
            _LABELS[inner] = labels
        return value, labels
    except (ValueError, IndexError):
        raise MetricsParseError(f"unparsable /metrics line: {line[:200]!r}") from None


# Label text -> its labels: the agent reads the same series on every call, so each label set is
# split once, not once per read (ValueError for text that is not labels).
_LABELS: dict[str, dict[str, str]] = {}
_LABELS_KEPT = 4096
_NO_LABELS: dict[str, str] = {}


def _split_labels(inner: str) -> dict[str, str]:
    """``a="1",b="2"`` without backslashes: no quote is inside a value, so a value ends at the
    next quote (a comma may be anywhere in it, its first character too)."""
    labels: dict[str, str] = {}
    at, end = 0, len(inner)
    while at < end:
        eq = inner.index('="', at)
        stop = inner.index('"', eq + 2)
        labels[inner[at:eq].strip()] = inner[eq + 2 : stop]
        at = stop + 1
        while at < end and inner[at] == " ":
            at += 1
        if at < end:
            if inner[at] != ",":
                raise ValueError(inner)
            at += 1
            if not inner[at:].strip():  # a trailing comma
                break
    return labels


def _snapshot(raw: dict[tuple[str, str], dict], running: float | None) -> Snapshot:
    series = {}
    for key, slot in raw.items():
        pos = slot["pos"]
        series[key] = Counters(
            drafts=slot.get(DRAFTS, 0.0),
            draft_tokens=slot.get(DRAFT_TOKENS, 0.0),
            accepted=slot.get(ACCEPTED, 0.0),
            accepted_per_pos=tuple(pos.get(i, 0.0) for i in range(max(pos) + 1)) if pos else (),
            created=slot.get("created"),
        )
    return Snapshot(series=series, running=running)


def _totals_exposition(text: str, totals: tuple[str, ...]) -> tuple[float | None, ...]:
    sums: list[float | None] = [None] * len(totals)
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises bare ValueErrors and worse on garbage
        raise MetricsParseError(f"unparsable /metrics: {exc}") from exc
    for fam in families:
        for s in fam.samples:
            if s.name in totals:
                i = totals.index(s.name)
                sums[i] = (sums[i] or 0.0) + s.value
    return tuple(sums)


def parse_exposition(text: str) -> Snapshot:
    """:func:`parse` through prometheus_client's parser: the pages :func:`parse_with` leaves to
    it, and the reference its tests compare against. Only the lines we need are handed to the
    parser (vLLM's whole page is ~64 KB).
    """
    wanted = "\n".join(
        line
        for line in text.splitlines()
        if line.startswith((PREFIX, RUNNING, "# TYPE " + PREFIX, "# TYPE " + RUNNING))
    )
    if RUNNING not in wanted:
        # Every vLLM exposes its running-requests gauge; without it this is not vLLM's page.
        raise MetricsParseError("no vLLM series in /metrics")
    raw: dict[tuple[str, str], dict] = {}
    running: float | None = None
    try:
        families = list(text_string_to_metric_families(wanted + "\n"))
    except Exception as exc:  # the parser raises bare ValueErrors and worse on garbage
        raise MetricsParseError(f"unparsable /metrics: {exc}") from exc
    for fam in families:
        for s in fam.samples:
            if fam.name == RUNNING and s.name == RUNNING:
                running = (running or 0.0) + s.value
                continue
            created = s.name == DRAFTS + "_created"  # its own gauge family in vLLM's page
            if fam.name not in SPEC_FAMILIES and not created:
                continue
            key = (s.labels.get("model_name", ""), s.labels.get("engine", "0"))
            slot = raw.setdefault(key, {"pos": {}})
            if created:
                slot["created"] = s.value
            elif s.name.endswith("_created"):
                continue
            elif fam.name == ACCEPTED_PER_POS:
                slot["pos"][int(s.labels.get("position", "0"))] = s.value
            else:
                slot[fam.name] = s.value
    return _snapshot(raw, running)


def from_response_metrics(body: dict | None) -> Delta | None:
    """Per-request figures from a response's ``metrics.speculative_decoding`` block.

    vLLM >= 0.32 with ``--per-request-spec-decode-metrics`` adds that block to a non-streamed
    response and to the final usage chunk of a stream. ``None`` when it is not there.
    """
    if not isinstance(body, dict):
        return None
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if not isinstance(spec, dict):
        return None
    try:
        steps = int(spec["num_spec_steps"])
        draft_tokens = int(spec["num_draft_tokens"])
        accepted = int(spec["num_accepted_draft_tokens"])
    except (KeyError, TypeError, ValueError):
        return None
    per_step = spec.get("per_step_accepted")
    pos: tuple[int, ...] | None = None
    k = spec.get("num_spec_tokens")
    if isinstance(per_step, list) and isinstance(k, int):
        # Position i was accepted in every step that accepted more than i tokens.
        pos = tuple(sum(1 for a in per_step if a > i) for i in range(k))
    return Delta(
        "ok", drafts=steps, draft_tokens=draft_tokens, accepted=accepted, accepted_per_pos=pos
    )
