"""``appliance doctor``: is this appliance serving what it should, with MTP actually working?

Every check is a :class:`Check` record (``ok`` / ``warn`` / ``fail``, a one-line summary and the
evidence it was based on). Doctor never changes anything: it reads ``/health``, ``/version``,
``/v1/models`` and ``/metrics``, sends one short generation (so the counters have a chance to
move; ``generate=False`` skips it), reads the instance's files and asks Docker to inspect.
``/v1`` calls carry the API key (an installed instance's vLLM requires it; see
:func:`resolve_api_key`); the key is never printed or put into the report.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from . import labels as image_labels
from . import specdecode
from .cutover.paths import ENV_DIR, Layout
from .errors import EngineError, NotVLLMError, UsageError
from .profiles import Profile
from .units import UNIT_TEMPLATE, check_instance, container_name, parse_env
from .units.template import UNIT_DIR
from .vllm_client import VLLMClient, normalise_base_url

Status = Literal["ok", "warn", "fail"]

# Where a unit template may be installed: the appliance's own place first, then the vendor ones.
UNIT_DIRS = (Path(UNIT_DIR).relative_to("/"), Path("usr/lib/systemd/system"),
             Path("lib/systemd/system"))


@dataclass(frozen=True)
class ApiKey:
    """The key for vLLM's ``--api-key`` and where it came from (``source`` is safe to print)."""

    value: str = field(repr=False)
    source: str


def _read_key(path: Path, what: str) -> str | None:
    """The stripped key in ``path``; None when the file does not exist."""
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}",
                         fix="run as a user that may read it, or give --api-key-file") from exc
    if not key:
        raise UsageError(f"{what} {path} is empty")
    return key


def resolve_api_key(
    api_key: str | None = None,
    api_key_file: Path | None = None,
    instance: str | None = None,
    root: Path = Path("/"),
) -> ApiKey | None:
    """The key to send: ``api_key_file``, else ``api_key``, else the instance's key file.

    The instance's file (``<root>/etc/gemma4-vllm/<instance>.api-key``, written by ``appliance
    install``) is optional: an instance without one runs vLLM without a key.
    """
    if instance is not None:
        check_instance(instance)  # a bad name is the first thing to report, whatever else
    if api_key_file is not None:
        key = _read_key(Path(api_key_file), "API key file")
        if key is None:
            raise UsageError(f"API key file {api_key_file} does not exist")
        return ApiKey(key, f"file {api_key_file}")
    if api_key:
        return ApiKey(api_key.strip(), "--api-key/VLLM_API_KEY")
    if instance is not None:
        path = Layout(root).api_key_file(instance)
        key = _read_key(path, "API key file")
        if key is not None:
            return ApiKey(key, f"file {path}")
    return None


@dataclass(frozen=True)
class Check:
    """One doctor check and the evidence behind its verdict."""

    name: str
    status: Status
    summary: str
    evidence: dict = field(default_factory=dict)


@dataclass
class DoctorReport:
    url: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed): the exit status is 0 exactly then."""
        return all(c.status != "fail" for c in self.checks)

    def get(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict:
        return {"url": self.url, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}

    def text(self) -> str:
        """One line per check, evidence in brackets."""
        lines = []
        for c in self.checks:
            ev = ", ".join(f"{k}={v}" for k, v in c.evidence.items() if v not in (None, "", {}))
            lines.append(f"{c.status.upper():<4} {c.name}: {c.summary}" + (f" [{ev}]" if ev else ""))
        lines.append("doctor: " + ("no failures" if self.ok else "FAILED"))
        return "\n".join(lines)


def version_tuple(v: str) -> tuple[int, ...]:
    """``"0.32.0rc1+cpu"`` -> ``(0, 32, 0)``: the leading numeric release only."""
    out = []
    for part in v.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


# --- instance (installed unit, env file, container) ---------------------------------------


@dataclass
class InstanceFacts:
    """What the host says about an installed instance; ``None`` fields were not found."""

    unit_path: Path | None = None
    env_path: Path | None = None
    env_image: str | None = None
    docker_error: str | None = None
    container_status: str | None = None
    container_image: str | None = None  # the reference the container was started from
    container_image_id: str | None = None
    image_labels: dict | None = None


def instance_facts(instance: str, root: Path = Path("/"), docker_client=None) -> InstanceFacts:
    """Read the unit, env file and container of ``instance`` (read-only)."""
    env = Layout(root).env_file(instance)  # validates the name before any path is built
    facts = InstanceFacts()
    for d in UNIT_DIRS:
        if (root / d / UNIT_TEMPLATE).is_file():
            facts.unit_path = root / d / UNIT_TEMPLATE
            break
    if env.is_file():
        facts.env_path = env
        facts.env_image = parse_env(env.read_text()).get("VLLM_IMAGE")
    try:
        import docker  # imported here: doctor without --instance must not need a Docker engine

        client = docker_client or docker.from_env(timeout=5)
        try:
            ctr = client.containers.get(container_name(instance))
        except docker.errors.NotFound:
            return facts
        facts.container_status = ctr.status
        facts.container_image = ctr.attrs.get("Config", {}).get("Image")
        facts.container_image_id = ctr.attrs.get("Image")
        facts.image_labels = dict(ctr.attrs.get("Config", {}).get("Labels") or {})
        try:
            img = client.images.get(facts.container_image_id)
            facts.image_labels = {**(img.labels or {}), **facts.image_labels}
        except docker.errors.DockerException:
            pass
    except Exception as exc:  # docker missing, daemon down, permission: report, never crash
        facts.docker_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return facts


def _instance_checks(instance: str, facts: InstanceFacts) -> list[Check]:
    checks = []
    if facts.unit_path:
        checks.append(Check("instance.unit", "ok", f"unit {UNIT_TEMPLATE} installed",
                            {"path": str(facts.unit_path)}))
    else:
        checks.append(Check("instance.unit", "warn", f"{UNIT_TEMPLATE} is not installed here",
                            {"searched": [str(d) for d in UNIT_DIRS]}))
    if facts.env_image:
        checks.append(Check("instance.env", "ok", f"VLLM_IMAGE={facts.env_image}",
                            {"path": str(facts.env_path)}))
    elif facts.env_path:
        checks.append(Check("instance.env", "fail", "env file has no VLLM_IMAGE",
                            {"path": str(facts.env_path)}))
    else:
        checks.append(Check("instance.env", "warn", f"no env file for instance {instance}",
                            {"expected": str(ENV_DIR / f"{instance}.env")}))
    name = container_name(instance)
    if facts.docker_error:
        checks.append(Check("instance.container", "warn", "cannot ask Docker",
                            {"error": facts.docker_error}))
    elif facts.container_status is None:
        status: Status = "fail" if facts.env_image else "warn"
        checks.append(Check("instance.container", status, f"no container {name}", {}))
    else:
        ev = {"container": name, "state": facts.container_status,
              "image": facts.container_image, "env_image": facts.env_image,
              "labels": {k: v for k, v in (facts.image_labels or {}).items()
                         if k.startswith("io.gemma4-appliance") or k == image_labels.VERSION}}
        if facts.container_status != "running":
            checks.append(Check("instance.container", "fail",
                                f"{name} is {facts.container_status}", ev))
        elif facts.env_image and facts.container_image != facts.env_image:
            checks.append(Check("instance.container", "fail",
                                f"running image {facts.container_image} is not VLLM_IMAGE "
                                f"{facts.env_image} (restart the unit to apply it)", ev))
        else:
            checks.append(Check("instance.container", "ok", f"{name} runs {facts.container_image}",
                                ev))
    return checks


# --- GPUs ---------------------------------------------------------------------------------


def visible_gpus(runner: Callable[[list[str]], str] | None = None) -> list[str] | None:
    """GPU names from ``nvidia-smi -L``; ``None`` when nvidia-smi is missing or fails."""
    if runner is None:
        if shutil.which("nvidia-smi") is None:
            return None

        def runner(cmd: list[str]) -> str:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                                  check=True).stdout
    try:
        out = runner(["nvidia-smi", "-L"])
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def _gpu_check(profile: Profile) -> Check:
    hw = profile.hardware
    if hw.device != "cuda":
        return Check("host.gpus", "ok", f"profile {profile.name} runs on {hw.device}: no GPU needed",
                     {})
    gpus = visible_gpus()
    ev = {"needed": hw.gpus, "gpu_name": hw.gpu_name, "visible": gpus}
    if not gpus:
        return Check("host.gpus", "fail", f"profile {profile.name} needs {hw.gpus} GPU(s); "
                     "none visible (nvidia-smi missing or failing)", ev)
    if len(gpus) < hw.gpus:
        return Check("host.gpus", "fail", f"{len(gpus)} GPU(s) visible, profile needs {hw.gpus}",
                     ev)
    if hw.gpu_name and not all(hw.gpu_name in g for g in gpus[: hw.gpus]):
        return Check("host.gpus", "warn", f"GPUs are not all {hw.gpu_name}", ev)
    return Check("host.gpus", "ok", f"{len(gpus)} GPU(s) visible", ev)


# --- engine ---------------------------------------------------------------------------------


def _version_check(version: str, profile: Profile | None, label_version: str | None) -> Check:
    ev = {"server": version, "profile_min": profile.min_vllm if profile else None,
          "image_label": label_version}
    if profile and version_tuple(version) < version_tuple(profile.min_vllm):
        return Check("vllm.version", "fail",
                     f"vLLM {version} is older than {profile.name} needs ({profile.min_vllm})", ev)
    if profile and profile.mtp and version_tuple(version) < version_tuple(
            image_labels.MTP_MIN_VLLM):
        return Check("vllm.version", "fail",
                     f"vLLM {version} has no Gemma 4 MTP (needs {image_labels.MTP_MIN_VLLM})", ev)
    if label_version and version_tuple(label_version) != version_tuple(version):
        return Check("vllm.version", "fail",
                     f"server says vLLM {version}, image label says {label_version}", ev)
    return Check("vllm.version", "ok", f"vLLM {version}", ev)


def _model_check(models, profile: Profile | None) -> Check:
    ev = {"served": [m.id for m in models],
          "max_model_len": {m.id: m.max_model_len for m in models}}
    if profile is None:
        return Check("model.served", "ok", f"serving {', '.join(ev['served'])}", ev)
    want = profile.served_model_name
    ev["profile_model"] = want
    ev["profile_max_model_len"] = profile.max_model_len
    match = next((m for m in models if m.id == want), None)
    if match is None:
        return Check("model.served", "fail", f"{want} is not served", ev)
    if profile.max_model_len and match.max_model_len != profile.max_model_len:
        return Check("model.served", "warn", f"{want} max_model_len {match.max_model_len}, "
                     f"profile says {profile.max_model_len}", ev)
    return Check("model.served", "ok", f"{want} served, max_model_len {match.max_model_len}", ev)


def _generate(base_url: str, model: str, timeout: float, api_key: ApiKey | None) -> dict:
    """One short greedy, non-streamed generation; returns the response body."""
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "appliance doctor: say hello."}]}
    headers = {"Authorization": f"Bearer {api_key.value}"} if api_key else {}
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=timeout)
    if resp.status_code == 401:
        raise EngineError(f"{base_url}/v1/chat/completions answered 401: the API key is "
                          "missing or wrong")
    resp.raise_for_status()
    return resp.json()


def _metrics_failure(exc: Exception) -> Check:
    """/metrics could not be read or parsed: the counters cannot be judged."""
    if isinstance(exc, specdecode.MetricsParseError):
        return Check("mtp.counters", "fail", "/metrics is unparsable",
                     {"state": "unparsable", "error": str(exc)})
    return Check("mtp.counters", "fail", f"cannot read /metrics: {exc}",
                 {"state": "unreadable", "error": str(exc)})


def _mtp_checks(client: VLLMClient, model: str, profile: Profile | None, generate: bool,
                timeout: float, api_key: ApiKey | None) -> list[Check]:
    want_mtp = profile.mtp if profile else None
    try:
        before = specdecode.parse(client.metrics_text())
    except (specdecode.MetricsParseError, EngineError) as exc:  # timeout, non-200, garbage
        return [_metrics_failure(exc)]
    k = profile.speculative.num_speculative_tokens if profile and profile.speculative else None
    if not generate:
        state = "present" if before.speculative else "absent"
        status: Status = "ok" if before.speculative == bool(want_mtp) or want_mtp is None else "fail"
        return [Check("mtp.counters", status, f"speculative-decoding counters {state} "
                      "(no generation sent)", {"state": state})]
    try:
        body = _generate(client.base_url, model, timeout, api_key)
    except (httpx.HTTPError, ValueError, EngineError) as exc:
        return [Check("mtp.counters", "fail", f"the test generation failed: {exc}",
                      {"state": "unknown"})]
    try:
        after = specdecode.parse(client.metrics_text())
    except (specdecode.MetricsParseError, EngineError) as exc:
        return [_metrics_failure(exc)]
    d = specdecode.delta(before, after)
    ev = {"drafts": d.drafts, "draft_tokens": d.draft_tokens, "accepted": d.accepted,
          "acceptance": d.acceptance, "tokens_per_step": d.tokens_per_step,
          "per_position": d.per_position, "other_requests_running": before.running or 0,
          "completion_tokens": (body.get("usage") or {}).get("completion_tokens")}
    if d.status == "absent":
        ev["state"] = "absent"
        if want_mtp:
            chk = Check("mtp.counters", "fail", f"MTP absent: profile {profile.name} asks for it "
                        "but the server has no speculative-decoding counters", ev)
        elif want_mtp is False:
            chk = Check("mtp.counters", "ok", f"MTP absent, as profile {profile.name} says", ev)
        else:
            chk = Check("mtp.counters", "warn", "MTP absent: no speculative-decoding counters", ev)
    elif d.status == "reset":
        ev["state"] = "unknown"
        chk = Check("mtp.counters", "warn", "counters reset during the check (server restarted?)",
                    ev)
    elif not d.drafts:
        ev["state"] = "idle"
        chk = Check("mtp.counters", "fail" if want_mtp is not False else "warn",
                    "MTP idle: counters present but nothing drafted for a real generation", ev)
    else:
        ev["state"] = "active"
        if not d.accepted:
            chk = Check("mtp.counters", "warn", "MTP active but no draft token accepted "
                        "(wrong drafter for this target?)", ev)
        elif want_mtp is False:
            chk = Check("mtp.counters", "warn", f"MTP active, but profile {profile.name} has "
                        "no speculative decoding", ev)
        else:
            chk = Check("mtp.counters", "ok", f"MTP active: {d.tokens_per_step:.2f} tokens/step, "
                        f"acceptance {d.acceptance:.2f}", ev)
    if k is not None and d.accepted_per_pos and len(d.accepted_per_pos) != k:
        chk = Check(chk.name, "warn" if chk.status == "ok" else chk.status,
                    chk.summary + f"; {len(d.accepted_per_pos)} draft positions, profile k={k}",
                    ev)
    checks = [chk]
    per_req = specdecode.from_response_metrics(body)
    wanted = bool(profile and profile.per_request_spec_decode_metrics)
    if per_req is not None:
        checks.append(Check("mtp.per_request_metrics", "ok", "per-request metrics available",
                            {"drafts": per_req.drafts, "accepted": per_req.accepted}))
    elif d.status == "absent":
        checks.append(Check("mtp.per_request_metrics", "ok",
                            "not applicable: no speculative decoding", {}))
    else:
        checks.append(Check("mtp.per_request_metrics", "warn" if wanted else "ok",
                            "per-request metrics not available: per-call figures come from "
                            "/metrics deltas (exact only without overlapping load)", {}))
    return checks


def run(
    url: str,
    *,
    profile: Profile | None = None,
    instance: str | None = None,
    root: Path = Path("/"),
    generate: bool = True,
    timeout: float = 60.0,
    docker_client=None,
    api_key: ApiKey | str | None = None,
) -> DoctorReport:
    """Run every check that applies and return the report (never raises for a failed check).

    Without ``api_key``, an ``instance``'s key file under ``root`` is used when it exists.
    Raises UsageError for an invalid instance name or an unreadable key file.
    """
    base = normalise_base_url(url)
    checks: list[Check] = []
    if instance is not None:
        check_instance(instance)
    if isinstance(api_key, str):
        api_key = ApiKey(api_key, "api_key argument") if api_key.strip() else None
    if api_key is None:
        api_key = resolve_api_key(instance=instance, root=root)
    key_note = f"sent (from {api_key.source})" if api_key else "none sent"
    facts = instance_facts(instance, root, docker_client) if instance else None
    with VLLMClient(base, timeout=10.0, api_key=api_key.value if api_key else None) as client:
        healthy = False
        try:
            status = httpx.get(base + "/health", timeout=10.0).status_code
        except httpx.HTTPError as exc:
            checks.append(Check("engine.reachable", "fail",
                                f"cannot reach {base}: {type(exc).__name__}: {exc}",
                                {"url": base}))
        else:
            healthy = status == 200
            if not healthy:
                try:
                    client.version()
                    why = "vLLM answers /version but is not ready"
                except EngineError as exc:  # NotVLLMError included
                    why = f"not a vLLM server ({exc})"
                checks.append(Check("engine.reachable", "fail",
                                    f"{base}/health answered {status}: {why}",
                                    {"url": base, "status": status}))
        if healthy:
            checks.append(Check("engine.reachable", "ok", f"{base}/health is 200", {"url": base}))
            try:
                version = client.version()
                models = client.models()
            except (NotVLLMError, EngineError) as exc:
                checks.append(Check("engine.vllm", "fail", str(exc),
                                    {"url": base, "api_key": key_note}))
            else:
                label_v = image_labels.vllm_version(facts.image_labels) if facts else None
                checks.append(_version_check(version, profile, label_v))
                checks.append(_model_check(models, profile))
                model = (profile.served_model_name if profile and any(
                    m.id == profile.served_model_name for m in models) else models[0].id)
                checks += _mtp_checks(client, model, profile, generate, timeout, api_key)
                if facts and facts.image_labels and profile and profile.mtp \
                        and not image_labels.supports_mtp(facts.image_labels):
                    checks.append(Check("instance.labels", "fail", "profile asks for MTP but the "
                                        "running image is not labelled as MTP-capable",
                                        {"labels": facts.image_labels}))
    if facts:
        checks += _instance_checks(instance, facts)
    if profile:
        checks.append(_gpu_check(profile))
    return DoctorReport(base, checks)
