"""Cohere (`CohereForCausalLM`: Command-R, Aya Expanse / Aya 23).

Against the Llama decoder: one LayerNorm a layer (mean removed, no bias, in float32: rounded
once) whose output feeds the attention and the MLP side by side, both added to the residual
stream; rotary pairs interleaved (features 2i and 2i + 1: the checkpoint's q / k rows are reordered
into the halves the QKV prologue rotates, which leaves every score as it was); the logits
multiplied by `logit_scale`. Command R+'s per-head q / k LayerNorms (`use_qk_norm`) are refused by name.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baryon.layers.embedding import VocabParallelEmbedding
from baryon.layers.linear import copy_checked
from baryon.layers.mlp import GatedMLP
from baryon.layers.rotary import interleaved_to_halves
from baryon.models.llama import LlamaAttention, LlamaForCausalLM


class CohereLayerNorm(nn.Module):
    """LayerNorm with a weight and no bias, computed in float32 and rounded once to the input's
    dtype, as transformers' CohereLayerNorm (the weight held in float32)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param.data, loaded.float())
        self.weight.expected_shards = frozenset([None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight, None, self.eps).to(x.dtype)


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act=config.hidden_act)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: the residual stream [num_tokens, hidden] -> the stream after this layer."""
        normed = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attn(positions, normed) + self.mlp(normed)  # (transformers' order)


class CohereModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CohereDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class CohereForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        if getattr(config, "use_qk_norm", False):
            raise ValueError("use_qk_norm=true (Command R+'s per-head q / k LayerNorms) is not supported; "
                             "supported: Cohere checkpoints without it (Command-R, Aya)")
        super().__init__(config)
        self.lm_head.final_logit_multiplier = config.logit_scale

    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        return CohereModel(config)

    @staticmethod
    def checkpoint_converters(config: Any) -> dict:
        """q / k rows from the interleaved rotary pairs into halves (loader/names.py)."""
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return {"self_attn.q_proj": functools.partial(interleaved_to_halves, num_heads=config.num_attention_heads),
                "self_attn.k_proj": functools.partial(interleaved_to_halves, num_heads=kv_heads)}
