"""MoE blocks: what replaces the MLP in a sparse decoder layer. The router picks experts, the
FusedMoE layer runs them, shared experts (if any) add a dense MLP on every token; the ranks'
partial sums are reduced once, at the end. Attribute names follow the checkpoints.

With DP attention the routed experts run over every replica's tokens: each replica pads its rows
to the step's agreed count, the replicas' rows are gathered, each replica routes all of them and
runs its own experts, and the sum of the replicas' parts comes back to each replica for its own
rows. Shared experts are whole on every replica and run on its own rows. In a LlamaModel the
block leaves that last step to the norm after it (`reduce_results` False): it returns its parts of
every replica's rows, shared experts added to its own, and the norm reduce-scatters them fused with
the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baryon.distributed.parallel_state import dp_all_gather, dp_rank, dp_reduce_scatter, dp_world_size, tp_all_reduce
from baryon.layers.forward_context import current_dp_padded_tokens
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.layers.linear import ReplicatedLinear
from baryon.layers.mlp import GatedMLP


def run_routed_experts(gate: Router, experts: FusedMoE, x: torch.Tensor, scatter: bool = True) -> torch.Tensor:
    """x: [num_tokens, hidden] -> this rank's experts' part of the routed output [num_tokens, hidden]
    (with DP attention, over every replica's tokens, see the module's docstring; scatter False:
    the parts of every replica's padded rows [replicas * padded, hidden], not reduce-scattered)."""
    if dp_world_size() == 1:
        return experts(x, *gate(x))
    num_tokens = x.shape[0]
    padded_tokens = current_dp_padded_tokens(num_tokens)
    padded = x if padded_tokens == num_tokens else F.pad(x, (0, 0, 0, padded_tokens - num_tokens))  # [padded, hidden]
    everyone = dp_all_gather(padded)  # [replicas * padded, hidden]
    parts = experts(everyone, *gate(everyone))
    return dp_reduce_scatter(parts)[:num_tokens] if scatter else parts


def add_to_own_rows(routed: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """routed + y, where y [num_tokens, hidden] is this replica's own (shared experts) and routed
    is either the same shape or, unscattered under DP attention, every replica's padded rows (y
    goes into this replica's: rows dp_rank * padded ..)."""
    if routed.shape[0] == y.shape[0]:
        return routed + y
    first = dp_rank() * (routed.shape[0] // dp_world_size())
    routed[first:first + y.shape[0]] += y
    return routed


class SparseMoeBlock(nn.Module):
    """Routed experts plus, optionally, shared experts summed in unscaled (DeepSeek, GLM-4.5:
    `shared_experts`, a dense MLP of n_shared_experts x moe_intermediate_size)."""

    def __init__(self, gate: Router, experts: FusedMoE, shared_experts: GatedMLP | None = None) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts
        self.reduce_results = True  # False: the norm after the block adds the ranks' (replicas') parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden] (unreduced: see the module's docstring)."""
        out = run_routed_experts(self.gate, self.experts, x, scatter=self.reduce_results)
        if self.shared_experts is not None:
            out = add_to_own_rows(out, self.shared_experts(x))
        return tp_all_reduce(out) if self.reduce_results else out


class GatedSharedExpertMoeBlock(nn.Module):
    """Qwen2-MoE: routed experts plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, gate: Router, experts: FusedMoE, shared_expert: GatedMLP) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_expert = gate, experts, shared_expert
        self.shared_expert_gate = ReplicatedLinear(experts.hidden_size, 1, bias=False)
        self.shared_expert_gate.quantizable = False  # one row: float in the published quantized checkpoints
        self.reduce_results = True  # False: the norm after the block adds the ranks' (replicas') parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = run_routed_experts(self.gate, self.experts, x, scatter=self.reduce_results)
        out = add_to_own_rows(out, torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))
        return tp_all_reduce(out) if self.reduce_results else out
