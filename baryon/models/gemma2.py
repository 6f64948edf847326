"""Gemma 2 (`Gemma2ForCausalLM`: gemma-2-2b, 9b, 27b), and the decoder Gemma 3 builds on.

Against the Llama decoder: the embeddings scaled by sqrt(hidden_size) (rounded to the model
dtype, as transformers scales them), RMSNorms that multiply by (1 + weight) (the loader stores
1 + weight in float32, so the engine's norm kernels apply them as they are, in float32), four
norms a layer (after attention and after the MLP too, on the block's output before the residual
add; each block's output norm, the add and the next block's input norm run as one kernel), the softmax
scale query_pre_attn_scalar^-0.5, GELU-tanh gating, local / global layers (`layer_types`: a
sliding window on the first), and logit soft-capping: attention scores capped to
50 tanh(s / 50) before the softmax (`attn_logit_softcapping`, in the attention kernels) and the
final logits to 30 tanh(x / 30) (`final_logit_softcapping`, in the LM head's gather).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.attention import Attention
from baryon.layers.embedding import VocabParallelEmbedding
from baryon.layers.linear import QKVParallelLinear, RowParallelLinear, copy_checked
from baryon.layers.mlp import GatedMLP
from baryon.layers.norm import RMSNorm, norm_add_norm
from baryon.layers.rotary import get_rope
from baryon.models.llama import LlamaForCausalLM, head_dim_of, layer_type_of, sliding_window_of


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm multiplies by (1 + weight): the checkpoint's weight plus one is what it holds,
    in float32, as transformers computes it (the product in float32, rounded once to the model dtype)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, weight_dtype=torch.float32)
        # 1 + w computed in float64 and rounded once to float32: transformers' float32 sum for a
        # 16- or 32-bit w, and exact for a GGUF file's float64 (1 + w) - 1 (loader/gguf.py)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param.data, (loaded.double() + 1).float())


class Gemma2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = get_rope(config, head_dim, layer_type_of(config, layer_idx))
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              scale=getattr(config, "query_pre_attn_scalar", head_dim) ** -0.5,  # (Gemma 1: head_dim)
                              sliding_window=sliding_window_of(config, layer_idx),
                              logit_softcap=getattr(config, "attn_logit_softcapping", None))
        self.q_norm: RMSNorm | None = None  # per-head norms of queries and keys (Gemma 3 has them)
        self.k_norm: RMSNorm | None = None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb, self.q_norm, self.k_norm))


class Gemma2DecoderLayer(nn.Module):
    """Takes the normalised input (the model applies input_layernorm) and returns the MLP's output
    before post_feedforward_layernorm: each block's output norm, the residual add and the next
    block's input norm run as one kernel (`norm_add_norm`), in the layer and between layers."""

    attention_class = Gemma2Attention

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act=config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)  # on the attention's output
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)  # on the MLP's output

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states: input_layernorm's output; residual: the stream it normalised. Returns (the
        MLP's output, not normalised yet, the residual stream before it)."""
        attended = self.self_attn(positions, hidden_states)
        hidden_states, residual = norm_add_norm(self.post_attention_layernorm, attended, residual,
                                                self.pre_feedforward_layernorm)
        return self.mlp(hidden_states), residual


class Gemma2Model(nn.Module):
    layer_class = Gemma2DecoderLayer

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) in the model dtype: transformers multiplies by it rounded so
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5).to(torch.get_default_dtype()))
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens(input_ids) * self.embed_scale  # [num_tokens, hidden]
        hidden_states = self.layers[0].input_layernorm(residual)
        for i, layer in enumerate(self.layers):
            mlp_out, residual = layer(positions, hidden_states, residual)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden_states, residual = norm_add_norm(layer.post_feedforward_layernorm, mlp_out, residual, after)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class = Gemma2Model

    def __init__(self, config: Any) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=true (an embedding model) is not supported: baryon "
                             "serves causal language models")
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(config, field, None)
            if cap is not None and not cap > 0:
                raise ValueError(f"{field}={cap}: a soft-cap must be a positive number, or null for none")
        super().__init__(config)
        self.lm_head.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        return cls.model_class(config)
