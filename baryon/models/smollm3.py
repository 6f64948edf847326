"""SmolLM3 (`SmolLM3ForCausalLM`): Llama layers of which every `no_rope_layer_interval`-th takes no
rotary position encoding (`no_rope_layers[i]` = 0: a NoPE layer), and an optional sliding window
on the layers `layer_types` marks (only with `use_sliding_window`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.layers.rotary import get_identity_rope
from baryon.models.llama import LlamaForCausalLM, head_dim_of


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        attention = super().build_attention(config, layer_idx)
        if not config.no_rope_layers[layer_idx]:
            attention.rotary_emb = get_identity_rope(config, head_dim_of(config))
        return attention
