"""Profile validation: the known Gemma 4 / vLLM pitfalls as errors and warnings naming the fix.

Each rule is one function returning findings; :func:`check` runs them all. An error is a
profile that would fail at start-up (or crash later) on its stated hardware; a warning is one
that runs but is risky. ``appliance instance render``/``install`` refuse a profile with errors, so a
broken combination is caught on the operator's terminal, not after a 471 s model load. The
published vLLM defects by version are data (:mod:`.defects`): one finding per defect that applies.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Literal

from ..engine_api import versions
from ..errors import UsageError
from ..oci import labels
from . import DATA_PARALLEL_MIN_VLLM, DEVMODEL, Profile, catalog, defects
from . import fit as memory

# Gemma 4's largest multimodal item, in tokens (vLLM's max_tokens_per_mm_item for Gemma 4).
GEMMA4_MM_ITEM_TOKENS = 2496
MIN_K, MAX_K = 1, 8
LOOPBACK = {"127.0.0.1", "::1", "localhost"}

# "info": worth knowing, not a risk left open (a defect the profile's own canary checks for).
Level = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One problem in a profile: its level, a stable code, what is wrong, and the fix."""

    level: Level
    code: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level}: [{self.code}] {self.message} (fix: {self.fix})"


class ProfileError(UsageError):
    """A profile with validation errors."""


def _batched_tokens(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    # The tiny dev model is a text-only gemma4_text: it has no multimodal item to fit.
    if p.language_model_only or p.uses_devmodel:
        return
    value, origin = p.max_num_batched_tokens, "max_num_batched_tokens"
    if value is None and p.hardware.device == "cuda":
        # vLLM's own pick by the GPU's name and memory (fit.auto_batched_tokens mirrors
        # arg_utils.py): 2048 on any A100 and under 70 GiB. vLLM 0.32 raises an unset value to
        # the item itself (_set_default_max_num_seqs_and_batched_tokens_args), the 0.21 the
        # profiles allow did not: the seed's first launch failed so.
        gib, name = _gpu(p)
        value = memory.auto_batched_tokens(gib, name)
        origin = (
            f"vLLM's automatic max_num_batched_tokens on {name or 'a GPU'} of "
            f"{p.hardware.gpu_memory_gib:g} GB"
        )
    if value is not None and value < GEMMA4_MM_ITEM_TOKENS:
        yield Finding(
            "error",
            "max-num-batched-tokens",
            f"{origin} ({value}) is below Gemma 4's {GEMMA4_MM_ITEM_TOKENS}-token multimodal "
            "item: vLLM fails at start-up (vllm#42687)",
            "set max_num_batched_tokens = 4096, or language_model_only = true to serve text only",
        )


def _known_defects(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    # The published vLLM defects (defects.toml), one finding each, at the table's level; info
    # where the profile's canary runs the batched pass that checks for the defect.
    checked = p.canary.enabled and p.canary.batched
    for d in defects.applicable(vllm_version, defects.Conditions.of(p)):
        level: Level = "info" if d.canary_checks and checked else d.level
        yield Finding(level, d.id, d.summary(), d.fix)


def _mtp_version(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    if not p.mtp:
        return
    if not versions.has_mtp(p.min_vllm):
        yield Finding(
            "error",
            "mtp-min-vllm",
            f'method "mtp" needs vLLM >= {labels.MTP_MIN_VLLM} (PR #41745), but min_vllm is '
            f"{p.min_vllm}: an older engine fails with \"Unsupported speculative method: 'mtp'\"",
            f'set min_vllm = "{labels.MTP_MIN_VLLM}" or remove [speculative]',
        )
    if vllm_version is not None and not versions.has_mtp(vllm_version):
        yield Finding(
            "error",
            "mtp-old-vllm",
            f"vLLM {vllm_version} has no Gemma 4 MTP (needs >= {labels.MTP_MIN_VLLM})",
            "use an image labelled io.gemma4-appliance.mtp=true, or the profile without MTP",
        )
    # min_vllm older than the flag is a supported choice (the serve program leaves the flag out
    # on such an image); an image actually older than it is worth a word on what it costs.
    if (
        p.per_request_spec_decode_metrics
        and vllm_version is not None
        and not versions.has_per_request_metrics(vllm_version)
    ):
        yield Finding(
            "warning",
            "per-request-metrics",
            f"vLLM {vllm_version} has no --per-request-spec-decode-metrics (needs >= "
            f"{labels.PER_REQUEST_METRICS_MIN_VLLM}): the serve program leaves it out, and the "
            "agent attributes MTP figures from /metrics counters, so calls that overlap are "
            "`shared` (not exact) and each call costs /metrics reads",
            f"use an image of vLLM >= {labels.PER_REQUEST_METRICS_MIN_VLLM} for exact per-call "
            "figures under concurrency",
        )


def _k(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    if p.speculative is None:
        return
    k = p.speculative.num_speculative_tokens
    if not MIN_K <= k <= MAX_K:
        yield Finding(
            "error",
            "num-speculative-tokens",
            f"num_speculative_tokens = {k} is outside {MIN_K}..{MAX_K}",
            "use 2-4: acceptance falls with every position (seeds: 2.46 tokens/step at k=2)",
        )
    elif k == MAX_K:
        yield Finding(
            "warning",
            "num-speculative-tokens",
            f"num_speculative_tokens = {k}: 31B on H200 at k=8 hit device-side asserts after "
            "hours (vllm#42261), and late positions are rarely accepted",
            "use 2-4 unless you have measured otherwise",
        )


def schedule_problem(schedule: tuple[tuple[int, ...], ...]) -> str | None:
    """Why vLLM refuses a ``num_speculative_tokens_per_batch_size`` schedule, or ``None``.

    The rules and their order are vLLM's own (``validate_and_normalize_dynamic_sd_schedule`` in
    vllm/v1/spec_decode/dynamic/utils.py, which the scheduler runs at engine start: a refusal
    there is an engine that never comes up); tests/test_vllm_parses_profiles.py holds the two
    to the same verdict. An empty schedule passes here as there (see :func:`_k_schedule`)."""
    for entry in schedule:
        if len(entry) != 3:
            return f"entry {list(entry)} is not 3 numbers (first batch size, last, k)"
        start, end, k = entry
        if start <= 0 or end <= 0:
            return f"batch-size range ({start}, {end}) must be positive"
        if start > end:
            return f"entry {list(entry)} starts after it ends"
        if k < 0:
            return f"entry {list(entry)}: k must be >= 0"
    previous_end = 0
    for start, end, _ in sorted(schedule, key=lambda e: e[0]):
        if start <= previous_end:
            return "batch-size ranges overlap"
        previous_end = end
    if schedule and min(e[0] for e in schedule) != 1:
        return "the first batch-size range must start at 1 (every batch size needs a k)"
    return None


def _k_schedule(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    spec = p.speculative
    if spec is None or spec.num_speculative_tokens_per_batch_size is None:
        return
    schedule = spec.num_speculative_tokens_per_batch_size
    problem = schedule_problem(schedule)
    if problem is not None:
        yield Finding(
            "error",
            "speculative-schedule",
            f"[speculative] num_speculative_tokens_per_batch_size: {problem}: vLLM's scheduler "
            "refuses it at engine start",
            "give non-overlapping [first, last, k] ranges starting at batch size 1 "
            "(appliance bench tune writes one)",
        )
        return
    if not schedule:
        # vLLM's scheduler skips an empty schedule (static k), yet its config still counts it
        # as dynamic speculative decoding and drops full CUDA graphs for it on the V1 runner.
        yield Finding(
            "warning",
            "speculative-schedule",
            "[speculative] num_speculative_tokens_per_batch_size is empty: vLLM runs "
            f"num_speculative_tokens = {spec.num_speculative_tokens} at every batch size",
            "remove the key, or give the ranges",
        )
    capped = [list(e) for e in schedule if e[2] > spec.num_speculative_tokens]
    if capped:
        yield Finding(
            "warning",
            "speculative-schedule",
            f"[speculative] num_speculative_tokens_per_batch_size {capped}: k above "
            f"num_speculative_tokens = {spec.num_speculative_tokens}, which vLLM caps it to",
            "raise num_speculative_tokens (the most any batch size drafts), or lower the entry",
        )


def _parallelism(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    if p.multinode is not None:
        return  # parallelism across nodes: _multinode
    tp, hw = p.tensor_parallel_size, p.hardware
    if tp < 1:
        yield Finding("error", "tensor-parallel", f"tensor_parallel_size = {tp}", "use >= 1")
        return
    if hw.device == "cpu":
        if tp != 1:
            yield Finding(
                "error",
                "tensor-parallel",
                f"tensor_parallel_size = {tp} on the CPU engine",
                "use tensor_parallel_size = 1 for CPU profiles",
            )
        return
    if hw.gpus < 1:
        yield Finding(
            "error",
            "gpus",
            f"[hardware] gpus = {hw.gpus} for a {hw.device} profile",
            "state how many GPUs the host has",
        )
    elif hw.gpus % tp != 0:
        yield Finding(
            "error",
            "tensor-parallel",
            f"tensor_parallel_size = {tp} does not divide the host's {hw.gpus} GPUs",
            f"use a divisor of {hw.gpus} (e.g. {hw.gpus})",
        )
    if hw.mig and (hw.gpus != 1 or tp != 1):
        yield Finding(
            "error",
            "mig",
            "a MIG profile runs one instance per slice: one device, no tensor parallelism "
            f"(gpus = {hw.gpus}, tensor_parallel_size = {tp})",
            "set gpus = 1 and tensor_parallel_size = 1; start one unit instance per slice",
        )


def _data_parallel(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    """Data-parallel ranks behind one endpoint (adr/0022): the whole model per rank, on its own
    GPUs of the host. Refused where vLLM 0.32 (the source read) would not serve this profile's
    Gemma 4 MTP that way, or the appliance does not place it."""
    dp, hw = p.data_parallel_size, p.hardware
    if dp == 1:
        return
    where = f"data_parallel_size = {dp}"
    if hw.device != "cuda":
        yield Finding(
            "error",
            "data-parallel",
            f"{where} on the {hw.device} engine: a CPU instance runs one engine",
            "use data_parallel_size = 1",
        )
        return
    if hw.mig:
        yield Finding(
            "error",
            "data-parallel",
            f"{where} for a MIG profile, which runs one instance per slice",
            "use data_parallel_size = 1; install one instance per slice",
        )
    if p.multinode is not None:
        yield Finding(
            "error",
            "data-parallel",
            f"{where} for a group: the group spreads one model over its nodes (TP x PP), not "
            "ranks of it",
            "use data_parallel_size = 1",
        )
    need = dp * p.tensor_parallel_size * p.pipeline_parallel_size
    if p.multinode is None and not hw.mig and hw.gpus != need:
        yield Finding(
            "error",
            "data-parallel",
            f"{where} x tensor_parallel_size {p.tensor_parallel_size} x pipeline_parallel_size "
            f"{p.pipeline_parallel_size} = {need} GPUs, but [hardware] gpus = {hw.gpus}",
            f"set [hardware] gpus = {need}",
        )
    spec = p.speculative
    if spec is not None and spec.num_speculative_tokens_per_batch_size:
        # vllm/config/vllm.py _maybe_disable_dynamic_sd_for_data_parallel (0.32): ranks that
        # drafted different counts would diverge, so vLLM drops the schedule with a warning.
        yield Finding(
            "error",
            "data-parallel",
            f"{where} with [speculative] num_speculative_tokens_per_batch_size: vLLM drops the "
            f"schedule under data parallel and drafts k = {spec.num_speculative_tokens} for "
            "every batch",
            "remove num_speculative_tokens_per_batch_size, or use data_parallel_size = 1",
        )
    if p.mtp and versions.older(p.min_vllm, DATA_PARALLEL_MIN_VLLM):
        yield Finding(
            "error",
            "data-parallel",
            f"{where} with Gemma 4 MTP needs vLLM >= {DATA_PARALLEL_MIN_VLLM}, the release read "
            f"for it (adr/0022), but min_vllm is {p.min_vllm}",
            f'set min_vllm = "{DATA_PARALLEL_MIN_VLLM}"',
        )
    known = catalog.of_profile(p.model, p.drafter_matches, p.quantization)
    if known is not None and known[0].moe:
        yield Finding(
            "warning",
            "data-parallel-moe",
            f"{where} for Gemma 4 {known[0].label}, a mixture of experts: vLLM shards its "
            "experts over every rank's GPUs and steps the ranks together "
            "(model_executor/layers/fused_moe/config.py), so the fit per GPU, which counts each "
            "rank as a whole copy, is not what it holds",
            "measure it on the host, or install one instance per device set",
        )


def _heads(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    """vLLM refuses a tensor-parallel size that does not divide the model's attention heads
    (vllm/config/model.py verify_with_parallel_config): said before a 471 s load, not after."""
    known = catalog.of_profile(p.model, p.drafter_matches, p.quantization)
    if known is None or p.tensor_parallel_size < 1:
        return
    problem = memory.tp_problem(known[0], p.tensor_parallel_size)
    if problem is not None:
        yield Finding(
            "error",
            "tensor-parallel-heads",
            f"{problem}: vLLM refuses it at start",
            f"use a tensor_parallel_size that divides {known[0].heads}",
        )


def _gpu(p: Profile) -> tuple[float, str]:
    """The memory (GiB, as nvidia-smi reports it) and name of the GPU (or MIG slice) ``p``
    states: the table's figure for a GPU it knows, else the stated GB as decimal (the lesser);
    0 when it states none."""
    hw = p.hardware
    gpu = None if hw.mig else catalog.gpu_of(hw.gpu_name, hw.gpu_memory_gib)
    if gpu is not None:
        return gpu.memory_gib, gpu.name
    return hw.gpu_memory_gib * 1e9 / catalog.GIB, hw.gpu_name


def estimated_fit(
    p: Profile, gpu_gib: float | None = None, gpu_name: str | None = None
) -> memory.Fit | None:
    """The per-GPU memory estimate of ``p`` (appliance/profiles/fit.py) on its GPUs, or on GPUs
    of ``gpu_gib`` named ``gpu_name`` (a host's); None when the table does not know its model
    or the GPU's memory, or the profile leaves max_model_len to vLLM."""
    known = catalog.of_profile(p.model, p.drafter_matches, p.quantization)
    hw = p.hardware
    if known is None or hw.device != "cuda" or p.max_model_len is None:
        return None
    gib, name = _gpu(p)
    if gpu_gib is not None:
        gib, name = gpu_gib, gpu_name if gpu_name is not None else name
    elif not gib:
        return None
    m, c = known
    return memory.fit(
        m,
        c,
        gpu_gib=gib,
        utilization=p.gpu_memory_utilization or memory.DEFAULT_UTILIZATION,
        tp=max(p.tensor_parallel_size, 1),
        pp=max(p.pipeline_parallel_size, 1),
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs or 1,
        batched=p.max_num_batched_tokens or memory.auto_batched_tokens(gib, name),
        mtp=p.mtp,
        kv_bytes=1 if (p.kv_cache_dtype or "").startswith("fp8") else 2,
    )


def sequences(p: Profile) -> list[tuple[int, int]]:
    """How many sequences of full length fit ``p``'s GPUs at once (:func:`estimated_fit`), at
    its ``max_model_len`` and at a half and a quarter of it (2048 tokens at least): the trade of
    context for concurrent callers. Empty where the fit is not known."""
    if p.max_model_len is None or estimated_fit(p) is None:
        return []
    out = []
    for length in dict.fromkeys((p.max_model_len, p.max_model_len // 2, p.max_model_len // 4)):
        if length < 2048 and length != p.max_model_len:
            continue
        one = estimated_fit(replace(p, max_model_len=length, max_num_seqs=1))
        assert one is not None
        more = int(one.spare_gib // one.more_gib) if one.fits and one.more_gib > 0 else 0
        out.append((length, 1 + more if one.fits else 0))
    return out


def _fits(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    f = estimated_fit(p)
    if f is not None and not f.fits:
        yield Finding(
            "warning",
            "memory-fit",
            f"estimated per GPU: {f.line()} (appliance/profiles/fit.py; vLLM refuses to start "
            "when one max_model_len request does not fit)",
            "lower max_model_len, max_num_batched_tokens or max_num_seqs, or use more GPUs",
        )


def _basename(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1].lower()


def _drafter(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    if not p.mtp:
        return
    assert p.speculative is not None
    drafter = p.speculative.model
    if not drafter:
        yield Finding(
            "error",
            "drafter",
            '[speculative] method = "mtp" without a drafter model',
            "set [speculative] model to the target's assistant, e.g. "
            "google/gemma-4-31B-it-assistant",
        )
        return
    if p.uses_devmodel or DEVMODEL in drafter:
        # The tiny pair is generated together: both must come from the same dev model dir.
        if not (p.uses_devmodel and drafter.startswith(DEVMODEL)):
            yield Finding(
                "error",
                "drafter",
                f"drafter {drafter} and target {p.model} are not one tiny dev model pair",
                f"use {DEVMODEL}/target with {DEVMODEL}/drafter",
            )
        return
    target = p.drafter_matches or p.model
    expected = _basename(target) + "-assistant"
    if _basename(drafter) != expected:
        yield Finding(
            "error",
            "drafter",
            f"drafter {drafter} does not match target {target}: Gemma 4 MTP drafters share "
            "the target's KV cache and layer sizes, so each target has its own assistant",
            f"use the target's assistant ({expected}), or set drafter_matches to the model "
            "the drafter was trained for",
        )
    sizes = {m.group(1).lower() for name in (p.model, target) if (m := catalog.SIZE.search(name))}
    if len(sizes) > 1:
        yield Finding(
            "error",
            "drafter",
            f"drafter_matches {target} is a different Gemma 4 size than the model {p.model}",
            "point drafter_matches at the checkpoint this model was derived from",
        )


def _exposure(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    if p.host not in LOOPBACK:
        yield Finding(
            "warning",
            "bind",
            f"vLLM binds {p.host}: raw vLLM has no rate limiting or CORS, only the API key",
            "keep host = 127.0.0.1 and put a gateway in front, or accept it knowingly",
        )


# An interface for NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: names or prefixes, comma-separated,
# optionally "^" (exclude) or "=" (exact) first, as NCCL reads it.
_IFNAME = re.compile(r"[=^]?[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*")
_LOOPBACK_IF = re.compile(r"[=^]?lo([,:]|$)")


def _multinode(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    """One model across nodes: the world size, the rendezvous address, the interfaces."""
    mn, hw = p.multinode, p.hardware
    if mn is None:
        return
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    if mn.nodes < 2:
        yield Finding(
            "error",
            "multinode-nodes",
            f"[multinode] nodes = {mn.nodes}",
            "use nodes >= 2, or drop [multinode] for a single host",
        )
        return
    if tp < 1 or pp < 1:
        yield Finding(
            "error",
            "multinode-parallel",
            f"tensor_parallel_size = {tp}, pipeline_parallel_size = {pp}",
            "use >= 1 for both",
        )
        return
    # The CPU engine runs one rank per node (a process); a GPU node one rank per GPU.
    per_node = 1 if hw.device == "cpu" else hw.gpus
    if hw.device != "cpu" and per_node < 1:
        yield Finding(
            "error",
            "gpus",
            f"[hardware] gpus = {hw.gpus} for a {hw.device} profile",
            "state how many GPUs each node has",
        )
    elif tp * pp != mn.nodes * per_node:
        yield Finding(
            "error",
            "multinode-parallel",
            f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {tp * pp}, but "
            f"{mn.nodes} nodes x {per_node} {'rank' if hw.device == 'cpu' else 'GPU'}(s) = "
            f"{mn.nodes * per_node}: vLLM needs one rank per device across the nodes",
            f"make TP x PP = {mn.nodes * per_node} (e.g. TP = GPUs per node, PP = nodes)",
        )
    if hw.mig:
        yield Finding(
            "error",
            "mig",
            "a MIG profile cannot span nodes",
            "drop [multinode] or mig",
        )
    yield from _master(p)
    yield from _interfaces(p)
    if hw.device == "cpu":
        yield from _cpu_threads(p)


def _cpu_threads(p: Profile) -> Iterable[Finding]:
    """A CPU group's nodes share one host (its rendezvous is on loopback), and vLLM binds each
    node's OpenMP threads by its LOCAL rank, 0 on every node: "auto" (vLLM's default) pins every
    node to the same core."""
    bind = p.env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "auto":
        yield Finding(
            "warning",
            "multinode-cpu-threads",
            f"VLLM_CPU_OMP_THREADS_BIND = {bind!r}: every node of this one-host group is local "
            "rank 0, so all are bound to the same core",
            # The thread count is the cpu-omp-threads rule's, for every CPU profile.
            'set env VLLM_CPU_OMP_THREADS_BIND = "nobind" (or one core list per node)',
        )


def _cpu_omp(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    """torch starts its OpenMP team at import, one thread per core of the host, before vLLM's
    CPU worker binds its cores (vLLM PR 22773, closed unmerged): unless OMP_NUM_THREADS says
    otherwise, the extra threads spin between operations, and every token costs that many
    cores (measured: twice the CPU on 2 cores, no faster; gotchas/cpu-omp-threads.md)."""
    if p.hardware.device == "cpu" and "OMP_NUM_THREADS" not in p.env:
        yield Finding(
            "warning",
            "cpu-omp-threads",
            "OMP_NUM_THREADS is not set: torch's OpenMP team takes one thread per core of the "
            "host, and the threads vLLM does not bind spin while the engine generates",
            "set env OMP_NUM_THREADS to the cores the engine should compute on (1 for a tiny "
            "model)",
        )


def _master(p: Profile) -> Iterable[Finding]:
    mn = p.multinode
    assert mn is not None
    try:
        addr = ipaddress.ip_address(mn.master_addr)
    except ValueError:
        yield Finding(
            "error",
            "multinode-master",
            f"[multinode] master_addr {mn.master_addr!r} is not an IP address",
            "name the head's address on the cluster network as an IP (a host name may resolve "
            "to its public address)",
        )
        return
    if addr.is_unspecified:
        yield Finding(
            "error",
            "multinode-master",
            f"[multinode] master_addr {addr} is every address: the rendezvous port would be "
            "open on the public network too",
            "use the head's address on the cluster network",
        )
    elif p.hardware.device == "cpu":
        if not addr.is_loopback:
            yield Finding(
                "error",
                "multinode-master",
                f"[multinode] master_addr {addr}: the CPU profiles run every node on one host",
                "use 127.0.0.1",
            )
    elif addr.is_loopback:
        yield Finding(
            "error",
            "multinode-master",
            f"[multinode] master_addr {addr} is loopback: the other nodes cannot reach it",
            "use the head's address on the cluster network",
        )
    elif addr.is_global:
        yield Finding(
            "error",
            "multinode-master",
            f"[multinode] master_addr {addr} is a public address: torch.distributed's "
            "rendezvous has no authentication",
            "use the head's address on a private cluster network (e.g. 10.0.0.0/8, "
            "192.168.0.0/16, fd00::/8)",
        )
    if not 1024 <= mn.master_port <= 65535 or mn.master_port == p.port:
        yield Finding(
            "error",
            "multinode-master",
            f"[multinode] master_port = {mn.master_port}",
            f"use a free port from 1024 to 65535 other than the API port {p.port}",
        )


def _interfaces(p: Profile) -> Iterable[Finding]:
    mn = p.multinode
    assert mn is not None
    named = {"gloo_socket_ifname": mn.gloo_socket_ifname}
    if p.hardware.device != "cpu":
        named["nccl_socket_ifname"] = mn.nccl_socket_ifname
    for key, value in named.items():
        if not value:
            yield Finding(
                "error",
                "multinode-interface",
                f"[multinode] {key} is not set: NCCL/Gloo pick the first interface they find, "
                "often docker0 or the public one, and the ranks hang at start-up",
                f"set {key} to the cluster network's interface (e.g. enp1s0f0)",
            )
        elif not _IFNAME.fullmatch(value):
            yield Finding(
                "error",
                "multinode-interface",
                f"[multinode] {key} = {value!r} is not an interface name list",
                "use e.g. enp1s0f0, or ^docker,lo to exclude",
            )
        elif p.hardware.device != "cpu" and _LOOPBACK_IF.match(value):
            yield Finding(
                "error",
                "multinode-interface",
                f"[multinode] {key} = {value!r} is loopback: it does not leave the host",
                "use the cluster network's interface",
            )
    if p.hardware.device == "cpu" and mn.nccl_socket_ifname:
        yield Finding(
            "warning",
            "multinode-interface",
            "[multinode] nccl_socket_ifname on a CPU profile: the CPU engine talks Gloo only",
            "drop it",
        )


def _queue(p: Profile, vllm_version: str | None) -> Iterable[Finding]:
    # vLLM counts running and waiting requests against the bound (vllm/v1/engine/async_llm.py,
    # check_admission): one below max_num_seqs turns callers away while the batch has room.
    bound, seqs = p.queue_bound, p.max_num_seqs
    if bound is not None and seqs is not None and bound < seqs:
        yield Finding(
            "warning",
            "queue-bound",
            f"max_num_queued_reqs = {bound} is below max_num_seqs = {seqs}: vLLM answers 503 "
            "while the batch still has room (the bound counts running requests too)",
            "remove max_num_queued_reqs (2 x max_num_seqs), or raise it (gotchas/queue-bound.md)",
        )


RULES: tuple[Callable[[Profile, str | None], Iterable[Finding]], ...] = (
    _batched_tokens,
    _known_defects,
    _mtp_version,
    _k,
    _k_schedule,
    _parallelism,
    _data_parallel,
    _heads,
    _fits,
    _drafter,
    _exposure,
    _multinode,
    _cpu_omp,
    _queue,
)


def check(profile: Profile, *, vllm_version: str | None = None) -> list[Finding]:
    """Every finding for ``profile`` (errors first), optionally for a given vLLM version."""
    if vllm_version is not None:
        versions.parse(vllm_version)  # a malformed version is a usage error, not a finding
    found = [f for rule in RULES for f in rule(profile, vllm_version)]
    return sorted(found, key=lambda f: ("error", "warning", "info").index(f.level))


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def warnings(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "warning"]


def shared(checked: Iterable[Iterable[Finding]]) -> list[Finding]:
    """The warnings that more than one of the ``checked`` profiles' findings hold, word for
    word, in the order first met: a run over many profiles says each of them once (one
    published defect applies to most of the catalog and would drown any other warning)."""
    count = Counter(f for found in checked for f in set(warnings(found)))
    return [f for f, n in count.items() if n > 1]


def require_valid(profile: Profile, *, vllm_version: str | None = None) -> list[Finding]:
    """Raise :class:`ProfileError` naming the first error; return the warnings otherwise."""
    found = check(profile, vllm_version=vllm_version)
    bad = errors(found)
    if bad:
        more = f" (and {len(bad) - 1} more: appliance profiles validate {profile.name})"
        first = bad[0]
        raise ProfileError(
            f"profile {profile.name}: {first.message}" + (more if len(bad) > 1 else ""),
            fix=first.fix,
        )
    return found
