"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): Llama-style attention with q/k/v biases, optional QK
norm and partial rotary; the first `first_k_dense_replace` layers dense, the rest a mixture of
experts routed by sigmoid scores with a correction bias and grouped top-k, scaled by
`routed_scaling_factor`, plus shared experts. The multi-token-prediction layers some checkpoints
store past `num_hidden_layers` are skipped at load."""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.kernels.moe.routing import RoutingConfig
from baryon.layers.fused_moe.block import SparseMoeBlock
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.layers.mlp import GatedMLP
from baryon.models.llama import LlamaForCausalLM
from baryon.models.qwen3_moe import GATE_UP_DOWN


class Glm4MoeForCausalLM(LlamaForCausalLM):
    expert_projections = GATE_UP_DOWN
    extra_layers_config_key = "num_nextn_predict_layers"

    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        return {"qkv_bias": bool(getattr(config, "attention_bias", False)), "o_bias": False,
                "qk_norm": bool(getattr(config, "use_qk_norm", False))}

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        if layer_idx < getattr(config, "first_k_dense_replace", 0):
            return GatedMLP(config.hidden_size, config.intermediate_size)
        experts, top_k, inter = config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size
        routing = RoutingConfig(experts, top_k, renormalize=bool(config.norm_topk_prob), scoring="sigmoid",
                                num_groups=config.n_group or 1, topk_group=config.topk_group or 1,
                                routed_scaling_factor=float(config.routed_scaling_factor))
        router = Router(config.hidden_size, routing, correction_bias=True, float32_logits=True)
        shared = None
        if getattr(config, "n_shared_experts", 0):
            shared = GatedMLP(config.hidden_size, inter * config.n_shared_experts, reduce_results=False)
        return SparseMoeBlock(router, FusedMoE(experts, top_k, config.hidden_size, inter), shared)
