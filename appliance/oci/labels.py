"""The OCI labels an appliance image carries, and what they mean.

One contract shared by the image builder (which writes them), the serve program (which reads them
with ``docker image inspect`` at every start) and the cutover checks. The serve program adds the
Gemma 4 MTP speculative config only when ``MTP`` is ``"true"``, so pointing ``VLLM_IMAGE`` at a
``pre-mtp`` image is a safe rollback: the same unit serves it without speculative decoding.

The image's ENTRYPOINT is ``vllm serve`` (as in the official ``vllm/vllm-openai`` image): the
serve program passes the model and flags as the container's arguments.
"""

from __future__ import annotations

from collections.abc import Mapping

# The image's own version (the appliance tag scheme: "<vllm>-mtp", "pre-mtp", ...).
VERSION = "org.opencontainers.image.version"
# The vLLM version inside the image, e.g. "0.21.0".
VLLM_VERSION = "io.gemma4-appliance.vllm.version"
# "true" when the image's vLLM serves Gemma 4 MTP (vLLM >= 0.21, PR #41745), else "false".
MTP = "io.gemma4-appliance.mtp"
# Which build of vLLM the image holds: "cpu" (docker/cpu/Dockerfile) or "cuda" (docker/Dockerfile),
# what a profile's ``[hardware] device`` must be. Written by every appliance Dockerfile since the
# first; the builder checks it against the target it built. An image without it (made by hand)
# is judged by its other labels only, with a warning (appliance/images/variant.py).
VARIANT = "io.gemma4-appliance.variant"
VARIANTS = ("cpu", "cuda")
# Set on containers (not images) by the serve program: which unit instance runs the container.
INSTANCE = "io.gemma4-appliance.instance"
# "true" when the image's entry point (docker/entrypoint.sh) reads the API key from its stdin
# when ``API_KEY_STDIN_ENV=1`` (the serve program runs ``docker run -i`` with the key file as
# stdin), or from a secret file mounted at ``API_KEY_PATH``, so the key never enters the
# container's config (``docker inspect``). An image without it gets the key as ``--env
# VLLM_API_KEY`` (the old path, kept so a rollback to an image built by an older appliance still
# serves with its key). gotchas/api-key-scope.md.
API_KEY_STDIN = "io.gemma4-appliance.api-key-stdin"
API_KEY_STDIN_ENV = "GEMMA4_API_KEY_STDIN"
API_KEY_PATH = "/run/secrets/vllm-api-key"
# "true" when the image carries the stop gate (appliance/engine/stop_gate.py) beside its entry
# point: the serve program passes ``--middleware STOP_GATE_MIDDLEWARE``, and from the SIGTERM on
# vLLM answers new requests and /health with 503 while the requests in flight drain. An image
# without it (built by an older appliance) turns them away with vLLM's HTTP 500.
STOP_GATE = "io.gemma4-appliance.stop-gate"
STOP_GATE_MIDDLEWARE = "stop_gate.StopGate"

TRUE = "true"
FALSE = "false"

# The first vLLM release with the ``mtp`` speculative method for Gemma 4 (PR #41745).
MTP_MIN_VLLM = "0.21.0"
# The first vLLM release with ``--per-request-spec-decode-metrics``.
PER_REQUEST_METRICS_MIN_VLLM = "0.32.0"
# The first vLLM release with ``--max-num-queued-reqs`` (PR #49445; the v0.29.0 release notes).
QUEUE_BOUND_MIN_VLLM = "0.29.0"
# The first vLLM release with ``--shutdown-timeout`` (PR #36666): SIGTERM lets in-flight requests
# finish for that long. Its default, 0, aborts them; before it, SIGTERM ended vLLM at once.
DRAIN_MIN_VLLM = "0.18.0"


def supports_mtp(labels: Mapping[str, str] | None) -> bool:
    """True only when the image says outright that it serves Gemma 4 MTP (absent means no)."""
    return (labels or {}).get(MTP, "").strip().lower() == TRUE


def reads_api_key_stdin(labels: Mapping[str, str] | None) -> bool:
    """True when the image's entry point reads the API key from its stdin (``API_KEY_STDIN``)."""
    return (labels or {}).get(API_KEY_STDIN, "").strip().lower() == TRUE


def has_stop_gate(labels: Mapping[str, str] | None) -> bool:
    """True when the image carries the stop gate (``STOP_GATE``)."""
    return (labels or {}).get(STOP_GATE, "").strip().lower() == TRUE


def variant(labels: Mapping[str, str] | None) -> str | None:
    """The labelled build (``cpu`` or ``cuda``), or None when the image does not say."""
    value = (labels or {}).get(VARIANT, "").strip().lower()
    return value or None


def vllm_version(labels: Mapping[str, str] | None) -> str | None:
    """The labelled vLLM version, or None when the image does not say."""
    value = (labels or {}).get(VLLM_VERSION, "").strip()
    return value or None
