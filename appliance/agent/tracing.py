"""A TracerProvider from the standard ``OTEL_*`` variables, exporting OTLP/HTTP by default.

Read by the SDK itself, from the process's environment: ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (the resource: ``Resource.create()``, which percent-decodes the
values; the service name is ``gemma4-agent`` where neither names one), and
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._HEADERS``,
``..._TIMEOUT`` (the exporter). Read here: ``OTEL_EXPORTER_OTLP_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``http/protobuf`` default, to a collector's port 4318, or
``grpc``, its port 4317, with the ``otlp-grpc`` extra) and ``OTEL_TRACES_EXPORTER`` (``otlp``
default, ``console`` or ``none``).

The OpenTelemetry SDK and the OTLP exporters are the application's choice, as in the upstream
instrumentations: the agent itself needs only the API. They come with the ``otlp`` extra (and
``otlp-grpc``), and are imported here only when a provider is built; without them,
:func:`setup_tracing` raises one line naming the extra.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
from typing import TYPE_CHECKING

from opentelemetry import trace

from ..errors import UsageError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

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


# What installs the SDK and the default (OTLP/HTTP) exporter.
OTLP_EXTRA = "pip install 'gemma4-appliance[otlp]'"


def sdk_installed() -> bool:
    """Whether the OpenTelemetry SDK can be imported (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except ModuleNotFoundError:
        return False


def _sdk_trace():
    """``opentelemetry.sdk.trace``; one line naming the extra when the SDK is not installed."""
    try:
        return importlib.import_module("opentelemetry.sdk.trace")
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"exporting spans needs the OpenTelemetry SDK, which is not installed: no module "
            f"named {exc.name!r}",
            fix=OTLP_EXTRA,
        ) from None


def setup_tracing(env: dict[str, str] | None = None) -> TracerProvider:
    """A provider configured from the environment (not made global: the caller decides).

    ``env`` (``os.environ`` by default) holds the exporter's settings; the resource is the
    SDK's own reading of the process's environment (:func:`resource`)."""
    sdk = _sdk_trace()
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = dict(os.environ if env is None else env)
    exporter = _exporter(env)  # first: a setting it refuses leaves no provider behind
    resource = _resource()
    provider = sdk.TracerProvider(resource=resource, shutdown_on_exit=False)
    atexit.register(_bounded_shutdown, provider)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter(env: dict[str, str]) -> SpanExporter | None:
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise UsageError(
            f"OTEL_TRACES_EXPORTER={kind!r} is not supported", fix="otlp, console or none"
        )
    protocol = _protocol(env)
    return _exporter_class(protocol)(**_endpoint(env, protocol))


def own_provider() -> trace.TracerProvider:
    """:func:`setup_tracing` for a program that did not ask for it (the zero-code launcher):
    never raises, as a telemetry setting must not stop the application. A setting it cannot
    follow is logged as one line, and the spans are then dropped. Without the SDK and with no
    endpoint named (a program that wants the metrics only), the spans are dropped silently."""
    if not sdk_installed() and not exporting():
        return trace.NoOpTracerProvider()
    try:
        return setup_tracing()
    except UsageError as exc:
        _log.warning("spans are not exported: %s", exc)
        if not sdk_installed():
            return trace.NoOpTracerProvider()
        return _sdk_trace().TracerProvider(shutdown_on_exit=False)


# protocol -> (the exporter's module, what installs it). Each is an extra with the SDK: the
# agent needs neither (the application picks them); the gRPC one brings grpcio (18 MB installed).
EXPORTERS = {
    "http/protobuf": (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        OTLP_EXTRA,
    ),
    "grpc": (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "pip install 'gemma4-appliance[otlp-grpc]'",
    ),
}


def _protocol(env: dict[str, str]) -> str:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(var, "").strip().lower()
        if not value:
            continue
        if value == "http/json":  # a spec value, which no Python exporter implements
            raise UsageError(
                f"{var}=http/json is not supported: Python's OTLP exporters send protobuf only",
                fix="use http/protobuf, the default, to a collector's port 4318, or grpc to 4317",
            )
        if value not in EXPORTERS:
            raise UsageError(f"{var}={value!r} is not supported", fix="http/protobuf or grpc")
        return value
    return "http/protobuf"


def _exporter_class(protocol: str) -> type:
    """The protocol's ``OTLPSpanExporter``; one line naming what to install when it is not."""
    module, install = EXPORTERS[protocol]
    try:
        return importlib.import_module(module).OTLPSpanExporter
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"OTLP over {protocol} needs an exporter that is not installed: no module named "
            f"{exc.name!r}",
            fix=install,
        ) from None


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


def _resource():
    """The SDK's resource (``OTEL_RESOURCE_ATTRIBUTES`` parsed and percent-decoded by the SDK,
    ``OTEL_SERVICE_NAME`` over it), named ``gemma4-agent`` where neither names the service."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    resource = Resource.create()
    if SERVICE_NAME not in OTELResourceDetector().detect().attributes:
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE}))
    return resource


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
