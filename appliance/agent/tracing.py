"""A TracerProvider from the standard ``OTEL_*`` variables, exporting OTLP/HTTP by default.

Read by the SDK itself: ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES`` (the resource),
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._HEADERS``,
``..._TIMEOUT`` (the exporter). Read here: ``OTEL_EXPORTER_OTLP_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``http/protobuf`` default, or ``grpc``) and
``OTEL_TRACES_EXPORTER`` (``otlp`` default, ``console`` or ``none``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from ..errors import UsageError

_log = logging.getLogger(__name__)
DEFAULT_SERVICE = "gemma4-agent"
# At interpreter exit, the provider's last export gets this long. Unbounded, a process whose
# collector is down waited out the exporter's retries (7.5 s measured) before it could exit.
EXIT_EXPORT_S = 2.0


def exporting(env: dict[str, str] | None = None) -> bool:
    """True when the environment names an OTLP endpoint to export spans to."""
    env = os.environ if env is None else env
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(env: dict[str, str] | None = None) -> TracerProvider:
    """A provider configured from the environment (not made global: the caller decides)."""
    env = dict(os.environ if env is None else env)
    if not env.get("OTEL_SERVICE_NAME"):
        env["OTEL_SERVICE_NAME"] = DEFAULT_SERVICE
    # Resource.create() reads only os.environ; merge what ``env`` says over its defaults.
    resource = Resource.create().merge(_resource_from(env))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    atexit.register(_bounded_shutdown, provider)
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return provider
    if kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        return provider
    if kind != "otlp":
        raise UsageError(
            f"OTEL_TRACES_EXPORTER={kind!r} is not supported", fix="otlp, console or none"
        )
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    elif protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        raise UsageError(
            f"OTLP protocol {protocol!r} is not supported", fix="http/protobuf or grpc"
        )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(**_endpoint(env, protocol))))
    return provider


def _bounded_shutdown(provider: TracerProvider, bound: float = EXIT_EXPORT_S) -> None:
    """Shut ``provider`` down at exit, waiting at most ``bound`` seconds for its last export:
    a span the collector did not take by then is lost, the process exits anyway."""
    worker = threading.Thread(target=provider.shutdown, name="otel-exit-flush", daemon=True)
    worker.start()
    worker.join(bound)
    if worker.is_alive():
        _log.warning(
            "exiting without the last spans: the collector took no export within %.1f s", bound
        )


def _resource_from(env: dict[str, str]) -> Resource:
    attrs: dict[str, str] = {}
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attrs[key.strip()] = value.strip()
    attrs["service.name"] = env["OTEL_SERVICE_NAME"]  # the service name variable wins
    return Resource(attrs)


def _endpoint(env: dict[str, str], protocol: str) -> dict:
    """The exporter's endpoint from ``env`` (the exporters read only ``os.environ``)."""
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return {"endpoint": traces}
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return {}
    if protocol == "http/protobuf":
        # Per the OTLP exporter spec the signal path is appended to the generic endpoint.
        return {"endpoint": base.rstrip("/") + "/v1/traces"}
    return {"endpoint": base}
