"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v biases) whose sparse layers
add a shared expert, scaled per token by sigmoid(shared_expert_gate(x)), to the routed experts."""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.layers.fused_moe.block import GatedSharedExpertMoeBlock
from baryon.layers.fused_moe.router import Router
from baryon.layers.mlp import GatedMLP
from baryon.models.qwen2 import Qwen2ForCausalLM
from baryon.models.qwen3_moe import GATE_UP_DOWN, is_sparse_layer, routed_experts, softmax_router


def shared_expert_block(config: Any, router: Router) -> GatedSharedExpertMoeBlock:
    """The routed experts beside a shared expert of `shared_expert_intermediate_size`, scaled by
    sigmoid(shared_expert_gate(x)) (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""
    shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, reduce_results=False)
    return GatedSharedExpertMoeBlock(router, routed_experts(config), shared)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    expert_projections = GATE_UP_DOWN

    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        return {"qkv_bias": bool(getattr(config, "qkv_bias", True)), "o_bias": False, "qk_norm": False}

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return shared_expert_block(config, softmax_router(config))
        return GatedMLP(config.hidden_size, config.intermediate_size)
