"""FP8 experts: block weight scales (DeepSeek-V3, Qwen3-30B-A3B-FP8), per-channel scales
(compressed-tensors FP8_DYNAMIC), per-tensor scales (AutoFP8, compressed-tensors FP8), and online
FP8 of float experts (128 x 128 blocks).

Parameters (the checkpoint's per-expert tensors stacked by FusedMoE's loader):
    w13_weight  float8_e4m3fn [E, 2I, H]     w2_weight  float8_e4m3fn [E, H, I]
    block:   w13_<scale> f32 [E, ceil(2I/bn), ceil(H/bk)], w2_<scale> [E, ceil(H/bn), ceil(I/bk)]
             (<scale>: weight_scale_inv for `fp8`, weight_scale for compressed-tensors)
    channel: w13_weight_scale [E, 2I, 1], w2_weight_scale [E, H, 1]
    tensor:  w13_weight_scale [E, 2] (gate, up), w2_weight_scale [E, 1]; static checkpoints'
             input scales (w13_input_scale [E, 2], w2_input_scale [E, 1]) load but are not used
The gate and up halves of w13 split at row I, so I must be a multiple of bn.

Channel and tensor scales are spread after loading into (1 x 128)-block scales (each row's
scale repeated along K), so every layout runs the one block-scaled kernel, with activations
quantized per token in groups of 128 (finer than the static per-tensor input scales).
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.quant.act_quant import FP8
from baryon.kernels.selector import select
from baryon.quantization.fp8_rounding import expand_block_scale, quantize_fp8_blocks
from baryon.quantization.moe_method import MoEMethod, UnquantizedMoEMethod


ROW_BLOCKS = (1, 128)  # the kernel layout of channel and tensor scales


class Fp8MoEMethod(MoEMethod):
    code_dtype = FP8  # the stored weights' dtype
    family = "fused_moe_fp8"  # the kernel family that multiplies them

    def __init__(self, block: tuple[int, int] | None, scale_name: str = "weight_scale_inv", online: bool = False,
                 strategy: str = "block", static_input: bool = False) -> None:
        """strategy: block (needs `block`), channel or tensor; static_input: the checkpoint has
        input scales (loaded, not used)."""
        if strategy not in ("block", "channel", "tensor") or (strategy == "block") != (block is not None):
            raise ValueError(f"FP8 experts: strategy {strategy!r} with block {block} is not supported; "
                             f"supported: block (with weight_block_size), channel, tensor")
        self.checkpoint_block, self.scale_name, self.online = block, scale_name, online
        self.strategy, self.static_input = strategy, static_input
        self.block = block if strategy == "block" else ROW_BLOCKS

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        experts, hidden, inter = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank
        self.kernel = select(self.family, device, dtype=dtype, hidden=hidden, inter=inter, block=self.block)
        if self.online:
            return UnquantizedMoEMethod.float_weights(experts, hidden, inter)
        bn, bk = self.block
        if inter % bn:
            raise ValueError(f"FP8 experts with {bn}-row scale blocks need moe_intermediate_size per rank "
                             f"({inter}) to be a multiple of {bn}")

        def empty(*shape: int, dtype: torch.dtype = torch.float32, per_shard: bool = False) -> nn.Parameter:
            param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
            param.per_shard = per_shard
            return param

        params = {"w13_weight": empty(experts, 2 * inter, hidden, dtype=self.code_dtype),
                  "w2_weight": empty(experts, hidden, inter, dtype=self.code_dtype)}
        if self.strategy == "block":
            params[f"w13_{self.scale_name}"] = empty(experts, 2 * inter // bn, -(-hidden // bk))
            params[f"w2_{self.scale_name}"] = empty(experts, -(-hidden // bn), -(-inter // bk))
        elif self.strategy == "channel":
            params.update(w13_weight_scale=empty(experts, 2 * inter, 1), w2_weight_scale=empty(experts, hidden, 1))
        else:
            params.update(w13_weight_scale=empty(experts, 2, per_shard=True),
                          w2_weight_scale=empty(experts, 1, per_shard=True))
        if self.static_input:
            params.update(w13_input_scale=empty(experts, 2, per_shard=True),
                          w2_input_scale=empty(experts, 1, per_shard=True))
        return params

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            self.w13, self.w13_scale = quantize_fp8_blocks(layer.w13_weight.data, self.block)
            self.w2, self.w2_scale = quantize_fp8_blocks(layer.w2_weight.data, self.block)
        elif self.strategy == "block":
            self.w13, self.w2 = layer.w13_weight.data, layer.w2_weight.data
            self.w13_scale = getattr(layer, f"w13_{self.scale_name}").data
            self.w2_scale = getattr(layer, f"w2_{self.scale_name}").data
        else:
            self.w13, self.w2 = layer.w13_weight.data, layer.w2_weight.data
            self.w13_scale = _row_block_scales(layer.w13_weight_scale.data, self.w13.shape)
            self.w2_scale = _row_block_scales(layer.w2_weight_scale.data, self.w2.shape)
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


def _row_block_scales(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Channel scales [E, N, 1] or per-projection scales [E, parts] of weights [E, N, K] ->
    (1 x 128)-block scales [E, N, ceil(K / 128)] (the row's scale in every block)."""
    experts, rows, cols = shape
    if scale.dim() == 2:  # per projection: gate rows then up rows (w13), or all rows (w2)
        scale = scale.repeat_interleave(rows // scale.shape[1], dim=1).unsqueeze(-1)
    return scale.float().expand(experts, rows, -(-cols // ROW_BLOCKS[1])).contiguous()
