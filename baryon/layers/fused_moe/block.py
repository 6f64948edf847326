"""MoE blocks: what replaces the MLP in a sparse decoder layer. The router picks experts, the
FusedMoE layer runs them, shared experts (if any) add a dense MLP on every token; the ranks'
partial sums are reduced once, at the end. Attribute names follow the checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from baryon.distributed.parallel_state import tp_all_reduce
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.layers.linear import ReplicatedLinear
from baryon.layers.mlp import GatedMLP


class SparseMoeBlock(nn.Module):
    """Routed experts plus, optionally, shared experts summed in unscaled (DeepSeek, GLM-4.5:
    `shared_experts`, a dense MLP of n_shared_experts x moe_intermediate_size)."""

    def __init__(self, gate: Router, experts: FusedMoE, shared_experts: GatedMLP | None = None) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        out = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out)


class GatedSharedExpertMoeBlock(nn.Module):
    """Qwen2-MoE: routed experts plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, gate: Router, experts: FusedMoE, shared_expert: GatedMLP) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_expert = gate, experts, shared_expert
        self.shared_expert_gate = ReplicatedLinear(experts.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        return tp_all_reduce(out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))
