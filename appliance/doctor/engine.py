"""Doctor's checks of the engine: the right vLLM, the right model, and MTP really working.

The MTP verdict is the probe's (:mod:`appliance.engine_api.probe`), the same the cutover gates and
bench give; doctor only maps it to ok / warn / fail against what the profile expects.
"""

from __future__ import annotations

from ..engine_api import shed, versions
from ..engine_api.probe import Probe
from ..errors import UsageError
from ..oci import labels as image_labels
from ..profiles import Profile, defects
from .report import Check, Status


def version_check(version: str, profile: Profile | None, label_version: str | None) -> Check:
    """The server's vLLM is new enough for the profile (and MTP) and matches the image label."""
    ev = {
        "server": version,
        "profile_min": profile.min_vllm if profile else None,
        "image_label": label_version,
    }
    try:
        versions.parse(version)
    except UsageError:
        return Check(
            "vllm.version", "fail", f"the server's vLLM version {version!r} is unreadable", ev
        )
    if profile and versions.older(version, profile.min_vllm):
        return Check(
            "vllm.version",
            "fail",
            f"vLLM {version} is older than {profile.name} needs ({profile.min_vllm})",
            ev,
        )
    if profile and profile.mtp and not versions.has_mtp(version):
        return Check(
            "vllm.version",
            "fail",
            f"vLLM {version} has no Gemma 4 MTP (needs {image_labels.MTP_MIN_VLLM})",
            ev,
        )
    if label_version and not _same_release(label_version, version):
        return Check(
            "vllm.version",
            "fail",
            f"server says vLLM {version}, image label says {label_version}",
            ev,
        )
    return Check("vllm.version", "ok", f"vLLM {version}", ev)


def defect_checks(version: str, profile: Profile | None) -> list[Check]:
    """One ``warn`` check per published defect (:mod:`appliance.profiles.defects`) of the
    server's vLLM ``version`` that applies to ``profile``: the engine runs, so a defect is a
    risk to name, not a failure. None without a profile or with an unreadable version."""
    if profile is None:
        return []
    try:
        found = defects.applicable(version, defects.Conditions.of(profile))
    except UsageError:
        return []  # an unreadable version: vllm.version already fails on it
    return [
        Check(
            f"vllm.defect.{d.id}",
            "warn",
            f"{d.summary()}; fix: {d.fix}",
            {"server": version, "affected": d.affected, "fixed_in": d.fixed_in},
        )
        for d in found
    ]


def _same_release(label: str, server: str) -> bool:
    try:
        return versions.same_release(label, server)
    except UsageError:  # a label that is no version matches nothing
        return False


def model_check(models, profile: Profile | None) -> Check:
    """The profile's model is served, with the profile's context length."""
    ev = {
        "served": [m.id for m in models],
        "max_model_len": {m.id: m.max_model_len for m in models},
    }
    if profile is None:
        return Check("model.served", "ok", f"serving {', '.join(ev['served'])}", ev)
    want = profile.served_model_name
    ev["profile_model"] = want
    ev["profile_max_model_len"] = profile.max_model_len
    match = next((m for m in models if m.id == want), None)
    if match is None:
        return Check("model.served", "fail", f"{want} is not served", ev)
    if profile.max_model_len and match.max_model_len != profile.max_model_len:
        return Check(
            "model.served",
            "warn",
            f"{want} max_model_len {match.max_model_len}, profile says {profile.max_model_len}",
            ev,
        )
    return Check("model.served", "ok", f"{want} served, max_model_len {match.max_model_len}", ev)


def mtp_checks(p: Probe, profile: Profile | None) -> list[Check]:
    """``mtp.counters`` (the probe's verdict for the profile) and ``mtp.per_request_metrics``."""
    want = profile.mtp if profile else None
    name = profile.name if profile else None
    ev = p.evidence()
    if p.state in ("unreadable", "unparsable"):
        what = "/metrics is unparsable" if p.state == "unparsable" else "cannot read /metrics"
        return [Check("mtp.counters", "fail", f"{what}: {p.error}", ev)]
    if p.state == "failed":
        return [Check("mtp.counters", "fail", f"the test generation failed: {p.error}", ev)]
    if p.generation is None:  # --no-generate: one read, present or absent
        ok = want is None or (p.state == "present") == want
        return [
            Check(
                "mtp.counters",
                "ok" if ok else "fail",
                f"speculative-decoding counters {p.state} (no generation sent)",
                ev,
            )
        ]
    status: Status
    if p.state == "absent":
        summary = p.summary()
        if want:
            status, summary = "fail", f"{summary}, but profile {name} asks for MTP"
        elif want is False:
            status, summary = "ok", f"{summary}, as profile {name} says"
        else:
            status = "warn"
    elif p.state == "reset":
        status, summary = "warn", p.summary()
    elif p.state == "idle":
        status, summary = ("fail" if want is not False else "warn"), p.summary()
    elif not p.figures.accepted:
        status, summary = "warn", f"{p.summary()}; no draft token accepted (wrong drafter?)"
    elif want is False:
        status, summary = "warn", f"{p.summary()}; profile {name} has no speculative decoding"
    else:
        status, summary = "ok", p.summary()
    k = profile.speculative.num_speculative_tokens if profile and profile.speculative else None
    positions = p.figures.accepted_per_pos if p.figures else None
    if k is not None and positions and len(positions) != k:
        status = "warn" if status == "ok" else status
        summary += f"; {len(positions)} draft positions, profile k={k}"
    summary += shed.noted(p.shed)  # serving at its bound: not a fault, but worth knowing
    return [Check("mtp.counters", status, summary, ev), _per_request_check(p, profile)]


def _per_request_check(p: Probe, profile: Profile | None) -> Check:
    if p.per_request:
        spec = p.generation.spec
        return Check(
            "mtp.per_request_metrics",
            "ok",
            "per-request metrics available",
            {"drafts": spec.drafts, "draft_tokens": spec.draft_tokens, "accepted": spec.accepted},
        )
    if p.state == "absent":
        return Check("mtp.per_request_metrics", "ok", "not applicable: no speculative decoding", {})
    wanted = bool(profile and profile.per_request_spec_decode_metrics)
    return Check(
        "mtp.per_request_metrics",
        "warn" if wanted else "ok",
        "per-request metrics not available: per-call figures come from /metrics deltas "
        "(exact only without overlapping load)",
        {},
    )
