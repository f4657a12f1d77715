"""The GPU profiles generated from one table (appliance/profiles/catalog.py): the Gemma 4 family
on the GPUs people own, each profile fitting its GPUs (appliance/profiles/fit.py), the seed hosts
under their names, every figure with its source. vLLM's parser reads every generated profile in
tests/test_vllm_parses_profiles.py, and the validator in tests/test_profiles_validate.py."""

from __future__ import annotations

import dataclasses

import pytest

from appliance import profiles
from appliance.profiles import catalog, generated
from appliance.profiles import fit as memory
from appliance.profiles import validate as pv

SHAPES, OMITTED = generated.plan()
GENERATED = {s.name: s for s in SHAPES}
KIB, GIB = 1024, 2**30


def test_every_gpu_size_and_precision_has_a_profile_or_a_reason():
    seen = {(s.gpu.key, s.model.key, s.checkpoint.precision) for s in SHAPES}
    seen |= {(o.gpu.key, o.model.key, o.checkpoint.precision) for o in OMITTED}
    every = {(g.key, c.model, c.precision) for g in catalog.GPUS for c in catalog.CHECKPOINTS}
    assert seen == every
    assert all(o.why for o in OMITTED)
    # Each GPU of the table serves the small sizes, and a 31B in some precision on some count
    # except the 24 GB consumer card, which fits no 31B at a 4K context.
    for g in catalog.GPUS:
        sizes = {s.model.key for s in SHAPES if s.gpu.key == g.key}
        assert {"e2b", "e4b"} <= sizes, g.key
        assert "31b" in sizes or g.key == "rtx4090", g.key
    # The host: no profile was made for an H200.
    assert {"h200-31b-mtp", "h200-31b-fp8-mtp", "h200-26b-a4b-mtp"} <= set(GENERATED)


def test_the_generated_profiles_are_shipped_and_the_seed_hosts_keep_their_names():
    shipped = profiles.all_profiles()
    assert set(GENERATED) <= set(shipped)
    for name in ("l4x4-31b-mtp", "h100-31b-mtp", "rtx5090x2-31b-fp8-mtp", "spark-31b-nvfp4-mtp"):
        assert GENERATED[name].reference is not None, name
    assert generated.reference_names() <= set(profiles.examples())
    # Hand-made shapes stay hand-made: CPU, MIG, multi-node, the no-MTP baseline.
    for name in ("cpu-tiny-mtp", "mig24-e4b-mtp", "l4x4x2-31b-mtp", "l4x4-31b"):
        assert name in profiles.examples() and name not in GENERATED


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_each_generated_profile_fits_its_gpus_by_the_validators_own_estimate(name):
    prof = profiles.get(name)
    f = pv.estimated_fit(prof)
    assert f is not None and f.fits, f.line() if f else name
    assert f == GENERATED[name].fit  # the validator and the generator do the same arithmetic
    assert prof.tensor_parallel_size == prof.hardware.gpus
    assert memory.tp_problem(GENERATED[name].model, prof.tensor_parallel_size) is None


def test_the_kv_cache_is_sized_as_vllm_sizes_it_at_start():
    # 31B, one GPU, 32K context, 4096-token batches: a sliding layer (16 KV heads of 256, both
    # keys and values in bf16) holds window - 1 + 2 batches in flight + its blocks; a global
    # layer (4 KV heads of 512) holds every token.
    m = catalog.model("31b")
    sliding = 50 * (2 * 16 * 256 * 2) * (1023 + 2 * 4096 + 32)
    global_ = 10 * (2 * 4 * 512 * 2) * 32768
    first = memory.kv_first_gib(m, tp=1, pp=1, max_model_len=32768, batched=4096)
    assert first == pytest.approx((sliding + global_) / GIB)
    # At decode a further sequence holds its window only on the sliding layers.
    more = memory.kv_more_gib(m, tp=1, pp=1, max_model_len=32768)
    assert more == pytest.approx((50 * 16 * KIB * (1024 + 32) + global_) / GIB)
    # Tensor parallel splits the heads; the 4 global KV heads are replicated at TP 8.
    tp8 = memory.kv_first_gib(m, tp=8, pp=1, max_model_len=32768, batched=4096)
    assert tp8 == pytest.approx(
        (50 * (2 * 2 * 256 * 2) * (1023 + 8192 + 32) + 10 * (2 * 1 * 512 * 2) * 32768) / GIB
    )


# One fit per shape family, by hand from the published configs (not from the catalog): per
# token, a layer's KV is 2 (K and V) x KV heads on this GPU x head size x 2 bytes; at start a
# sliding layer holds window - 1 + 2 batches + 2 blocks of 16 tokens, a global one the context;
# each further sequence holds window + 2 blocks on a sliding layer. Bytes, then GiB.
HAND = {
    # E2B: 12 sliding layers (1 KV head of 256, window 512), 3 global (1 of 512); 5.55B bf16.
    # sliding 12 x 1024 x (511 + 8192 + 32) + global 3 x 2048 x 32768.
    "e2b": ("l4", "bf16", 1, 32768, 4096, 0.92, 308_662_272, 208_011_264, 5.55e9 * 2),
    # E4B on a 24 GB slice (mig24-e4b-mtp): 20 sliding (2 KV heads of 256, window 512), 4
    # global (2 of 512), 16K context; 8.45B bf16.
    "e4b": (None, "bf16", 1, 16384, 4096, 0.90, 626_221_056, 290_717_696, 8.45e9 * 2),
    # 26B-A4B on one H100: 25 sliding (8 KV heads of 256, window 1024), 5 global (2 of 512).
    "26b-a4b": ("h100", "bf16", 1, 32768, 8192, 0.90, 4_242_595_840, 887_357_440, 25.75e9 * 2),
    # 31B over 4 L4s: 50 sliding (16 KV heads of 256, 4 a GPU), 10 global (4 of 512, 1 a GPU).
    "31b": ("l4", "bf16", 4, 32768, 4096, 0.92, 2_564_874_240, 887_357_440, 31.25e9 * 2),
}


@pytest.mark.parametrize("key", sorted(HAND))
def test_one_fit_per_model_by_hand(key):
    gpu, precision, tp, context, batched, util, first, more, weights = HAND[key]
    m = catalog.model(key)
    (c,) = [c for c in catalog.checkpoints(key) if c.precision == precision]
    gib = catalog.gpu(gpu).memory_gib if gpu else 24e9 / GIB  # a 24 GB slice, decimal
    f = memory.fit(
        m,
        c,
        gpu_gib=gib,
        utilization=util,
        tp=tp,
        max_model_len=context,
        max_num_seqs=2,
        batched=batched,
    )
    assert (f.first_gib * GIB, f.more_gib * GIB) == (pytest.approx(first), pytest.approx(more))
    assert f.weights_gib == pytest.approx(weights / tp / GIB)
    used = weights / tp / GIB + m.drafter_gib / tp + 3.0 + (first + more) / GIB
    assert f.spare_gib == pytest.approx(gib * util - used)


def test_fp8_and_nvfp4_weights_by_hand():
    # FP8 on load: the Linear layers at 1 byte, the embeddings (262144 x 5376 = 1.41B) and the
    # vision tower (0.55B) at 2. NVFP4: NVIDIA's checkpoint as published, 32.7 GB.
    by = {c.precision: c for c in catalog.checkpoints("31b")}
    assert by["fp8"].gpu_gib * GIB == pytest.approx(30.7e9 - 1.41e9 + (1.41e9 + 0.55e9) * 2)
    assert by["nvfp4"].gpu_gib * GIB == pytest.approx(32.7e9)
    assert 262144 * 5376 == pytest.approx(1.41e9, rel=0.001)


def test_the_seeds_unverified_h100_shape_is_under_the_margin_and_said_to_be_unverified():
    # The seed's `safe80` (32K, 4096 batched tokens, one sequence) fits one H100 with 0.02 GiB to
    # spare by the estimate (the review's hand figure, with the drafter at 0.86 GiB rather than
    # the table's 0.9: 0.07): under the margin, so the generator chose its own shape, and two
    # H100s serve the 32K.
    prof = profiles.get("h100-31b-mtp")
    safe80 = dataclasses.replace(
        prof, max_model_len=32768, max_num_batched_tokens=4096, max_num_seqs=1
    )
    f = pv.estimated_fit(safe80)
    assert f.fits and not f.roomy and f.line().endswith("<= 71.7 GiB (0.02 spare)")
    assert pv.estimated_fit(prof).spare_gib >= memory.MIN_SPARE_GIB
    assert profiles.get("h100x2-31b-mtp").max_model_len == 32768
    assert prof.provenance.startswith("unverified: the peer project's `safe80`")
    # At 8192 batched tokens MTP's two batches in flight need ~15.8 GiB of KV for one 32K
    # request: the validator warns.
    wide = dataclasses.replace(safe80, max_num_batched_tokens=8192)
    (finding,) = [f for f in pv.check(wide) if f.code == "memory-fit"]
    assert finding.level == "warning" and "15.8 for one full request" in finding.message


def test_a_reference_that_does_not_fit_or_leaves_no_margin_is_a_table_error(monkeypatch):
    h100 = next(r for r in catalog.REFERENCES if r.gpu == "h100")
    safe80 = {"max_model_len": 32768, "max_num_batched_tokens": 4096, "max_num_seqs": 1}
    for values, error in (
        ({**safe80, "max_num_batched_tokens": 8192}, r"> 71\.7 GiB \(\d+\.\d\d short\)"),
        (safe80, r"<= 71\.7 GiB \(0\.02 spare\), under the 0\.5 GiB margin"),
    ):
        ref = dataclasses.replace(h100, values={**h100.values, **values})
        monkeypatch.setattr(catalog, "REFERENCES", (ref,))
        with pytest.raises(generated.TableError, match=r"reference h100x1 31b: .*" + error):
            generated.plan()


def test_every_shipped_gpu_profile_states_max_num_seqs_and_a_queue_bound():
    # The CPU ones serve the tiny dev model in the tests, where vLLM's CPU default is fixed
    # (128 x world size, vllm/engine/arg_utils.py get_batch_defaults), not the device's.
    for name, prof in profiles.all_profiles().items():
        if prof.hardware.device != "cuda":
            continue
        assert prof.max_num_seqs is not None and prof.queue_bound is not None, name


def test_every_generated_profile_keeps_the_margin_and_states_its_precisions_floor():
    floors = {"bf16": "8.0", "fp8": "8.9", "nvfp4": "10.0"}
    for s in SHAPES:
        assert s.fit.spare_gib >= memory.MIN_SPARE_GIB, s.name
        prof = profiles.get(s.name)
        assert prof.hardware.compute_capability == floors[s.checkpoint.precision], s.name
    # The hand-written GPU profiles state their precision's floor too.
    for name in ("l4x4-31b", "l4x4x2-31b-mtp", "mig24-e4b-mtp"):
        assert profiles.get(name).hardware.compute_capability == "8.0"
    assert profiles.get("spark2-31b-nvfp4-mtp").hardware.compute_capability == "10.0"


def test_seed_hosts_say_where_their_values_come_from(cli_run):
    assert profiles.get("l4x4-31b-mtp").provenance.startswith("measured: 4x L4")
    assert profiles.get("mig24-e4b-mtp").provenance.startswith("measured: one 1g.24gb MIG")
    index = generated.outputs()[f"{generated.FOLDER}/INDEX.md"]
    assert "`h100-31b-mtp` (unverified: the peer project's `safe80`" in index
    res = cli_run(["profiles", "show", "h100-31b-mtp"])
    assert res.stdout.startswith("vllm serve google/gemma-4-31B-it ")
    fit_line = pv.estimated_fit(profiles.get("h100-31b-mtp")).line()
    assert f"fit per GPU (appliance/profiles/fit.py): {fit_line}\n" in res.stderr
    assert "values unverified: the peer project's `safe80`" in res.stderr


def test_tensor_parallel_must_divide_the_heads_as_vllm_requires():
    m31, m26 = catalog.model("31b"), catalog.model("26b-a4b")
    assert memory.tp_problem(m31, 8) is None  # 32 heads; 4 global KV heads replicated
    assert "does not divide Gemma 4 31B-it's 32 heads" in memory.tp_problem(m31, 3)
    assert memory.tp_problem(m26, 32) is not None  # 16 heads
    # The validator says it before the engine does.
    bad = dataclasses.replace(profiles.get("l4x4x2-31b-mtp"), tensor_parallel_size=6)
    assert "tensor-parallel-heads" in {f.code for f in pv.errors(pv.check(bad))}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),  # an L40S is not an L4
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A100-SXM4-40GB", "a100-40g"),
        ("NVIDIA A100-SXM4-80GB", "a100-80g"),
        ("NVIDIA A100 80GB PCIe", "a100-80g"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA GeForce RTX 5090", "rtx5090"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtxpro6000"),
        ("NVIDIA GB10", "spark"),
        ("NVIDIA GeForce RTX 5070 Ti", None),
    ],
)
def test_nvidia_smi_names_identify_the_tables_gpus(name, key):
    found = catalog.identify(name)
    assert (found.key if found else None) == key


def test_every_figure_names_its_source():
    for m in catalog.MODELS:
        assert m.sources and all(s.startswith("https://") for s in m.sources), m.key
    for g in catalog.GPUS:
        assert any(s.startswith("https://") for s in g.sources), g.key
        assert catalog.CUDA_GPUS in g.sources, g.key  # the compute capability
    for c in catalog.CHECKPOINTS:
        assert c.how, (c.model, c.precision)


def test_generated_files_say_their_fit_and_that_they_are_generated():
    text = profiles.shipped_text("h200-31b-mtp")
    assert text.startswith(
        "# Generated by `appliance dev generate` from appliance/profiles/catalog"
    )
    assert "# Fit per GPU (140.4 GiB usable of 141 GB, at 0.90;" in text
    index = generated.outputs()[f"{generated.FOLDER}/INDEX.md"]
    assert f"{len(SHAPES)} profiles; {len(OMITTED)} combinations left out" in index
    assert "| NVIDIA H200 (141 GB) | 31B-it | bf16 | `h200-31b-mtp` | 1 |" in index


def test_profiles_list_shows_the_generated_profiles(cli_run):
    res = cli_run(["profiles", "list"])
    assert "h200-31b-mtp" in res.output and "spark-e4b-mtp" in res.output
