"""Doctor's checks of the host: the installed instance (unit, env file, models, container) and
GPUs."""

from __future__ import annotations

from pathlib import Path

from .. import models
from ..errors import ApplianceError
from ..host import reach
from ..host.layout import ENV_DIR
from ..host.values import LOOPBACK
from ..hostcheck import nvidia as hostcheck_nvidia
from ..instance.instance_facts import UNIT_DIRS, InstanceFacts
from ..models import verify, where
from ..oci import labels as image_labels
from ..profiles import Profile
from ..units.instance import Instance
from .report import Check, Status


def instance_checks(instance: str, facts: InstanceFacts, root: Path = Path("/")) -> list[Check]:
    """The unit is installed, the env file is complete and names an image, the models are
    there, the container runs that image."""
    checks = []
    template = facts.unit_template
    if facts.unit_path:
        checks.append(
            Check(
                "instance.unit",
                "ok",
                f"unit {template} installed",
                {"path": str(facts.unit_path), "unit": facts.unit},
            )
        )
    else:
        checks.append(
            Check(
                "instance.unit",
                "warn",
                f"{template} is not installed here",
                {"searched": [str(d) for d in UNIT_DIRS], "unit": facts.unit},
            )
        )
    if facts.env_error:
        checks.append(
            Check(
                "instance.env",
                "fail",
                f"unreadable env file: {facts.env_error}",
                {"path": str(facts.env_path)},
            )
        )
    elif facts.record_error:
        # The serve program refuses to start on this too: it is a failure, not a detail.
        checks.append(
            Check(
                "instance.env",
                "fail",
                f"incomplete env file: {facts.record_error}",
                {"path": str(facts.env_path), "image": facts.env_image},
            )
        )
    elif facts.env_image:
        checks.append(
            Check(
                "instance.env", "ok", f"VLLM_IMAGE={facts.env_image}", {"path": str(facts.env_path)}
            )
        )
    elif facts.env_path:
        checks.append(
            Check(
                "instance.env", "fail", "env file has no VLLM_IMAGE", {"path": str(facts.env_path)}
            )
        )
    else:
        checks.append(
            Check(
                "instance.env",
                "warn",
                f"no env file for instance {instance}",
                {"expected": str(ENV_DIR / f"{instance}.env")},
            )
        )
    if facts.record is not None:
        checks.append(models_check(facts.record, root))
        checks.append(api_key_check(facts.record))
    checks.append(_container_check(facts))
    return checks


def models_check(inst: Instance, root: Path = Path("/")) -> Check:
    """``instance.models``: the instance's target and drafter are on this host and complete, by
    ``appliance models verify --quick`` (sizes and safetensors headers, no hashing); the check
    the serve program makes before every start, with the command that fixes it."""
    profile = inst.profile
    try:
        if profile.uses_devmodel:
            value = inst.env.get("MODEL_DIR")
            if not value:
                return Check("instance.models", "fail", f"MODEL_DIR is not set in {inst.env_path}")
            model_dir = where.under_root(root, value)
            report = verify.verify_model_dir(model_dir, where.dir_specs(profile), quick=True)
            fix = models.model_dir_fix(str(inst.env_path))
            ev: dict = {"model_dir": str(model_dir)}
        else:
            loc = where.locate(root=root, instance=inst.name, env=inst.env, profile=profile)
            report = verify.verify(loc, quick=True)
            fix = loc.fix()
            ev = {"hf_cache_dir": str(loc.hf_home)}
    except ApplianceError as exc:
        return Check("instance.models", "fail", str(exc), {})
    ev["full_check"] = f"appliance models verify {inst.name}"
    if report.ok:
        return Check("instance.models", "ok", report.summary(), ev)
    summary = report.one_line(fix)  # the problems (the first three) and the fix, once
    if any(p.line() not in summary for p in report.problems):
        ev["problems"] = [p.line() for p in report.problems]
    return Check("instance.models", "fail", summary, ev)


def api_key_check(inst: Instance) -> Check:
    """``instance.api_key``: the key file the serve program hands vLLM is there. Without it the
    serve program refuses to start on an address beyond loopback, and on loopback vLLM takes
    any caller on this host (appliance/serve/main.py, ``key``)."""
    path = inst.api_key_path
    ev = {"path": str(path)}
    if path.exists():
        return Check("instance.api_key", "ok", f"{path} is there", ev)
    fix = f"appliance instance install {inst.name} writes one"
    if inst.host in LOOPBACK:
        why = f"vLLM on {inst.host} accepts any caller on this host ({fix})"
        return Check("instance.api_key", "warn", f"no API key file {path}: {why}", ev)
    why = f"the serve program refuses to start on {inst.host} without one ({fix})"
    return Check("instance.api_key", "fail", f"no API key file {path}: {why}", ev)


def _container_check(facts: InstanceFacts) -> Check:
    name = facts.container
    if facts.docker_error:
        said = reach.NOT_ASKED if reach.unasked(facts.docker_error) else "cannot ask Docker"
        return Check(
            "instance.container", "warn", said, {"container": name, "error": facts.docker_error}
        )
    if facts.container_status is None:
        status: Status = "fail" if facts.env_image else "warn"
        return Check("instance.container", status, f"no container {name}", {})
    ev = {
        "container": name,
        "state": facts.container_status,
        "image": facts.container_image,
        "env_image": facts.env_image,
        "labels": {
            k: v
            for k, v in (facts.image_labels or {}).items()
            if k.startswith("io.gemma4-appliance") or k == image_labels.VERSION
        },
    }
    if facts.container_status != "running":
        return Check("instance.container", "fail", f"{name} is {facts.container_status}", ev)
    if facts.env_image and facts.container_image != facts.env_image:
        return Check(
            "instance.container",
            "fail",
            f"running image {facts.container_image} is not VLLM_IMAGE "
            f"{facts.env_image} (restart the unit to apply it)",
            ev,
        )
    return Check("instance.container", "ok", f"{name} runs {facts.container_image}", ev)


def gpu_check(profile: Profile, gpu_query=None) -> Check:
    """``host.gpus``: the host check's GPU findings (appliance/hostcheck/nvidia.py), as one
    check: the worst of them, a blocker being a failure."""
    findings = hostcheck_nvidia.gpu_findings(profile, gpu_query)
    rank = {"ok": 0, "warn": 1, "blocker": 2}
    worst = max(findings, key=lambda f: rank[f.status])
    status: Status = {"ok": "ok", "warn": "warn", "blocker": "fail"}[worst.status]
    summary = worst.message if worst.status != "ok" else "; ".join(f.message for f in findings)
    ev = {"needed": profile.hardware.gpus, "gpu_name": profile.hardware.gpu_name}
    ev["findings"] = [f.line() for f in findings]
    return Check("host.gpus", status, summary, ev)
