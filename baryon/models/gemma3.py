"""Gemma 3 text models (`Gemma3ForCausalLM`: gemma-3-1b and the text-only checkpoints), and the
language model of the image-and-text checkpoints (`Gemma3ForConditionalGeneration`: 4b-27b).

Against the Llama decoder: the embeddings scaled by sqrt(hidden_size) (rounded to the model
dtype, as transformers scales them), RMSNorms that multiply by (1 + weight) (the loader stores
1 + weight, so the engine's norm kernels apply them as they are), four norms a layer (after
attention and after the MLP too, on the block's output before the residual add), per-head
RMSNorm on queries and keys, the softmax scale query_pre_attn_scalar^-0.5, GELU-tanh gating,
and local / global layers (`layer_types`: a sliding window and the local RoPE base on the first,
full attention and the global RoPE settings on the second). Logit soft-capping (Gemma 2) is
refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.distributed.parallel_state import tp_settle_pushes
from baryon.layers.attention import Attention
from baryon.layers.embedding import VocabParallelEmbedding
from baryon.layers.linear import QKVParallelLinear, RowParallelLinear, copy_checked
from baryon.layers.mlp import GatedMLP
from baryon.layers.norm import RMSNorm
from baryon.layers.rotary import get_rope
from baryon.models.llama import LlamaForCausalLM, head_dim_of, sliding_window_of


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm multiplies by (1 + weight): the checkpoint's weight plus one is what it holds."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param.data, loaded.float() + 1)


def _layer_type(config: Any, layer_idx: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_idx] if layer_types else "full_attention"


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = get_rope(config, head_dim, _layer_type(config, layer_idx))
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              scale=config.query_pre_attn_scalar ** -0.5, sliding_window=sliding_window_of(config, layer_idx))
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb, self.q_norm, self.k_norm))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act=config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)  # on the attention's output
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)  # on the MLP's output

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output, the residual stream before it): the next norm adds them."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) in the model dtype: transformers multiplies by it rounded so
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5).to(torch.get_default_dtype()))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids) * self.embed_scale, None  # [num_tokens, hidden]
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        tp_settle_pushes()
        return hidden_states


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, field, None) is not None:
                raise ValueError(f"{field}={getattr(config, field)} (logit soft-capping, Gemma 2) is not supported; "
                                 f"supported: Gemma 3, whose configs set it to null")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=true (an embedding model) is not supported: baryon "
                             "serves causal language models")
        super().__init__(config)

    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        return Gemma3Model(config)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 image-and-text checkpoint, served alone: its config is the
    checkpoint's `text_config` (baryon.config.LANGUAGE_MODEL_ONLY), its tensors those under
    `language_model.`; the vision tower and the projector are not loaded (images unsupported)."""

    weights_mapping = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                       "model.language_model.": "model."}  # (the hub's layout; transformers 5's in memory)
    skipped_checkpoint_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                   "model.multi_modal_projector.")
