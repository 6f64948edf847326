"""INT8 W8A8 experts (compressed-tensors `int-quantized` MoE checkpoints: int8 weights with
per-channel scales, dynamic per-token int8 activations), held as stored.

The checkpoint's per-expert tensors stack as FP8 channel-scaled experts do (`moe_fp8.py`):
    w13_weight int8 [E, 2I, H], w13_weight_scale [E, 2I, 1]; w2_weight int8 [E, H, I], w2_weight_scale [E, H, 1]
and run the FP8 experts' kernels on int8 codes (family `fused_moe_int8`): the channel scales
spread into (1 x 128) blocks, the activations quantized to int8 per token in groups of 128 (finer
than the checkpoint's per-token scale). Where only the torch kernel runs (CPU) the experts are
dequantized once after loading into float experts that the `fused_moe` kernel multiplies (as
before this method existed: the torch kernel would dequantize every used expert every step).
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.quantization.moe_fp8 import Fp8MoEMethod
from baryon.quantization.moe_method import UnquantizedMoEMethod


class Int8MoEMethod(Fp8MoEMethod):
    code_dtype = torch.int8
    family = "fused_moe_int8"

    def __init__(self) -> None:
        super().__init__(None, strategy="channel")

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        params = super().create_weights(layer)
        self.dequantized: UnquantizedMoEMethod | None = None
        if self.kernel.name == "torch":
            self.dequantized = UnquantizedMoEMethod(torch.get_default_device(), torch.get_default_dtype(),
                                                    layer.hidden_size, layer.intermediate_size_per_rank)
        self.holds_dequantized = self.dequantized is not None
        return params

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        if self.dequantized is None:
            return
        dtype = torch.get_default_dtype()
        for name, weight in zip(("w13_weight", "w2_weight"), super().dequantize(layer)):
            layer.register_parameter(name, nn.Parameter(weight.to(dtype), requires_grad=False))
        del self.w13, self.w2, self.w13_scale, self.w2_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None:
            return self.dequantized.apply(layer, x, topk_weights, topk_ids)
        return super().apply(layer, x, topk_weights, topk_ids)

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dequantized is not None:
            return self.dequantized.dequantize(layer)
        return super().dequantize(layer)
