"""The expert computation with PyTorch's grouped GEMM (`torch._grouped_mm`, CUTLASS on Hopper):
pairs sorted by expert without padding, one grouped GEMM for gate/up, SiLU-and-mul, one grouped
GEMM for down, then the routing weights and the sum over k."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel


def sort_pairs(topk_ids: torch.Tensor, num_local: int, expert_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair indices sorted by local expert, pairs of other ranks last; [num_local] int32 end
    offset of each expert's run) — device work only, no host synchronisation."""
    flat = topk_ids.reshape(-1).long() - expert_start
    key = torch.where((flat >= 0) & (flat < num_local), flat, num_local)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    return order, torch.cumsum(counts[:num_local], 0).to(torch.int32)


class GroupedMMFusedExperts(Kernel):
    name = "grouped_mm"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return "this torch has no torch._grouped_mm"
        if device.type != "cuda":
            return "needs a CUDA device (CPU runs the exact per-expert loop)"
        if torch.cuda.get_device_capability(device) < (9, 0):
            return "torch._grouped_mm needs compute capability 9.0 (Hopper) or newer"
        return None

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype = torch.bfloat16, hidden: int = 16, inter: int = 16,
                                device_type: str = "cuda", biased: bool = False, activation: str = "silu",
                                **config) -> str | None:
        if biased or activation != "silu":
            return "no expert biases or activations other than SiLU"
        if device_type == "cuda" and dtype != torch.bfloat16:
            return f"dtype {dtype} (CUDA grouped GEMMs take bfloat16)"
        if hidden % 8 or inter % 8:
            return f"hidden {hidden} / intermediate {inter} not multiples of 8 (16-byte rows)"
        return None

    @staticmethod
    def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None) -> torch.Tensor:
        """Shapes as TorchFusedExperts.forward."""
        num_tokens, hidden = x.shape
        top_k, num_local, inter = topk_ids.shape[1], w13.shape[0], w2.shape[2]
        order, offsets = sort_pairs(topk_ids, num_local, expert_start)
        rows = x[order // top_k]  # [pairs, hidden], grouped by expert
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)  # [pairs, 2 * inter]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)  # [pairs, hidden]
        weight = topk_weights.reshape(-1)[order]
        if num_experts is not None and num_experts != num_local:  # rows past the last offset are not computed
            owned = torch.arange(order.numel(), device=x.device) < offsets[-1]
            weight = torch.where(owned, weight, 0.0)
            y = torch.where(owned[:, None], y, 0.0)
        out = torch.empty_like(y)
        out[order] = (y * weight[:, None]).to(y.dtype)
        return out.view(num_tokens, top_k, hidden).sum(dim=1)
