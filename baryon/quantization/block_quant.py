"""Block-quantized weights kept packed in memory (the layout of `baryon.kernels.block_quant`):
GGUF's Q4_0 / Q4_1 / Q4_K matrices as 4-bit codes, Q8_0 as 8-bit, each 32-element block with a
float32 scale and offset, multiplied by a kernel that dequantizes in registers."""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.block_quant import dequantize_rows, row_bytes
from baryon.kernels.selector import select
from baryon.quantization.base import LinearMethod


class BlockQuantLinearMethod(LinearMethod):
    """Weight [out, in] stored as uint8 [out, row_bytes(in, bits)] (a row slice of the packed tensor
    is a row slice of the weight, so fused q/k/v and gate/up load as usual)."""

    def __init__(self, bits: int, in_features: int, device: torch.device, dtype: torch.dtype) -> None:
        self.bits, self.in_features = bits, in_features
        self.kernel = select("block_quant_linear", device, in_features=in_features, bits=bits, dtype=dtype)

    def create_weights(self, layer: nn.Module, weight: nn.Parameter) -> nn.Parameter:
        if getattr(layer, "tp_size", 1) > 1:
            raise ValueError("block-quantized weights support one rank (tensor_parallel_size=1); "
                             "load the checkpoint dequantized for tensor parallelism")
        packed = nn.Parameter(torch.empty(weight.shape[0], row_bytes(self.in_features, self.bits),
                                          dtype=torch.uint8, device=weight.device), requires_grad=False)
        packed.weight_loader, packed.expected_shards = weight.weight_loader, weight.expected_shards
        return packed

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.forward(x, weight, self.bits, self.in_features, bias)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(rows, self.in_features, self.bits)
