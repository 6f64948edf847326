"""Qwen3-MoE: the Qwen3 decoder with a mixture of experts in place of the MLP in sparse layers
(every `decoder_sparse_step`-th layer, except the `mlp_only_layers`); softmax top-k routing,
renormalised when `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.kernels.moe.routing import RoutingConfig
from baryon.layers.fused_moe.block import SparseMoeBlock
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.layers.mlp import GatedMLP
from baryon.models.qwen3 import Qwen3ForCausalLM

GATE_UP_DOWN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Qwen2/3-MoE's rule for which layers hold experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


def softmax_router(config: Any) -> Router:
    return Router(config.hidden_size, RoutingConfig(config.num_experts, config.num_experts_per_tok,
                                                    renormalize=bool(getattr(config, "norm_topk_prob", False))))


def routed_experts(config: Any) -> FusedMoE:
    return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_projections = GATE_UP_DOWN

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(softmax_router(config), routed_experts(config))
        return GatedMLP(config.hidden_size, config.intermediate_size)
