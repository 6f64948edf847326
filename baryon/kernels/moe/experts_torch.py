"""The expert computation in torch, one expert at a time: the reference every MoE kernel is
tested against, and the CPU path (exact in float32: the same products in the same order as
Hugging Face's expert loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """x: [num_tokens, hidden]; w13: [num_local_experts, 2 * inter, hidden] (gate rows, then up
    rows); w2: [num_local_experts, hidden, inter]; topk_weights: [num_tokens, top_k] float32;
    topk_ids: [num_tokens, top_k] global expert ids, this rank's experts being expert_start ..
    expert_start + num_local_experts - 1 (others contribute nothing).

    Returns [num_tokens, hidden] = sum over k of weight_k * w2[e_k] @ (silu(gate_k) * up_k)."""
    out = torch.zeros_like(x)
    local = topk_ids.long() - expert_start  # [num_tokens, top_k]
    num_local = w13.shape[0]
    inter = w2.shape[2]
    for expert in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        token_idx, k_idx = torch.where(local == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])  # [tokens of this expert, hidden]
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, k_idx, None]).to(out.dtype))
    return out


class TorchFusedExperts(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None) -> torch.Tensor:
        return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, expert_start)
