"""The one table the GPU profiles are generated from: the Gemma 4 models and their precisions,
the GPUs people run them on, and the seed hosts' hand-tuned values.

Every figure says where it comes from (a URL or vLLM's own source); where no source was found
the figure is an assumption, said so, and chosen to over-count memory, never to under-count it.
:mod:`.fit` turns the table into memory arithmetic, :mod:`.generated` into the profile files
``appliance dev generate`` writes to ``appliance/profiles/generated`` (``--check`` keeps them in
step). Change a figure here, then run ``appliance dev generate``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# --- the models -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """One kind of attention layer of a model, as far as its KV cache goes: how many layers
    keep their own cache (KV-shared layers reuse another's), their KV heads and head size, and
    the sliding window (``None``: global, the whole context)."""

    layers: int
    kv_heads: int
    head_dim: int
    window: int | None = None


@dataclass(frozen=True)
class Model:
    """One Gemma 4 size with its paired assistant drafter (Gemma 4 MTP)."""

    key: str  # in profile names: "31b"
    label: str  # in descriptions: "31B-it"
    repo: str
    drafter: str
    served_model_name: str
    heads: int  # query heads: vLLM needs tensor_parallel_size to divide them
    attention: tuple[Attention, ...]
    drafter_gib: float  # the drafter's weights, resident beside the target's
    k: int  # num_speculative_tokens of the generated profiles
    size_rank: int  # larger: the bigger model (suggest prefers it)
    sources: tuple[str, ...]
    # A mixture of experts (vLLM's ModelConfig.is_moe): under data parallel its experts are
    # sharded over every rank's GPUs and the ranks step together (adr/0022), which the fit does
    # not count; a dense model's ranks are independent copies.
    moe: bool = False


GEMMA_DOCS = "https://ai.google.dev/gemma/docs/core"  # sizes E2B/E4B/26B A4B/31B, effective params
GEMMA_CPP = (
    "https://github.com/google/gemma.cpp/pull/919"  # gemma/configs.cc: Gemma 4 layer configs
)

MODELS: tuple[Model, ...] = (
    Model(
        key="e2b",
        label="E2B-it",
        repo="google/gemma-4-E2B-it",
        drafter="google/gemma-4-E2B-it-assistant",
        served_model_name="gemma-4-e2b-it",
        heads=8,
        # 35 layers, every 5th global (head 512), window 512, 1 KV head; layers 15-34 reuse the
        # KV of layers 13/14, so 15 layers keep a cache: 12 sliding, 3 global.
        attention=(Attention(12, 1, 256, 512), Attention(3, 1, 512)),
        # 78M parameters, 158 MB of safetensors (the Olares post of 2026-05-07, a seed): 0.5
        # over-counts it threefold, kept as E4B's assumed figure.
        drafter_gib=0.5,
        k=2,
        size_rank=1,
        sources=(GEMMA_DOCS, GEMMA_CPP),
    ),
    Model(
        key="e4b",
        label="E4B-it",
        repo="google/gemma-4-E4B-it",
        drafter="google/gemma-4-E4B-it-assistant",
        served_model_name="gemma-4-e4b-it",
        heads=8,
        # 42 layers, every 6th global, window 512, 2 KV heads; layers 24-41 reuse the KV of
        # layers 22/23, so 24 keep a cache: 20 sliding, 4 global. k=2: 1.71 tokens/step on the
        # seed's RTX PRO 6000 MIG slice (mig24-e4b-mtp).
        attention=(Attention(20, 2, 256, 512), Attention(4, 2, 512)),
        drafter_gib=0.5,  # assumed, as E2B's
        k=2,
        size_rank=2,
        sources=(GEMMA_DOCS, GEMMA_CPP),
    ),
    Model(
        key="26b-a4b",
        label="26B-A4B-it",
        repo="google/gemma-4-26B-A4B-it",
        drafter="google/gemma-4-26B-A4B-it-assistant",
        served_model_name="gemma-4-26b-a4b-it",
        heads=16,
        # 30 layers (25 sliding, window 1024, 8 KV heads; 5 global, head 512, 2 KV heads). k=2:
        # on a DGX Spark 2 beat 4 on every stable metric (eugr/spark-vllm-docker#343).
        attention=(Attention(25, 8, 256, 1024), Attention(5, 2, 512)),
        drafter_gib=0.5,  # assumed: 4 layers, width 256; no size found
        k=2,
        size_rank=3,
        moe=True,  # "A4B": 4B of its 26B active per token, a mixture of experts (GEMMA_DOCS)
        sources=(
            GEMMA_DOCS,
            GEMMA_CPP,
            "https://vast.ai/model/gemma-4-26b-a4b-it",
            "https://github.com/eugr/spark-vllm-docker/issues/343",
        ),
    ),
    Model(
        key="31b",
        label="31B-it",
        repo="google/gemma-4-31B-it",
        drafter="google/gemma-4-31B-it-assistant",
        served_model_name="gemma-4-31b-it",
        heads=32,
        # 60 layers, 5 sliding (window 1024, 16 KV heads of 256) to 1 global (4 KV heads of 512).
        # The global layers' keys and values are one projection (attention_k_eq_v), yet vLLM
        # 0.32 loads k_proj into both slots and caches both (model_executor/models/gemma4.py,
        # the k_eq_v shards): counted as both, exactly.
        attention=(Attention(50, 16, 256, 1024), Attention(10, 4, 512)),
        # 470M parameters (the QAT copy's card) in bf16; rounded up.
        drafter_gib=0.9,
        k=3,
        size_rank=4,
        sources=(
            GEMMA_DOCS,
            "https://huggingface.co/mlboydaisuke/Gemma-4-31B-CoreAI",
            "https://apxml.com/models/gemma-4-31b",
            "https://huggingface.co/google/gemma-4-31B-it-assistant",
            "https://onlylabs.fyi/signals/bdf07c85-5eb4-4573-b293-bc19df10e294",
        ),
    ),
)


@dataclass(frozen=True)
class Checkpoint:
    """One precision of one model: what it weighs in GPU memory and on disk, and what it takes."""

    model: str  # Model.key
    precision: str  # "bf16", "fp8" (vLLM quantizes the bf16 checkpoint on load), "nvfp4"
    gpu_gib: float  # the target's weights in GPU memory, all GPUs together
    disk_gib: float  # the checkpoint in the Hugging Face cache
    how: str  # where gpu_gib and disk_gib come from
    repo: str = ""  # another checkpoint than the model's (NVIDIA's NVFP4 one)
    quantization: str | None = None
    min_capability: str = "8.0"
    language_model_only: bool = False
    precision_rank: int = 3  # larger: closer to the trained weights (suggest prefers it)


GIB = 2**30

# bf16: 2 bytes a parameter. The parameter counts include the embeddings and the encoders vLLM
# loads: E2B 5.1B with its per-layer embeddings, E4B 8B (Google's overview as quoted by
# studioglobal.ai), 26B A4B 25.2B + ~0.55B vision, 31B 30.7B + ~0.55B vision (NVIDIA's NIM card,
# reeboot.fr); kaitchup measured 61 GB (31B) and 50 GB (26B A4B) checkpoints.
# fp8: vLLM's online FP8 quantizes the Linear layers only: the embeddings (vocab 262144 x
# hidden: 31B 5376, 26B 2816) and the vision tower stay bf16.
_PARAMS = "https://www.studioglobal.ai/discover/answers/search-6a2421b7e87afc7fdf360827"
_NIM_31B = "https://docs.api.nvidia.com/nim/reference/google-gemma-4-31b-it"
_KAITCHUP = "https://kaitchup.substack.com/p/gemma-4-31b-and-26b-a4b-architecture"
CHECKPOINTS: tuple[Checkpoint, ...] = (
    Checkpoint("e2b", "bf16", 5.55e9 * 2 / GIB, 5.55e9 * 2 / GIB, f"5.1B + encoders, {_PARAMS}"),
    Checkpoint("e4b", "bf16", 8.45e9 * 2 / GIB, 8.45e9 * 2 / GIB, f"8B + encoders, {_PARAMS}"),
    Checkpoint(
        "26b-a4b", "bf16", 25.75e9 * 2 / GIB, 25.75e9 * 2 / GIB, f"25.2B + vision, {_KAITCHUP}"
    ),
    Checkpoint(
        "26b-a4b",
        "fp8",
        (25.2e9 - 0.74e9) / GIB + (0.74e9 + 0.55e9) * 2 / GIB,
        25.75e9 * 2 / GIB,
        "Linear layers at 1 byte, embeddings (0.74B) and vision at 2; the bf16 checkpoint on disk",
        quantization="fp8",
        min_capability="8.9",
        precision_rank=2,
    ),
    Checkpoint("31b", "bf16", 31.25e9 * 2 / GIB, 31.25e9 * 2 / GIB, f"30.7B + vision, {_NIM_31B}"),
    Checkpoint(
        "31b",
        "fp8",
        (30.7e9 - 1.41e9) / GIB + (1.41e9 + 0.55e9) * 2 / GIB,
        31.25e9 * 2 / GIB,
        "Linear layers at 1 byte, embeddings (1.41B) and vision at 2; the bf16 checkpoint on disk",
        quantization="fp8",
        min_capability="8.9",
        precision_rank=2,
    ),
    Checkpoint(
        "31b",
        "nvfp4",
        32.7e9 / GIB,
        32.7e9 / GIB,
        f"nvidia/Gemma-4-31B-IT-NVFP4 is 32.7 GB ({_KAITCHUP}); NVFP4 kernels need Blackwell",
        repo="nvidia/Gemma-4-31B-IT-NVFP4",
        min_capability="10.0",
        language_model_only=True,
        precision_rank=1,
    ),
)


# --- the GPUs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """One GPU model as hosts have it."""

    key: str  # in profile names: "l4"
    name: str  # as nvidia-smi names it (the host check looks for it in the name)
    pattern: str  # a regex on nvidia-smi's name that is this GPU and no other
    nominal_gb: float  # the vendor's figure: what a profile states and the host check compares
    # Memory the engine can use, GiB: nvidia-smi's memory.total, from the captures in
    # tests/data/nvidia-smi or as published hosts print it (found with the public-code index:
    # A10G 23028 MiB, A100-SXM4 40960 / 81920, RTX 4090 24564, RTX 5090 32607, RTX PRO 6000
    # Blackwell Workstation Edition 97887); the GB10's is what vLLM sees of its unified memory.
    memory_gib: float
    capability: str
    counts: tuple[int, ...]  # GPUs per host people run
    utilization: float = 0.90
    sources: tuple[str, ...] = ()
    unified: bool = False  # memory shared with the host (nvidia-smi reports none)

    def matches(self, nvidia_smi_name: str) -> bool:
        """Whether nvidia-smi's ``name`` is this GPU."""
        return re.search(self.pattern, nvidia_smi_name) is not None


CUDA_GPUS = "https://developer.nvidia.com/cuda-gpus"  # compute capability of each
_CAPTURE = "tests/data/nvidia-smi/"


GPUS: tuple[Gpu, ...] = (
    Gpu(
        "l4",
        "NVIDIA L4",
        r"\bL4\b",
        24,
        23034 / 1024,
        "8.9",
        (1, 2, 4),
        0.92,  # the seed's reference host (l4x4-31b-mtp): a small GPU, every GiB counts
        ("https://www.nvidia.com/en-us/data-center/l4/", CUDA_GPUS, _CAPTURE + "l4.csv"),
    ),
    Gpu(
        "l40s",
        "NVIDIA L40S",
        r"\bL40S\b",
        48,
        46068 / 1024,
        "8.9",
        (1, 2, 4),
        sources=(
            "https://www.nvidia.com/en-us/data-center/l40s/",
            "https://www.itcreations.com/nvidia-gpu/nvidia-l40s-gpu-accelerator",
            CUDA_GPUS,
            _CAPTURE + "l40s-x2.csv",
        ),
    ),
    Gpu(
        "a10g",
        "NVIDIA A10G",
        r"\bA10G\b",
        24,
        23028 / 1024,
        "8.6",  # an A10 variant: the A10's row
        (1, 4),
        sources=("https://aws.amazon.com/ec2/instance-types/g5/", CUDA_GPUS),
    ),
    Gpu(
        "a100-40g",
        "NVIDIA A100",
        r"\bA100\b(?!.*80\s?GB)",  # "A100-SXM4-40GB", "A100-PCIE-40GB"
        40,
        40960 / 1024,
        "8.0",
        (1, 2, 4, 8),
        sources=("https://www.nvidia.com/en-us/data-center/a100/", CUDA_GPUS),
    ),
    Gpu(
        "a100-80g",
        "NVIDIA A100",
        r"\bA100\b.*80\s?GB",  # "A100-SXM4-80GB", "A100 80GB PCIe"
        80,
        81920 / 1024,
        "8.0",
        (1, 2, 4, 8),
        sources=("https://www.nvidia.com/en-us/data-center/a100/", CUDA_GPUS),
    ),
    Gpu(
        "h100",
        "NVIDIA H100",
        r"\bH100\b",
        80,
        81559 / 1024,
        "9.0",
        (1, 2, 4, 8),
        sources=(
            "https://www.nvidia.com/en-us/data-center/h100/",
            CUDA_GPUS,
            _CAPTURE + "h100-80gb-hbm3.csv",
        ),
    ),
    Gpu(
        "h200",
        "NVIDIA H200",
        r"\bH200\b",
        141,
        143771 / 1024,
        "9.0",
        (1, 2, 4, 8),
        sources=(
            "https://www.nvidia.com/en-us/data-center/h200/",
            "https://lzwjava.github.io/nvidia-h200-gpu-specs-en",
            CUDA_GPUS,
            _CAPTURE + "h200.csv",
        ),
    ),
    Gpu(
        "rtx4090",
        "NVIDIA GeForce RTX 4090",
        r"\bRTX 4090\b",
        24,
        24564 / 1024,
        "8.9",
        (1, 2),
        sources=(
            "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/",
            CUDA_GPUS,
        ),
    ),
    Gpu(
        "rtx5090",
        "NVIDIA GeForce RTX 5090",
        r"\bRTX 5090\b",
        32,
        32607 / 1024,
        "12.0",
        (1, 2),
        sources=(
            "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/",
            "https://hardware-corner.net/rtx-5090-vs-rtx-pro-6000-spec-comparison-20250321",
            CUDA_GPUS,
        ),
    ),
    Gpu(
        "rtxpro6000",
        "NVIDIA RTX PRO 6000 Blackwell",
        r"\bRTX PRO 6000\b",
        96,
        97887 / 1024,
        "12.0",
        (1, 2),
        sources=(
            "https://www.nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/",
            "https://hardware-corner.net/rtx-5090-vs-rtx-pro-6000-spec-comparison-20250321",
            CUDA_GPUS,
        ),
    ),
    Gpu(
        "spark",
        "NVIDIA GB10",
        r"\bGB10\b",
        128,
        121.7,  # of the 128 GB unified memory, what vLLM sees on a DGX Spark (vllm PR 46329)
        "12.1",
        (1,),
        0.85,  # the host's own processes share the pool
        sources=(
            "https://www.nvidia.com/en-us/products/workstations/dgx-spark/",
            "https://dgx-spark.warehack.ing/hardware/",
            "https://github.com/vllm-project/vllm/pull/46329",
            CUDA_GPUS,
            _CAPTURE + "gb10.csv",
        ),
        unified=True,
    ),
)


# --- the seed hosts: names and values kept by hand ----------------------------------------------


@dataclass(frozen=True)
class Reference:
    """A generated profile the seed hosts measured or tuned by hand: its name (referenced by
    tests, docs and deploy/) and the values that differ from the computed ones. The generator
    still checks that it fits, and computes what the seed does not state (``max_num_seqs``: every
    shipped profile has a queue bound). ``measured``: where its values were measured;
    ``unverified``: the seed's word that they never were (``profiles show`` and INDEX.md say
    it)."""

    gpu: str
    count: int
    model: str
    precision: str
    values: dict = field(default_factory=dict)  # Profile fields (and "k") over the computed ones
    notes: tuple[str, ...] = ()  # comment lines at the top of its file
    measured: str = ""
    unverified: str = ""

    @property
    def provenance(self) -> str:
        """The profile's ``provenance`` line."""
        if self.unverified:
            return f"unverified: {self.unverified}"
        return f"measured: {self.measured}"


DRIVER_FLOOR = (
    "The image's floor, not the GPU's: vLLM's CUDA images require CUDA >= 12.9 of the driver",
    (
        '(nvidia-container-cli refuses them with "unsatisfied condition: cuda>=12.9", '
        "janhq/server#262),"
    ),
    "and CUDA 12.9 needs driver >= 575.51.03 on Linux (CUDA 12.9 release notes, table 3).",
)
MIN_DRIVER = "575.51.03"

REFERENCES: tuple[Reference, ...] = (
    Reference(
        "l4",
        4,
        "31b",
        "bf16",
        {
            "k": 2,
            "max_model_len": 32768,
            "max_num_batched_tokens": 4096,
            "port": 8050,
            "description": "Gemma 4 31B-it bf16, TP=4 on 4x L4, Gemma 4 MTP k=2",
        },
        (
            "Reference host: Gemma 4 31B-it, bf16, tensor-parallel over 4x NVIDIA L4 (PCIe, no",
            "NVLink), with Google's assistant drafter. k=2 measured 2.46 tokens/step on this host",
            "(the seed ADR, a production MTP cutover: its Run 7), one stream at a time.",
            "",
            "max_num_seqs = 1, kept (issue 54): one 32K sequence is what this host holds. The",
            "ADR states none (vLLM's default batch, its traffic one stream at a time); vLLM 0.21",
            "counted 45,336 tokens of KV cache here (the ADR's table, single stream): 1.38",
            "requests of 32,768, so a second full-length one would be preempted and recomputed,",
            "and the fit below has no room for it either.",
            "The queue bound is 2: one running, one waiting, the next caller 503 at once. For",
            "concurrent callers, trade context for sequences in a copy of this profile:",
            "`appliance profiles show l4x4-31b-mtp` prints how many fit at 16K and 8K (2 and 4,",
            "by the fit), or max_num_seqs above the fit if preempting long requests is acceptable.",
        ),
        measured=(
            "4x L4, the seed ADR's production host (k=2, 4096 batched tokens, 32K, one stream at "
            "a time; vLLM 0.21); max_num_seqs 1, kept: one 32K sequence is what it holds (vLLM "
            "0.21 counted 45,336 tokens of KV cache there, 1.38 of 32,768)"
        ),
    ),
    Reference(
        "h100",
        1,
        "31b",
        "bf16",
        {
            "k": 4,
            "description": "Gemma 4 31B-it bf16 on one 80 GB GPU (H100), Gemma 4 MTP k=4",
        },
        (
            "One 80 GB-class GPU (H100 80 GB) serving Gemma 4 31B-it bf16 whole, no tensor",
            "parallelism: the peer project's `safe80` shape, which it marks unverified (no",
            "hardware evidence). vLLM's recipes suggest k=4 for 31B on A100/H100; k=8 hit",
            "device-side asserts after hours on H200 (vllm#42261). The context, batch and",
            "sequences are the generator's, with its margin: `safe80`'s 32K at 4096 batched",
            "tokens left 0.07 GiB, and with MTP vLLM 0.32 sizes a sliding-window layer's KV for",
            "window + 2 batches per request at start. Two H100s serve 32K: h100x2-31b-mtp.",
        ),
        unverified="the peer project's `safe80` (1x 80 GB, 32K), marked unverified by its source",
    ),
    Reference(
        "rtx5090",
        2,
        "31b",
        "fp8",
        {
            "k": 4,
            "max_model_len": 2048,
            "max_num_seqs": 1,
            "max_num_batched_tokens": 4096,
            "enforce_eager": True,
            "gpu_memory_utilization": None,
            "description": (
                "Gemma 4 31B-it FP8 weights, TP=2 on 2x 32 GB (RTX 5090), Gemma 4 MTP k=4"
            ),
        },
        (
            "2x 32 GB GPUs (RTX 5090, no NVLink), 31B quantized to FP8 on load so weights + KV fit",
            "on the GPUs with no CPU offload. The peer project's `tp2_2x32_fp8_gpuonly`, its",
            "published benchmark: 13.8 -> 48-55 tok/s with MTP k=4 on vLLM 0.21.0. Short context",
            "and one sequence as published. Eager: CUDA graphs are an unvalidated candidate there.",
        ),
        measured="2x RTX 5090, the peer project's `tp2_2x32_fp8_gpuonly` benchmark (vLLM 0.21.0)",
    ),
    Reference(
        "spark",
        1,
        "31b",
        "nvfp4",
        {
            "k": 3,
            "max_model_len": 65536,
            "max_num_batched_tokens": None,
            "description": (
                "Gemma 4 31B-it NVFP4 on one DGX Spark (GB10), text-only, Gemma 4 MTP k=3"
            ),
        },
        (
            "NVIDIA's NVFP4 checkpoint of Gemma 4 31B-it with Google's bf16 assistant drafter, on",
            "one DGX Spark (GB10, 128 GB unified memory). Seed: ready after 471 s with a warm",
            "compile cache, decode 18.3 tok/s single stream, mean acceptance length ~3.06 at k=3.",
            "Served text-only. The seed states no max_num_seqs: this one is the fit's.",
        ),
        measured="one DGX Spark, the seed's NVFP4 + MTP run (65536 context, 0.85, k=3)",
    ),
)


# --- lookups ---------------------------------------------------------------------------------


def model(key: str) -> Model:
    return next(m for m in MODELS if m.key == key)


def gpu(key: str) -> Gpu:
    return next(g for g in GPUS if g.key == key)


def checkpoints(model_key: str) -> list[Checkpoint]:
    return [c for c in CHECKPOINTS if c.model == model_key]


def identify(nvidia_smi_name: str) -> Gpu | None:
    """The table's GPU that nvidia-smi names so (None: not in the table)."""
    return next((g for g in GPUS if g.matches(nvidia_smi_name)), None)


def gpu_of(gpu_name: str, nominal_gb: float) -> Gpu | None:
    """The table's GPU a profile's ``[hardware]`` states (its name and size), if any."""
    same = [g for g in GPUS if g.name == gpu_name and g.nominal_gb == nominal_gb]
    return same[0] if same else identify(gpu_name) if gpu_name else None


# A Gemma 4 size in a repo name: "google/gemma-4-31B-it", "nvidia/Gemma-4-31B-IT-NVFP4".
SIZE = re.compile(r"gemma-4-(e2b|e4b|26b-a4b|31b)", re.IGNORECASE)


def of_profile(repo: str, drafter_matches: str = "", quantization: str | None = None):
    """The table's (model, checkpoint) a profile serves, by its model repo (or the checkpoint
    it was derived from); None when the table does not know it."""
    for name in (repo, drafter_matches):
        found = SIZE.search(name or "")
        if not found:
            continue
        m = model(found.group(1).lower())
        for c in checkpoints(m.key):
            if (c.repo and c.repo.lower() == repo.lower()) or (
                not c.repo and m.repo.lower() == repo.lower() and c.quantization == quantization
            ):
                return m, c
    return None
