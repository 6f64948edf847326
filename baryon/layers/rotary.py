"""Rotary position embedding: frequencies for each supported `rope_type`, and the layer."""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The checkpoint's RoPE settings as one dict with `rope_type` and `rope_theta`, whether the
    config uses transformers 5's `rope_parameters` or the older `rope_scaling` + `rope_theta`;
    layer_type: those of one kind of layer where the config keeps a dict per kind (Gemma 3:
    `sliding_attention`, `full_attention`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, scaling = dict(params[layer_type]), {}  # (transformers 5's rope_scaling: the same nested dict)
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if getattr(hf_config, "original_max_position_embeddings", None):  # Phi-3 keeps it beside the RoPE settings
        params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    return params


def uses_long_factors(params: dict[str, Any], max_model_len: int) -> bool:
    """LongRoPE: whether an engine whose sequences reach max_model_len tokens takes the long
    factors. transformers picks them per forward pass, for a sequence past
    original_max_position_embeddings; an engine's cached keys must keep one set, so it takes the
    long set for every sequence where any may pass that length (as vLLM does), else the short."""
    return max_model_len > params["original_max_position_embeddings"]


def inverse_frequencies(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """Returns inv_freq [rotary_dim // 2] float32 and the factor applied to cos/sin. `freq_factors`
    (a GGUF file's `rope_freqs`, llama.cpp's form of Llama 3.1-style scaling): each frequency of
    the rope type's divided by its factor."""
    inv_freq, scaling = _type_frequencies(rotary_dim, params, max_position)
    factors = params.get("freq_factors")
    if factors is None:
        return inv_freq, scaling
    if len(factors) != len(inv_freq):
        raise ValueError(f"rope freq_factors has {len(factors)} factors for {len(inv_freq)} rotary frequencies")
    return inv_freq / torch.tensor(factors, dtype=torch.float32), scaling


def _type_frequencies(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, params, max_position)
    if rope_type == "longrope":
        return _longrope(rotary_dim, base, params, max_position)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, a smooth blend in between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def _yarn(dim: int, base: float, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale cos/sin by mscale."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(dim: int, base: float, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, Phi-4-mini): each frequency divided by its own factor, of the long set
    where `long_factors` is set (EngineConfig sets it: `uses_long_factors`), else the short one;
    cos/sin scaled by sqrt(1 + ln(factor) / ln(original length)), factor = max_position /
    original length unless given."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if params.get("long_factors") else "short_factor"
    factors = torch.tensor(params[name], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ValueError(f"rope {name} has {factors.numel()} factors for {dim // 2} rotary frequencies")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base ** exponents), float(attention_factor)


def rotary_table(rotary_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    """The cos/sin table of NeoX-style rotary embedding over the first `rotary_dim` features of each
    head: [max_position, rotary_dim] float32 (cos half | sin half), whatever the model dtype."""
    inv_freq, scaling = inverse_frequencies(rotary_dim, params, max_position)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim // 2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def identity_table(head_dim: int, max_position: int) -> torch.Tensor:
    """No position encoding (SmolLM3's NoPE layers): cos 1 and sin 0 at every position, so that the
    QKV prologue's rotation leaves queries and keys exactly as they are and such a layer keeps the
    rest of the fused path (QK norm, the KV-cache write). [max_position, head_dim] float32."""
    ones = torch.ones(max_position, head_dim // 2)
    return torch.cat((ones, torch.zeros_like(ones)), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds a cos/sin table (`rotary_table`, `identity_table`) that the attention layer's QKV
    prologue applies."""

    def __init__(self, cos_sin: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False)


# Tables shared by every layer that asks for the same one (a model's layers all do): one
# [max_position, rotary_dim] float32 table per model instead of one per layer (DeepSeek-V3: 42 MB a
# layer, 2.5 GB over 61). Weak values: a table goes with the last model that uses it.
_TABLES: weakref.WeakValueDictionary[tuple, RotaryEmbedding] = weakref.WeakValueDictionary()


def get_rope(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding of `hf_config` (of its `layer_type` layers, see rope_parameters) for
    heads of head_dim features, shared with every other layer of the same table on the same device."""
    params = rope_parameters(hf_config, layer_type)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} (rope_scaling in config.json) is not "
                         f"supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    key = (rotary_dim, hf_config.max_position_embeddings, json.dumps(params, sort_keys=True, default=str),
           str(torch.get_default_device()))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = RotaryEmbedding(rotary_table(rotary_dim, hf_config.max_position_embeddings, params))
    return table


def get_identity_rope(hf_config: Any, head_dim: int) -> RotaryEmbedding:
    """The identity table's embedding for heads of head_dim features, shared as get_rope's are."""
    key = ("identity", head_dim, hf_config.max_position_embeddings, str(torch.get_default_device()))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = RotaryEmbedding(identity_table(head_dim, hf_config.max_position_embeddings))
    return table


def interleaved_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Query / key projection rows whose heads pair their rotary features interleaved (x0, y0,
    x1, y1, ...: llama.cpp's stored order; Cohere's rotation of pairs (2i, 2i + 1)) reordered into
    halves (x0, x1, ..., y0, y1, ...), the NeoX pairs (i, i + head_dim / 2) the QKV prologue rotates.
    The same reorder of queries and keys leaves every score unchanged. weight: [num_heads *
    head_dim(, in)] -> same shape."""
    shape = weight.shape
    # [num_heads, head_dim / 2, 2, *in] -> [num_heads, 2, head_dim / 2, *in]
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
