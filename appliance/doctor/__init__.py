"""``appliance instance doctor``: is this appliance serving what it should, with MTP actually
working?

Every check is a :class:`Check` record (``ok`` / ``warn`` / ``fail``, a one-line summary and the
evidence it was based on). Doctor never changes anything: it reads ``/health``, ``/version``,
``/v1/models``, and runs the MTP probe (:mod:`appliance.engine_api.probe`: counters, one short
generation unless ``generate=False``, sent again while the engine turns it away at its queue bound,
counters again); with an instance it reads the instance's files
(:mod:`appliance.instance.instance_facts`), checks its models as the serve program does before every
start (:func:`appliance.models.verify.verify` quick) and asks Docker. The published vLLM defects
that apply to the profile on the server's version are one warning each (``vllm.defect.ID``). ``/v1``
calls carry the API key (:func:`appliance.host.apikey.resolve`); the key is never printed or put
into the report.

One job per module: ``report`` (the records), ``engine`` (vLLM, model, MTP), ``host`` (the
installed instance and GPUs); this module runs them in order.
"""

from __future__ import annotations

from pathlib import Path

from ..engine_api import probe
from ..engine_api.vllm_client import VLLMClient, normalise_base_url
from ..errors import EngineError
from ..host import apikey, reach
from ..instance import instance_facts
from ..oci import labels as image_labels
from ..profiles import Profile
from ..units import check_instance
from .engine import defect_checks, model_check, mtp_checks, version_check
from .host import gpu_check, instance_checks
from .report import Check, DoctorReport, Status

__all__ = ["Check", "DoctorReport", "Status", "run"]


def run(
    url: str,
    *,
    profile: Profile | None = None,
    instance: str | None = None,
    root: Path = Path("/"),
    generate: bool = True,
    timeout: float = 60.0,
    docker_client=None,
    api_key: apikey.ApiKey | str | None = None,
    ask_engine: bool = True,
    gpu_query=None,
) -> DoctorReport:
    """Run every check that applies and return the report (never raises for a failed check).

    Without ``api_key``, an ``instance``'s key file under ``root`` is used when it exists.
    ``ask_engine`` False: ``url`` is a tree's port on this host (host/reach.py), not asked; nor
    are this host's GPUs for a tree that is not the host. Raises UsageError for an invalid
    instance name or an unreadable key file.
    """
    base = normalise_base_url(url)
    if instance is not None:
        check_instance(instance)
    if isinstance(api_key, str):
        api_key = apikey.ApiKey(api_key, "api_key argument") if api_key.strip() else None
    if api_key is None:
        api_key = apikey.resolve(instance=instance, root=root)
    facts = instance_facts.read(instance, root, docker_client) if instance else None
    checks: list[Check] = []
    if ask_engine:
        with VLLMClient(base, timeout=10.0, api_key=api_key.value if api_key else None) as client:
            if _reachable(client, checks):
                checks += _engine_checks(client, profile, facts, generate, timeout, api_key)
    else:
        why = reach.why_not(root, reach.PORT_NOT) + " (give --url)"
        checks.append(Check("engine.reachable", "warn", why, {"url": base}))
    if facts:
        checks += instance_checks(instance, facts, root)
    asks_gpus = profile is not None and profile.hardware.device == "cuda"
    if profile and (not asks_gpus or gpu_query is not None or reach.gpus(root)):
        checks.append(gpu_check(profile, gpu_query))
    elif profile:
        why = reach.why_not(root, reach.GPUS_NOT)
        checks.append(Check("host.gpus", "warn", why, {"needed": profile.hardware.gpus}))
    return DoctorReport(base, checks)


def _reachable(client: VLLMClient, checks: list[Check]) -> bool:
    """``engine.reachable``: ``/health`` answers 200 (it needs no key)."""
    base = client.base_url
    try:
        status = client.health_status()
    except EngineError as exc:
        checks.append(Check("engine.reachable", "fail", str(exc), {"url": base}))
        return False
    if status == 200:
        checks.append(Check("engine.reachable", "ok", f"{base}/health is 200", {"url": base}))
        return True
    try:
        client.version()
        why = "vLLM answers /version but is not ready"
    except EngineError as exc:  # NotVLLMError included
        why = f"not a vLLM server ({exc})"
    checks.append(
        Check(
            "engine.reachable",
            "fail",
            f"{base}/health answered {status}: {why}",
            {"url": base, "status": status},
        )
    )
    return False


def _engine_checks(
    client: VLLMClient,
    profile: Profile | None,
    facts,
    generate: bool,
    timeout: float,
    api_key: apikey.ApiKey | None,
) -> list[Check]:
    try:
        version = client.version()
        models = client.models()
    except EngineError as exc:  # NotVLLMError and AuthError included
        note = f"sent (from {api_key.source})" if api_key else "none sent"
        return [Check("engine.vllm", "fail", str(exc), {"url": client.base_url, "api_key": note})]
    label_v = image_labels.vllm_version(facts.image_labels) if facts else None
    checks = [version_check(version, profile, label_v), *defect_checks(version, profile)]
    checks.append(model_check(models, profile))
    served = [m.id for m in models]
    if not served:
        return checks  # nothing to generate with; model.served already says so
    model = (
        profile.served_model_name if profile and profile.served_model_name in served else served[0]
    )
    # An engine at its queue bound turns the test generation away (503): it is serving, so the
    # probe asks again within ``timeout`` (appliance.engine_api.shed), and the check says how often.
    p = probe.run(client, model, generate=generate, timeout=timeout, within=timeout)
    checks += mtp_checks(p, profile)
    if (
        facts
        and facts.image_labels
        and profile
        and profile.mtp
        and not image_labels.supports_mtp(facts.image_labels)
    ):
        checks.append(
            Check(
                "instance.labels",
                "fail",
                "profile asks for MTP but the running image is not labelled as MTP-capable",
                {"labels": facts.image_labels},
            )
        )
    return checks
