"""Mixtral: the Mistral decoder with a mixture of experts (`block_sparse_moe`, experts' w1/w3/w2)
in every layer; softmax top-k routing, always renormalised."""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.kernels.moe.routing import RoutingConfig
from baryon.layers.fused_moe.block import SparseMoeBlock
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.models.llama import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    weights_mapping = {".block_sparse_moe.": ".mlp."}
    expert_projections = {"w1": "w1", "w3": "w3", "w2": "w2"}

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        router = Router(config.hidden_size, RoutingConfig(experts, top_k, renormalize=True))
        return SparseMoeBlock(router, FusedMoE(experts, top_k, config.hidden_size, config.intermediate_size))
