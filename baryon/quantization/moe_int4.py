"""4-bit GPTQ, AWQ and compressed-tensors W4A16 experts kept packed on GPUs.

The experts load in their published per-expert layout (as `DequantizedMoEMethod` reads them);
after loading, each expert's projection is read into the canonical codes / scales / zero codes of
`wna16.WNA16LinearMethod.canonical` and stored as packed int4 (`kernels/quant/int4_experts.py`:
two codes a byte, a (scale, zero) pair per 32 values), which the `fused_moe_int4` kernels decode
in registers: five bits a value instead of the sixteen of dequantized experts.

Where that kernel cannot run (CPU: its torch reference would dequantize every call), or the
layout does not fit it (8-bit codes, act order, groups that are not a multiple of 32 values or
do not divide a rank's share of the intermediate size), the experts are dequantized once at load
as before.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.quant.int4_experts import GROUP, dequantize_int4_experts, pack_int4_experts
from baryon.kernels.selector import select
from baryon.quantization.base import LinearMethod
from baryon.quantization.moe_dequantized import DequantizedMoEMethod
from baryon.quantization.wna16 import WNA16LinearMethod


def weight_only_moe_method(linear: LinearMethod, name: str) -> DequantizedMoEMethod:
    """The experts' method for a checkpoint whose linear layers take `linear`."""
    if isinstance(linear, WNA16LinearMethod) and linear.bits == 4 and not linear.act_order:
        return Int4MoEMethod(linear, name)
    return DequantizedMoEMethod(linear, name)


class Int4MoEMethod(DequantizedMoEMethod):
    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        params = super().create_weights(layer)  # the published per-expert tensors
        hidden, inter = layer.hidden_size, layer.intermediate_size_per_rank
        self.kernel = select("fused_moe_int4", torch.get_default_device(), dtype=torch.get_default_dtype(),
                             hidden=hidden, inter=inter)
        fits = all(size % GROUP == 0 and (self.linear.group_size or size) % GROUP == 0
                   and size % (self.linear.group_size or size) == 0 for size in (hidden, inter))
        self.packed = self.kernel.name != "torch" and fits
        self.holds_dequantized = not self.packed
        return params

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.packed:
            super().process_weights_after_loading(layer)
            return
        dtype = torch.get_default_dtype()
        packed = {}
        for prefix, experts in self.expert_projections(layer):
            canonical = [self.linear.canonical(one)[:3] for one in experts]  # codes [n, k], scales, zeros [n, G]
            stacked = [torch.stack(parts) for parts in zip(*canonical)]  # [E, n, k], [E, n, G], [E, n, G]
            packed[prefix] = pack_int4_experts(*stacked, dtype)  # blocks [E, n, k / 2], pairs [E, n, k / 32, 2]
        self.drop_checkpoint_tensors(layer)
        for prefix, (blocks, pairs) in packed.items():
            layer.register_parameter(f"{prefix}_blocks", nn.Parameter(blocks, requires_grad=False))
            layer.register_parameter(f"{prefix}_pairs", nn.Parameter(pairs, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return super().apply(layer, x, topk_weights, topk_ids)
        return self.kernel.forward(x, layer.w13_blocks, layer.w2_blocks, layer.w13_pairs, layer.w2_pairs,
                                   topk_weights, topk_ids, layer.expert_start, layer.num_experts)

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.packed:
            return super().dequantize(layer)
        return (dequantize_int4_experts(layer.w13_blocks, layer.w13_pairs),
                dequantize_int4_experts(layer.w2_blocks, layer.w2_pairs))
