"""Tiny Gemma 4 models for the real CPU engine, generated offline and deterministically.

``build(dir)`` writes two directories that vLLM serves with ``--speculative-config
'{"method":"mtp",...}'``:

- ``DIR/target``: a ``gemma4_text`` causal LM (hidden 128, 2 layers, sliding + full attention,
  equal head sizes so the CPU build does not need its Triton attention backend).
- ``DIR/drafter``: a ``gemma4_assistant`` MTP drafter (hidden 64, every layer KV-shared with the
  target), which vLLM rewrites to ``gemma4_mtp``.

Both carry the same byte-level tokenizer and a small chat template. The target's random weights
make it greedily repeat its last input token; a ``copy`` drafter is built to predict exactly that
(accepted almost always), a ``random`` drafter is plain random init (accepted almost never), and
a ``partial`` drafter is the copy drafter perturbed by the hidden state it is fed, so that its
acceptance is in between and falls with the draft position (the first position reads the
target's hidden state, later ones the drafter's own, which compounds the error). So acceptance is
controllable from the test side, through the real MTP code path.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

DRAFTER_KINDS: tuple[str, ...] = ("copy", "partial", "random")

# The partial drafter: the copy drafter plus a read of the hidden state it is fed. At the first
# draft position that is the target's hidden state (scaled by PARTIAL_READ), at later ones the
# drafter's own post-projection (scaled by PARTIAL_FEEDBACK), so errors compound by position.
# Chosen by replaying the drafter's arithmetic (its layers are identities) on the target's hidden
# states over the shipped bench prompts, seed 0, greedy, 64 tokens: per-position acceptance about
# 0.78/0.54/0.54 at k=3 (positions 2 and 3 alike: the feedback settles after one step).
PARTIAL_READ = 7.0
PARTIAL_FEEDBACK = 0.6

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
VOCAB_SIZE = 512  # 6 specials + 256 bytes, padded
TARGET_HIDDEN = 128
DRAFTER_HIDDEN = 64
HEAD_DIM = 32
SERVED_NAME = "gemma4-tiny"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class DevModel:
    """Paths of a built tiny model pair."""

    root: Path
    drafter_kind: str
    seed: int

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"


def load(root: Path) -> DevModel:
    """Open an existing model directory written by :func:`build`."""
    try:
        meta = json.loads((Path(root) / "devmodel.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{root} is not a tiny model directory",
            fix="build one with: appliance dev devmodel DIR",
        ) from exc
    return DevModel(Path(root), meta["drafter"], meta["seed"])


def build(root: Path | str, drafter: str = "copy", seed: int = 0) -> DevModel:
    """Generate the tiny target + drafter pair into ``root`` (new or empty), atomically."""
    root = Path(root)
    if drafter not in DRAFTER_KINDS:
        raise UsageError(f"unknown drafter kind {drafter!r}", fix="use copy, partial or random")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UsageError(f"{root} is not empty", fix="give a new or empty directory")
    parent = root.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=parent))
    except OSError as exc:
        raise UsageError(f"cannot write to {parent}: {exc.strerror}") from exc
    try:
        _write_pair(staging, drafter, seed)
        _make_readable(staging)
        try:
            if root.exists():
                root.rmdir()
            os.replace(staging, root)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Another builder's pair landed at root since the check above.
            raise UsageError(f"{root} is not empty", fix="give a new or empty directory") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return DevModel(root, drafter, seed)


def cached(drafter: str = "copy", seed: int = 0, cache_dir: Path | None = None) -> DevModel:
    """The per-user cached pair, built on first use (safe against concurrent builders)."""
    base = Path(cache_dir) if cache_dir else cache_root() / "devmodels"
    root = base / f"seed{seed}-{drafter}-v1"
    if (root / "devmodel.json").exists():
        return load(root)
    try:
        return build(root, drafter, seed)
    except UsageError:
        # Another process finished first; its result is as good as ours.
        if (root / "devmodel.json").exists():
            return load(root)
        raise


def cache_root() -> Path:
    """Where the appliance caches per-user artifacts (``APPLIANCE_CACHE_DIR`` overrides)."""
    env = os.environ.get("APPLIANCE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "gemma4-appliance"


# --- generation ------------------------------------------------------------------------------


def _write_pair(out: Path, drafter: str, seed: int) -> None:
    import torch  # heavy: only when building

    tokenizer = _tokenizer()
    gen = torch.Generator().manual_seed(seed)
    target_sd, target_cfg = _target(gen)
    drafter_sd, drafter_cfg = _drafter(gen, target_sd, drafter)
    for name, sd, cfg in (("target", target_sd, target_cfg), ("drafter", drafter_sd, drafter_cfg)):
        d = out / name
        d.mkdir()
        _save(d, sd, cfg)
        tokenizer.save_pretrained(d)
        (d / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}, indent=2) + "\n"
        )
    meta = {"drafter": drafter, "seed": seed, "served_model_name": SERVED_NAME, "format": 1}
    (out / "devmodel.json").write_text(json.dumps(meta, indent=2) + "\n")


def _tokenizer():
    """A byte-level BPE with no merges: every byte is a token, so no training and no corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _text_config(hidden: int, layers: int, kv_shared: int) -> dict:
    return {
        "model_type": "gemma4_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        # transformers 5.5 (vLLM 0.19's) reads a missing global_head_dim as 512.
        "global_head_dim": HEAD_DIM,
        "num_global_key_value_heads": 2,
        "layer_types": ["sliding_attention", "full_attention"][:layers],
        "sliding_window": 128,
        "max_position_embeddings": 2048,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": kv_shared,
        "tie_word_embeddings": True,
        "final_logit_softcapping": None,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "dtype": "float32",
    }


def _target(gen):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = _text_config(TARGET_HIDDEN, 2, 0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**cfg))
    sd = _randomise(model.state_dict(), gen, std=0.2)
    out = model.config.to_dict()
    out.update(architectures=["Gemma4ForCausalLM"], global_head_dim=HEAD_DIM)
    return sd, out


def _drafter(gen, target_sd: dict, kind: str):
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    text = Gemma4TextConfig(**_text_config(DRAFTER_HIDDEN, 2, 2))
    cfg = Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=TARGET_HIDDEN, use_ordered_embeddings=False
    )
    model = Gemma4AssistantForCausalLM(cfg)
    sd = _randomise(model.state_dict(), gen, std=0.2)
    if kind in ("copy", "partial"):
        # Make the drafter predict "the last token again", which is what the target does:
        # drafter embeddings = target embeddings projected to the drafter's width (row-normed),
        # pre_projection reads only the token-embedding half through the same projection, and
        # the layers are identities (attention and MLP outputs zeroed).
        emb = target_sd["model.embed_tokens.weight"]
        proj = torch.randn(TARGET_HIDDEN, DRAFTER_HIDDEN, generator=gen) / DRAFTER_HIDDEN**0.5
        d_emb = emb @ proj
        d_emb = d_emb / d_emb.norm(dim=1, keepdim=True)
        sd["model.embed_tokens.weight"] = d_emb
        pre = torch.zeros(DRAFTER_HIDDEN, 2 * TARGET_HIDDEN)
        pre[:, :TARGET_HIDDEN] = proj.T
        sd["pre_projection.weight"] = pre
        for key in sd:
            if key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                sd[key] = torch.zeros_like(sd[key])
    if kind == "partial":
        # Drawn after the copy drafter's weights, so copy and partial share everything else.
        read = torch.randn(DRAFTER_HIDDEN, TARGET_HIDDEN, generator=gen) / TARGET_HIDDEN**0.5
        sd["pre_projection.weight"][:, TARGET_HIDDEN:] = read * PARTIAL_READ
        back = torch.randn(TARGET_HIDDEN, DRAFTER_HIDDEN, generator=gen) / DRAFTER_HIDDEN**0.5
        sd["post_projection.weight"] = back * PARTIAL_FEEDBACK
    out = cfg.to_dict()
    out["architectures"] = ["Gemma4AssistantForCausalLM"]
    out["text_config"]["global_head_dim"] = HEAD_DIM
    return sd, out


def _randomise(sd: dict, gen, std: float) -> dict:
    """Fresh weights from our generator (not the global RNG), so a seed fixes every byte."""
    import torch

    out = {}
    for key, value in sd.items():
        if not value.is_floating_point():
            out[key] = value.clone()
        elif "norm" in key or key.endswith("layer_scalar"):
            out[key] = torch.ones_like(value)
        else:
            out[key] = torch.randn(value.shape, generator=gen) * std
    return out


def _make_readable(root: Path) -> None:
    """World-readable files: a container may serve them as a non-root user."""
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _save(d: Path, sd: dict, cfg: dict) -> None:
    from safetensors.torch import save_file

    # Embeddings are tied: the head is the embedding matrix, so it is not stored twice.
    tensors = {k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
