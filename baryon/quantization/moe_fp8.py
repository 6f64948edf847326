"""FP8 experts with block weight scales (DeepSeek-V3, Qwen3-30B-A3B-FP8), and online FP8 of float
experts into the same layout (128 x 128 blocks).

Parameters (the checkpoint's per-expert tensors stacked by FusedMoE's loader):
    w13_weight  float8_e4m3fn [E, 2I, H]     w13_<scale> f32 [E, ceil(2I/bn), ceil(H/bk)]
    w2_weight   float8_e4m3fn [E, H, I]      w2_<scale>  f32 [E, ceil(H/bn), ceil(I/bk)]
where <scale> is the format's name (weight_scale_inv for `fp8`, weight_scale for compressed-tensors).
The gate and up halves of w13 split at row I, so I must be a multiple of bn.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.quant.act_quant import FP8
from baryon.kernels.selector import select
from baryon.quantization.fp8_rounding import expand_block_scale, quantize_fp8_blocks
from baryon.quantization.moe_method import MoEMethod, UnquantizedMoEMethod


class Fp8MoEMethod(MoEMethod):
    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv", online: bool = False) -> None:
        self.block, self.scale_name, self.online = block, scale_name, online

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        experts, hidden, inter = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank
        self.kernel = select("fused_moe_fp8", device, dtype=dtype, hidden=hidden, inter=inter, block=self.block)
        if self.online:
            return UnquantizedMoEMethod.float_weights(experts, hidden, inter)
        bn, bk = self.block
        if inter % bn:
            raise ValueError(f"FP8 experts with {bn}-row scale blocks need moe_intermediate_size per rank "
                             f"({inter}) to be a multiple of {bn}")

        def empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        return {"w13_weight": empty(experts, 2 * inter, hidden, dtype=FP8),
                "w2_weight": empty(experts, hidden, inter, dtype=FP8),
                f"w13_{self.scale_name}": empty(experts, 2 * inter // bn, -(-hidden // bk), dtype=torch.float32),
                f"w2_{self.scale_name}": empty(experts, -(-hidden // bn), -(-inter // bk), dtype=torch.float32)}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            self.w13, self.w13_scale = quantize_fp8_blocks(layer.w13_weight.data, self.block)
            self.w2, self.w2_scale = quantize_fp8_blocks(layer.w2_weight.data, self.block)
        else:
            self.w13, self.w2 = layer.w13_weight.data, layer.w2_weight.data
            self.w13_scale = getattr(layer, f"w13_{self.scale_name}").data
            self.w2_scale = getattr(layer, f"w2_{self.scale_name}").data
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(x, self.w13, self.w2, self.w13_scale, self.w2_scale, self.block,
                                   topk_weights, topk_ids, layer.expert_start, layer.num_experts)

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        def dense(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return q.float() * expand_block_scale(scale, q.shape[-2], q.shape[-1], self.block)

        return dense(self.w13, self.w13_scale), dense(self.w2, self.w2_scale)
