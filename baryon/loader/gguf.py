"""GGUF checkpoints (llama.cpp's single-file format): the model config from the file's metadata,
and its tensors dequantized one at a time under Hugging Face names.

The `gguf` package does the reading (`GGUFReader`) and the dequantizing (`gguf.quants`); this
module maps llama.cpp's names and layout onto what baryon's models load from a safetensors
checkpoint:

- metadata (`llama.block_count`, `llama.attention.head_count`, ...) -> a transformers config of
  the same architecture, as config.json would give it;
- tensor names (`blk.3.attn_q.weight`) -> checkpoint names (`model.layers.3.self_attn.q_proj.weight`);
- llama.cpp's converter permutes the rows of the query and key projections of `llama` models
  (rotary pairs interleaved instead of split in halves); the permutation is undone here.

The tokenizer and chat template also live in the metadata; `baryon.tokenizer` builds them.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from typing import Any

import gguf
import gguf.quants
import numpy as np
import torch
from gguf import Keys

from baryon.layers.rotary import interleaved_to_halves

# GGUF `general.architecture` -> (transformers model_type, config.json architecture).
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),  # with experts (expert_count > 0): Mixtral
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),  # q/k/v and gate/up fused (attn_qkv, ffn_up), as in its checkpoints
    "granite": ("granite", "GraniteForCausalLM"),  # Llama's layout with four multipliers in the metadata
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),  # the text model of every Gemma 3 (images: a separate mmproj file)
}
# Architectures whose norm weights llama.cpp's converter stores with the 1 of Gemma's (1 + weight) added.
_SHIFTED_NORMS = ("gemma", "gemma2", "gemma3")
MIXTRAL = ("mixtral", "MixtralForCausalLM")
# Architectures whose query/key rows llama.cpp's converter permutes (rotary pairs interleaved).
_PERMUTED_QK = ("llama", "granite")

# ggml tensor types baryon reads (dequantized with gguf.quants), by name: the legacy and K-quants,
# the i-quants (IQ4_XS / IQ3_S / IQ2_M ... files), the ternary TQ types and MXFP4 / NVFP4.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                   "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
                   "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
# Types that can also stay packed (baryon.kernels.block_quant's layout), with their code width.
# The 5-bit types are stored as 8-bit codes (0..31): exact, and the integer kernels read them as
# they read Q8_0. Q6_K (a scale per 16 elements, no offset) has its own layout, bits 6: int8 codes
# q - 32 and the two 16-element scales of each 32-block.
PACKABLE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 6, "Q8_0": 8}
# Types whose block scales and offsets are float16 values (d, m, and Q4_0 / Q5_0's -8 d / -16 d):
# their packed rows keep them as float16 pairs, as many bytes as the GGUF blocks. The K-quants'
# scales (d times a 6-bit or 8-bit sub-scale) need float32.
HALF_PAIR_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})


def packed_format(type_name: str) -> tuple[int, int] | None:
    """(code bits, pair bytes) of a ggml type's packed rows; None where it cannot stay packed."""
    if type_name not in PACKABLE_BITS:
        return None
    return PACKABLE_BITS[type_name], 4 if type_name in HALF_PAIR_TYPES else 8

# GGUF tensor name -> Hugging Face checkpoint name; `{bid}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, the experts stacked [experts, out, in] (split per expert,
    # `{e}`, when read), and Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Phi-3's: its fused modules.
_PHI3_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 2 and 3: four norms a layer (ffn_norm is the one before the MLP).
_GEMMA2_BLOCK_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Tensors read into the config, not loaded: Llama 3.1's rope divisors, Phi-3's LongRoPE factors.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Mixtral's checkpoint names for the same tensors.
_MIXTRAL_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_gate_inp": "block_sparse_moe.gate",
                        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}


class GGUFError(ValueError):
    """A GGUF file that baryon cannot read: truncated, corrupt, or holding something unsupported."""


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same bytes, but slicing a plain
    array skips np.memmap's per-slice bookkeeping, which makes parsing the ~100k vocabulary
    strings of a tokenizer four times faster."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._mapped = mapped.view(np.ndarray)  # still backed by the file's mapping


def open_gguf(path: str) -> gguf.GGUFReader:
    """A reader of `path` (complete: the reader maps every tensor's bytes) whose tensors are all of
    a supported type. Loading asks for the config, the packing plan and the tensors: parsing the
    metadata (the vocabulary) takes seconds, so the reader of an unchanged file is reused."""
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        reader = _Reader(path)
    except Exception as e:  # a cut or damaged file fails in many ways (a short tensor cannot be reshaped, ...)
        raise GGUFError(f"cannot read the GGUF file {path} ({size} bytes): it is truncated, corrupt, or "
                        f"holds a tensor type newer than the installed gguf package knows "
                        f"({type(e).__name__}: {e})") from e
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor {tensor.name!r} in {path} has ggml type {tensor.tensor_type.name}, "
                            f"which baryon cannot read; supported types: {', '.join(SUPPORTED_TYPES)}")
    return reader


class _Metadata:
    """The file's key/value metadata, read with gguf's key names (`gguf.Keys`)."""

    def __init__(self, reader: Any, path: str) -> None:
        self.fields, self.path = reader.fields, path
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key.format(arch=self.arch) if "{arch}" in key else key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"GGUF file {self.path} has no metadata key {key.format(arch=self.arch)!r}")
        return value


def gguf_config(path: str) -> Any:
    """The transformers config (LlamaConfig, Qwen2Config or Qwen3Config) that the file's metadata
    describes, with `architectures` set as config.json would have it."""
    from transformers import AutoConfig

    reader = open_gguf(path)
    meta = _Metadata(reader, path)
    if meta.arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF file {path} holds a {meta.arch!r} model; supported GGUF architectures: "
                        f"{sorted(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"GGUF file {path} has no token_embd.weight tensor")
    model_type, architecture = MIXTRAL if _is_mixtral(meta) else ARCHITECTURES[meta.arch]
    hidden, heads = meta.require(Keys.LLM.EMBEDDING_LENGTH), meta.require(Keys.Attention.HEAD_COUNT)
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    if not isinstance(kv_heads, int):
        raise GGUFError(f"GGUF file {path} gives per-layer KV head counts {kv_heads}; baryon needs one count")
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    rotary_dim = meta.get(Keys.Rope.DIMENSION_COUNT, head_dim)
    for key in (Keys.Attention.VALUE_LENGTH,) + ((Keys.Rope.DIMENSION_COUNT,) if meta.arch != "phi3" else ()):
        if meta.get(key, head_dim) != head_dim:
            raise GGUFError(f"GGUF file {path}: {key.format(arch=meta.arch)}={meta.get(key)} differs from "
                            f"the head size {head_dim}; baryon supports full-width rotary and equal key/value sizes")
    fields = dict(
        architectures=[architecture],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml shape [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=meta.get(Keys.LLM.FEED_FORWARD_LENGTH) or meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        num_hidden_layers=meta.require(Keys.LLM.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=meta.require(Keys.LLM.CONTEXT_LENGTH),
        rms_norm_eps=meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        rope_theta=meta.get(Keys.Rope.FREQ_BASE, 10000.0),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get(Keys.Tokenizer.BOS_ID),
        eos_token_id=_eos_token_ids(meta),
        pad_token_id=meta.get(Keys.Tokenizer.PAD_ID),
        dtype=_file_dtype(reader.tensors),
    )
    if meta.arch in ("llama", "granite") and not _is_mixtral(meta):
        fields.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors)
    if meta.arch == "granite":  # llama.cpp's names for the config's multipliers (a missing one: 1)
        fields.update(embedding_multiplier=meta.get(Keys.LLM.EMBEDDING_SCALE, 1.0),
                      residual_multiplier=meta.get(Keys.LLM.RESIDUAL_SCALE, 1.0),
                      attention_multiplier=meta.get(Keys.Attention.SCALE, 1.0 / math.sqrt(head_dim)),
                      logits_scaling=meta.get(Keys.LLM.LOGIT_SCALE, 1.0))
    fields.update(_moe_fields(meta, architecture))
    rope_scaling = _rope_scaling(meta)
    if "rope_freqs.weight" in tensors:  # Llama 3.1-3.3: the frequencies' divisors, as a tensor
        rope_scaling = {**(rope_scaling or {"rope_type": "default"}),
                        "freq_factors": _rope_factors(tensors["rope_freqs.weight"], head_dim, path)}
    if meta.arch == "phi3":
        phi3_fields, rope_scaling = _phi3_fields(meta, tensors, head_dim, rotary_dim)
        fields.update(phi3_fields)
    if meta.arch in ("gemma2", "gemma3"):
        gemma_fields, rope_scaling = _gemma_fields(meta, fields, rope_scaling)
        fields.update(gemma_fields)
    if rope_scaling is not None:
        fields["rope_scaling"] = rope_scaling
    return AutoConfig.for_model(model_type, **fields)


def _phi3_fields(meta: _Metadata, tensors: dict, head_dim: int, rotary_dim: int
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Phi-3's config fields and RoPE settings as llama.cpp's converter stores them: partial
    rotary (the rope dimension count), the sliding window, the original context length and, for
    LongRoPE files, the two factor sets as tensors (rope_factors_long / _short) with the
    attention factor."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.get(Keys.Rope.FREQ_BASE, 10000.0)}
    if rotary_dim != head_dim:
        factor = rotary_dim / head_dim
        if int(head_dim * factor) != rotary_dim:  # the model takes int(head_dim * factor) features
            factor = math.nextafter(factor, math.inf)
        rope["partial_rotary_factor"] = factor
    original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN) or meta.require(Keys.LLM.CONTEXT_LENGTH)
    factor_sets = ("rope_factors_long.weight", "rope_factors_short.weight")
    missing = [name for name in factor_sets if name not in tensors]
    if len(missing) == 1:
        raise GGUFError(f"GGUF file {meta.path} has no {missing[0]} beside the other LongRoPE factor set")
    if not missing:
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=_rope_factors(tensors["rope_factors_long.weight"], rotary_dim, meta.path),
                    short_factor=_rope_factors(tensors["rope_factors_short.weight"], rotary_dim, meta.path))
        if meta.get(Keys.Rope.SCALING_ATTN_FACTOR) is not None:
            rope["attention_factor"] = meta.get(Keys.Rope.SCALING_ATTN_FACTOR)
    return dict(original_max_position_embeddings=original, sliding_window=meta.get(Keys.Attention.SLIDING_WINDOW)), rope


def _gemma_fields(meta: _Metadata, fields: dict[str, Any], rope_scaling: dict[str, Any] | None
                  ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Gemma 2 / 3's config fields as llama.cpp stores or implies them: the soft-caps and the sliding
    window from the metadata (a Gemma 2 file without them, converted before the keys existed: 50,
    30 and 4,096, llama.cpp's defaults); which layers slide (`sliding_window_pattern` where the file
    has it: one flag a layer, or n: every n-th layer global, 0: every layer sliding; else llama.cpp's fixed
    patterns: every other layer on Gemma 2, five of six on Gemma 3); the softmax scale's
    query_pre_attn_scalar, not stored: the head size, but hidden / heads on the 27B models (46
    layers: Gemma 2, 62: Gemma 3), as llama.cpp derives it; and Gemma 3's RoPE per kind of layer:
    the file's base and scaling on the global layers, base 10,000 unscaled on the local."""
    defaults = (50.0, 30.0, 4096) if meta.arch == "gemma2" else (None, None, None)
    layers = fields["num_hidden_layers"]
    window = meta.get(Keys.Attention.SLIDING_WINDOW, defaults[2])
    is_27b = layers == (46 if meta.arch == "gemma2" else 62)
    out: dict[str, Any] = dict(
        query_pre_attn_scalar=fields["hidden_size"] // fields["num_attention_heads"] if is_27b else fields["head_dim"],
        attn_logit_softcapping=meta.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, defaults[0]),
        final_logit_softcapping=meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, defaults[1]), sliding_window=window)
    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"GGUF file {meta.path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=meta.arch)} "
                            f"has {len(pattern)} entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        every = (2 if meta.arch == "gemma2" else 6) if pattern is None else int(pattern)
        sliding = [every == 0 or (i + 1) % every != 0 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if meta.arch == "gemma2":
        return out, rope_scaling
    full = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": fields["rope_theta"]}
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return out, None


def _rope_factors(tensor, rotary_dim: int, path: str) -> list[float]:
    """A float32 tensor of one factor per rotary frequency: Llama 3.1's `rope_freqs` (divisors of
    each frequency base^(-2i / dim)), Phi-3's `rope_factors_long` / `_short`."""
    if tensor.tensor_type.name != "F32" or tuple(int(n) for n in tensor.shape) != (rotary_dim // 2,):
        raise GGUFError(f"GGUF file {path}: {tensor.name} is {tensor.tensor_type.name} "
                        f"{[int(n) for n in tensor.shape]}, not float32 [{rotary_dim // 2}] (one factor per "
                        f"rotary frequency of the {rotary_dim} rotated features)")
    return [float(v) for v in tensor.data]


def _is_mixtral(meta: _Metadata) -> bool:
    return meta.arch == "llama" and (meta.get(Keys.LLM.EXPERT_COUNT) or 0) > 0


def _block_names(meta: _Metadata) -> dict[str, str]:
    if _is_mixtral(meta):
        return _MIXTRAL_BLOCK_NAMES
    if meta.arch in ("gemma2", "gemma3"):
        return _GEMMA2_BLOCK_NAMES
    return _PHI3_BLOCK_NAMES if meta.arch == "phi3" else _BLOCK_NAMES


def _moe_fields(meta: _Metadata, architecture: str) -> dict[str, Any]:
    """Config fields of the mixture of experts, as llama.cpp's converter stores them (norm_topk_prob
    is usually not stored: llama.cpp renormalises Qwen3-MoE's and Mixtral's top-k weights, not
    Qwen2-MoE's)."""
    if architecture == "MixtralForCausalLM":
        return dict(num_local_experts=meta.require(Keys.LLM.EXPERT_COUNT),
                    num_experts_per_tok=meta.require(Keys.LLM.EXPERT_USED_COUNT))
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    fields = dict(num_experts=meta.require(Keys.LLM.EXPERT_COUNT),
                  num_experts_per_tok=meta.require(Keys.LLM.EXPERT_USED_COUNT),
                  moe_intermediate_size=meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
                  norm_topk_prob=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, architecture == "Qwen3MoeForCausalLM")),
                  decoder_sparse_step=1, mlp_only_layers=[])
    if architecture == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = meta.require(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
    return fields


def _eos_token_ids(meta: _Metadata) -> int | list[int] | None:
    """llama.cpp's end-of-generation ids: end of sequence, end of turn, end of message."""
    ids = []
    for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
        value = meta.get(key)
        if value is not None and value not in ids:
            ids.append(value)
    return ids[0] if len(ids) == 1 else (ids or None)


def _rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    kind = meta.get(Keys.Rope.SCALING_TYPE, "none")
    if kind == "none":
        return None
    factor = meta.require(Keys.Rope.SCALING_FACTOR)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": meta.require(Keys.Rope.SCALING_ORIG_CTX_LEN)}
        for key, name in ((Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
                          (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow")):
            if meta.get(key) is not None:
                scaling[name] = meta.get(key)
        return scaling
    raise GGUFError(f"GGUF file {meta.path}: RoPE scaling type {kind!r} is not supported; "
                    f"supported: none, linear, yarn")


def _file_dtype(tensors: list) -> torch.dtype:
    """The dtype a GPU runs this file in with dtype=auto: its float type when the matrices are
    stored as floats, bfloat16 when they are quantized (CPU runs float32 regardless)."""
    types = {t.tensor_type.name for t in tensors if len(t.shape) > 1}
    if types <= {"F32"}:
        return torch.float32
    if types <= {"F32", "F16"}:
        return torch.float16
    return torch.bfloat16


def checkpoint_name(gguf_name: str, block_names: dict[str, str] = _BLOCK_NAMES) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (block_names: the file's
    architecture's, `_block_names`); None if unknown. A stacked expert tensor gives a name with
    `{e}` where the expert id goes."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    return None


def _permuted_heads(arch: str, hf_config: Any) -> dict[str, int]:
    """GGUF block tensor kind -> heads of the rows llama.cpp permuted ({} for unpermuted files)."""
    if arch not in _PERMUTED_QK:
        return {}
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return {"attn_q": hf_config.num_attention_heads, "attn_k": kv_heads}


def packable_formats(path: str) -> dict[str, tuple[int, int] | None]:
    """Checkpoint name -> (code bits, pair bytes) of every matrix the file stores in a packable
    type, None for the other tensors (stacked expert tensors are left out: they are dequantized)."""
    reader = open_gguf(path)
    block_names = _block_names(_Metadata(reader, path))
    return {name: packed_format(t.tensor_type.name) if len(t.shape) == 2 else None
            for t in reader.tensors if len(t.shape) <= 2  # stacked experts are dequantized
            and (name := checkpoint_name(t.name, block_names)) is not None}  # (rope_freqs: read into the config)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32: [..., type_size] -> [...]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _block_codes(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks [rows, blocks, type_size] -> codes [rows, K], scale and min [rows, K / 32], with
    weight = scale * code + min for each 32 elements (the values gguf.quants.dequantize gives);
    Q6_K: int8 codes [rows, K], scale [rows, K / 16] and min None, weight = scale * code for each
    16 elements (what `pack_rows` takes for bits 6)."""
    rows = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1"):  # d (, m), 16 bytes: element j low nibble, j + 16 high
        scale = _fp16(blocks, 0)
        minimum = -8 * scale if type_name == "Q4_0" else _fp16(blocks, 2)
        qs = blocks[..., 2 if type_name == "Q4_0" else 4:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    elif type_name in ("Q5_0", "Q5_1"):  # d (, m), 4 bytes of high bits (bit j: element j), 16 as Q4_0
        scale = _fp16(blocks, 0)
        minimum = -16 * scale if type_name == "Q5_0" else _fp16(blocks, 2)
        high_at = 2 if type_name == "Q5_0" else 4
        high = np.unpackbits(np.ascontiguousarray(blocks[..., high_at:high_at + 4]), axis=-1, bitorder="little")
        qs = blocks[..., high_at + 4:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)
    elif type_name == "Q5_K":  # as Q4_K, then 32 bytes of high bits (bit i of byte j: sub-block i), 128 bytes
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        scale = (_fp16(blocks, 0)[..., None] * sc.reshape(*blocks.shape[:2], 8).astype(np.float32))
        minimum = -(_fp16(blocks, 2)[..., None] * m.reshape(*blocks.shape[:2], 8).astype(np.float32))
        qh = blocks[..., 16:48].reshape(*blocks.shape[:2], 1, 32)
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [rows, blocks, 8 sub-blocks, 32]
        qs = blocks[..., 48:].reshape(*blocks.shape[:2], 4, 1, 32)  # sub-block 2c: low nibbles, 2c + 1: high
        codes = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*blocks.shape[:2], 8, 32) | (high << 4)
    elif type_name == "Q8_0":  # d, 32 int8
        scale = _fp16(blocks, 0)
        minimum = np.zeros_like(scale)
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    elif type_name == "Q4_K":  # 256-element super-blocks: d, dmin, 8 six-bit (scale, min), 128 bytes
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        scale = (_fp16(blocks, 0)[..., None] * sc.reshape(*blocks.shape[:2], 8).astype(np.float32))
        minimum = -(_fp16(blocks, 2)[..., None] * m.reshape(*blocks.shape[:2], 8).astype(np.float32))
        qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)  # sub-block 2c: low nibbles, 2c + 1: high
        codes = np.concatenate([qs & 15, qs >> 4], axis=-2)
    elif type_name == "Q6_K":  # 256-element super-blocks: 128 bytes ql, 64 bytes qh, 16 int8 scales, d
        # Each 128-element half h: ql[h] holds elements 0..63 in its low nibbles and 64..127 in its high
        # nibbles; bits 2s..2s+1 of qh[h]'s byte i are the top bits of element 32s + i.
        lead = blocks.shape[:2]
        ql = blocks[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8).reshape(4, 1)
        q = (ql & 15).reshape(*lead, 8, 32) | ((qh & 3).reshape(*lead, 8, 32) << 4)  # [rows, blocks, 8, 32]
        codes = q.astype(np.int8) - 32  # -32..31
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        scale = _fp16(blocks, 208)[..., None] * sc  # [rows, blocks, 16]: exact (float16 times int8)
        return codes.reshape(rows, -1), scale.reshape(rows, -1), None
    else:
        raise GGUFError(f"ggml type {type_name} cannot stay packed; packable: {sorted(PACKABLE_BITS)}")
    return codes.reshape(rows, -1), scale.reshape(rows, -1), minimum.reshape(rows, -1)


def pack_gguf_tensor(tensor: Any) -> torch.Tensor:
    """A Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 matrix [out, in] -> baryon's packed rows, uint8
    [out, row_bytes(in, *packed_format(type))], holding exactly the values gguf.quants.dequantize gives."""
    from baryon.kernels.block_quant import pack_rows

    type_name = tensor.tensor_type.name
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    rows = int(tensor.shape[1])  # ggml shape [in, out]
    blocks = np.asarray(tensor.data).reshape(rows, -1, type_size)
    codes, scale, minimum = _block_codes(type_name, blocks)
    try:
        return pack_rows(codes, scale, minimum, *packed_format(type_name))
    except ValueError as e:  # a -8 d or -16 d past float16's range
        raise GGUFError(f"tensor {tensor.name!r} ({type_name}): {e}") from e


def iterate_gguf_weights(path: str, hf_config: Any,
                         packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (checkpoint name, tensor on CPU, path) for every tensor of the file, one at a time:
    float32 (dequantized when its turn comes, so only one dequantized tensor lives beside the
    model; the file itself is memory-mapped), or packed rows for the names in `packed`."""
    reader = open_gguf(path)
    meta = _Metadata(reader, path)
    permuted = _permuted_heads(meta.arch, hf_config)
    block_names = _block_names(meta)
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:  # read into the config's RoPE (gguf_config)
            continue
        name = checkpoint_name(tensor.name, block_names)
        if name is None:
            raise GGUFError(f"tensor {tensor.name!r} in {path} has no counterpart in a "
                            f"{hf_config.architectures[0]} checkpoint")
        try:
            if name in packed:
                weight = pack_gguf_tensor(tensor)  # uint8 [out, row_bytes]
            else:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32 [out(, in)]
                # An F32 tensor comes back as a read-only view of the file's mapping: torch wants a copy.
                weight = torch.from_numpy(array if array.flags.writeable else array.copy())
        except GGUFError:
            raise
        except Exception as e:
            raise GGUFError(f"cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}) "
                            f"in {path}: {type(e).__name__}: {e}") from e
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if kind in permuted:
            weight = interleaved_to_halves(weight, permuted[kind])  # undo llama.cpp's query/key row order
        if meta.arch in _SHIFTED_NORMS and tensor.name.rpartition(".")[0].endswith("norm"):
            # the checkpoint's weight, as the model's GemmaRMSNorm loads it: 1 + w taken off in
            # float64, exact, so that its (float64 + 1) gives the file's float32 value back bit for bit
            weight = weight.double() - 1
        if "{e}" in name:  # experts stacked [experts, out, in]: one tensor per expert
            for expert, matrix in enumerate(weight):
                yield name.format(e=expert), matrix, path
        else:
            yield name, weight, path
