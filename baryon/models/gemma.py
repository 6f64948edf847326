"""Gemma (the first generation, `GemmaForCausalLM`: gemma-2b, gemma-7b, CodeGemma): Gemma 2's
attention, scaled embeddings and (1 + weight) norms (models/gemma2.py) in Llama's layer of two
norms, full attention everywhere, the softmax scale head_dim^-0.5, GELU-tanh gating.

The published configs say `hidden_act: "gelu"` beside `hidden_activation: "gelu_pytorch_tanh"`:
both mean the tanh approximation the models were trained with (transformers 5's GemmaConfig
rewrites the legacy "gelu" so as it loads; vLLM reads `hidden_activation`, and so does this).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.mlp import GatedMLP
from baryon.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM, Gemma2Model, GemmaRMSNorm


def gemma_activation(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or config.hidden_act


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma2Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act=gemma_activation(config))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # before the MLP

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the next norm adds them."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states, residual = self.post_attention_layernorm(self.self_attn(positions, hidden_states), residual)
        return self.mlp(hidden_states), residual


class GemmaModel(Gemma2Model):
    layer_class = GemmaDecoderLayer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids) * self.embed_scale, None  # [num_tokens, hidden]
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GemmaForCausalLM(Gemma2ForCausalLM):
    model_class = GemmaModel
