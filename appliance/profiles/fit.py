"""Does a profile fit its GPUs? Weights + drafter + KV cache, per GPU, at its memory utilisation.

The KV cache is sized as vLLM 0.32 sizes it: at start one request of ``max_model_len`` must fit
(``check_enough_kv_cache_memory`` in vllm/v1/core/kv_cache_utils.py sums each layer's
``max_memory_usage_bytes``); a sliding-window layer holds ``window - 1`` tokens plus the tokens
in flight, ``max_num_batched_tokens`` per concurrent batch, and MTP runs 2 batches at once
(asynchronous scheduling, ``VllmConfig.max_in_flight_tokens`` in vllm/config/vllm.py; the
``SlidingWindowSpec`` in vllm/v1/kv_cache_interface.py); a global layer holds every token. Each
further sequence the profile plans for is counted at decode: its window, and all its tokens on
the global layers. The Gemma 4 drafter keeps no cache of its own (it reads the target's).

What vLLM also keeps (activations of a ``max_num_batched_tokens`` batch, CUDA graphs, the CUDA
context) is an allowance, :data:`OVERHEAD_GIB`, not a measurement: the fit is an estimate that
errs on the side of not fitting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .catalog import GIB, Attention, Checkpoint, Model

DEFAULT_UTILIZATION = 0.90  # vLLM's gpu_memory_utilization when a profile leaves it unset
OVERHEAD_GIB = 3.0  # per GPU: activations, CUDA graphs, CUDA context (an allowance)
BLOCK = 16  # vLLM's KV block: a request's blocks round up, plus one for a window's start
IN_FLIGHT_BATCHES = 2  # asynchronous scheduling with MTP: two batches in flight
# What a generated profile keeps free per GPU beyond the overhead allowance: the allowance is an
# estimate, so a fit that only just holds is a start that may not (the generator refuses it).
MIN_SPARE_GIB = 0.5
# vLLM's automatic max_num_batched_tokens and max_num_seqs when a profile leaves them unset, for
# the OpenAI server (``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py, 0.32): by the
# device's total memory, and an A100 kept at the small values whatever its memory (vllm PR 17885).
LARGE_GPU_GIB = 160
SMALL_GPU_GIB = 70


def _big(gpu_gib: float, gpu_name: str) -> bool:
    return gpu_gib >= SMALL_GPU_GIB and "a100" not in gpu_name.lower()


def auto_batched_tokens(gpu_gib: float, gpu_name: str = "") -> int:
    """vLLM's automatic ``max_num_batched_tokens`` on a GPU of ``gpu_gib`` named ``gpu_name``:
    16384 at 160 GiB and more, 8192 at 70 GiB and more unless it is an A100, else 2048."""
    if gpu_gib >= LARGE_GPU_GIB:
        return 16384
    return 8192 if _big(gpu_gib, gpu_name) else 2048


def auto_max_num_seqs(gpu_gib: float, gpu_name: str = "") -> int:
    """vLLM's automatic ``max_num_seqs`` there: 1024 where the batch is large, else 256."""
    return 1024 if gpu_gib >= LARGE_GPU_GIB or _big(gpu_gib, gpu_name) else 256


def _kv_per_token(a: Attention, tp: int, kv_bytes: int) -> int:
    # Keys and values, each head's vector; heads split over the tensor-parallel ranks, and a
    # rank holds at least one (vLLM replicates KV heads when TP exceeds them).
    return 2 * math.ceil(a.kv_heads / tp) * a.head_dim * kv_bytes


def _tokens(a: Attention, max_model_len: int, in_flight: int) -> int:
    if a.window is None:
        return max_model_len
    return min(a.window - 1 + in_flight, max_model_len) + 2 * BLOCK


def kv_first_gib(
    m: Model, *, tp: int, pp: int, max_model_len: int, batched: int, kv_bytes: int = 2
) -> float:
    """The KV cache of one ``max_model_len`` request on one GPU, as vLLM sizes it at start."""
    in_flight = IN_FLIGHT_BATCHES * batched
    total = sum(
        a.layers * _kv_per_token(a, tp, kv_bytes) * _tokens(a, max_model_len, in_flight)
        for a in m.attention
    )
    return total / pp / GIB


def kv_more_gib(m: Model, *, tp: int, pp: int, max_model_len: int, kv_bytes: int = 2) -> float:
    """The KV cache of each further sequence at decode, on one GPU."""
    total = sum(
        a.layers * _kv_per_token(a, tp, kv_bytes) * _tokens(a, max_model_len, 1)
        for a in m.attention
    )
    return total / pp / GIB


@dataclass(frozen=True)
class Fit:
    """What one GPU holds for a profile, in GiB, against what the engine may use of it."""

    budget_gib: float  # the GPU's memory x gpu_memory_utilization
    weights_gib: float
    drafter_gib: float
    first_gib: float  # one full-length request, as vLLM sizes it at start
    more_gib: float  # each further sequence at decode
    seqs: int
    overhead_gib: float = OVERHEAD_GIB

    @property
    def kv_gib(self) -> float:
        return self.first_gib + (self.seqs - 1) * self.more_gib

    @property
    def used_gib(self) -> float:
        return self.weights_gib + self.drafter_gib + self.overhead_gib + self.kv_gib

    @property
    def fits(self) -> bool:
        return self.used_gib <= self.budget_gib

    @property
    def spare_gib(self) -> float:
        """What is left of the budget (negative: what is missing)."""
        return self.budget_gib - self.used_gib

    @property
    def roomy(self) -> bool:
        """Fits with :data:`MIN_SPARE_GIB` to spare: what a generated profile needs."""
        return self.spare_gib >= MIN_SPARE_GIB

    def line(self) -> str:
        """The arithmetic in one line."""
        kv = f"KV {self.kv_gib:.1f} ({self.first_gib:.1f} for one full request"
        kv += f" + {self.seqs - 1} x {self.more_gib:.2f})" if self.seqs > 1 else ")"
        verb = "<=" if self.fits else ">"
        margin = "spare" if self.fits else "short"
        return (
            f"weights {self.weights_gib:.1f} + drafter {self.drafter_gib:.1f} + overhead "
            f"{self.overhead_gib:.1f} + {kv} = {self.used_gib:.1f} GiB {verb} "
            f"{self.budget_gib:.1f} GiB ({abs(self.spare_gib):.2f} {margin})"
        )


def fit(
    m: Model,
    c: Checkpoint,
    *,
    gpu_gib: float,
    utilization: float,
    tp: int,
    pp: int = 1,
    max_model_len: int,
    max_num_seqs: int,
    batched: int,
    mtp: bool = True,
    kv_bytes: int = 2,
) -> Fit:
    """The fit of checkpoint ``c`` of model ``m`` on GPUs of ``gpu_gib``, per GPU."""
    shards = tp * pp
    return Fit(
        budget_gib=gpu_gib * utilization,
        weights_gib=c.gpu_gib / shards,
        drafter_gib=m.drafter_gib / shards if mtp else 0.0,
        first_gib=kv_first_gib(
            m, tp=tp, pp=pp, max_model_len=max_model_len, batched=batched, kv_bytes=kv_bytes
        ),
        more_gib=kv_more_gib(m, tp=tp, pp=pp, max_model_len=max_model_len, kv_bytes=kv_bytes),
        seqs=max_num_seqs,
    )


def tp_problem(m: Model, tp: int) -> str | None:
    """Why vLLM refuses ``tp`` for model ``m`` (None: it does not): the query heads must divide
    by it, and each kind of KV heads divide by it or it by them (vllm/config/model.py
    ``verify_with_parallel_config``; KV heads fewer than TP are replicated)."""
    if m.heads % tp:
        return f"tensor_parallel_size {tp} does not divide Gemma 4 {m.label}'s {m.heads} heads"
    for a in m.attention:
        if (a.kv_heads % tp) and (tp % a.kv_heads):
            return (
                f"tensor_parallel_size {tp} and Gemma 4 {m.label}'s {a.kv_heads} KV heads "
                "do not divide one another"
            )
    return None
