"""Granite (`GraniteForCausalLM`: IBM's granite-3.x dense models): Llama layers with four
multipliers from the config: the embeddings times `embedding_multiplier`, the softmax scale
`attention_multiplier` (instead of head_dim^-0.5), each attention and MLP block's output times
`residual_multiplier` before the residual add, and the logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.layers.mlp import GatedMLP
from baryon.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class GraniteAttention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, **options: Any) -> None:
        super().__init__(config, layer_idx, scale=config.attention_multiplier, **options)
        self.output_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, hidden_states) * self.output_multiplier


class GraniteMLP(GatedMLP):
    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, bias=bias, hidden_act=config.hidden_act)
        self.output_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.output_multiplier


class GraniteModel(LlamaModel):
    def __init__(self, config: Any, *builders: Any) -> None:
        super().__init__(config, *builders)
        self.embedding_multiplier = config.embedding_multiplier
        for layer in self.layers:  # each rank's part is scaled before the norm's all-reduce takes it,
            # so no projection may push its unscaled part to the peers from its own epilogue
            layer.self_attn.o_proj.pushes_partial = layer.mlp.down_proj.pushes_partial = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.lm_head.final_logit_divisor = config.logits_scaling

    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        return GraniteModel(config, cls.build_attention, cls.build_mlp)

    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        return GraniteAttention(config, layer_idx, **cls.attention_options(config))

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return GraniteMLP(config, bias=cls.mlp_bias(config))
