"""Block-quantized weights kept packed in memory (the layout of `baryon.kernels.block_quant`):
GGUF's Q4_0 / Q4_1 / Q4_K matrices as 4-bit codes, Q8_0 and Q5_0 / Q5_1 / Q5_K as 8-bit, each 32-element block with a
scale and offset (float16 where the GGUF type stores them so, else float32), and Q6_K as int8 codes with a float32
scale per 16 elements (bits 6), multiplied by a kernel that dequantizes in registers or takes integer dot products."""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.block_quant import dequantize_rows, row_bytes
from baryon.kernels.selector import select
from baryon.quantization.base import LinearMethod, checkpoint_param


class BlockQuantLinearMethod(LinearMethod):
    """Weight [out, in] stored as uint8 [out, row_bytes(in, bits, pair_bytes)] (a row slice of the
    packed tensor is a row slice of the weight, so fused q/k/v and gate/up load as usual)."""

    def __init__(self, bits: int, in_features: int, device: torch.device, dtype: torch.dtype,
                 pair_bytes: int = 8) -> None:
        self.bits, self.in_features, self.pair_bytes = bits, in_features, pair_bytes
        self.kernel = select("block_quant_linear", device, in_features=in_features, bits=bits, dtype=dtype)

    def create_weights(self, layer: nn.Module) -> None:
        """The packed weight of a linear layer, or in place of an embedding's float rows."""
        if getattr(layer, "tp_size", 1) > 1:
            raise ValueError("block-quantized weights support one rank (tensor_parallel_size=1); "
                             "load the checkpoint dequantized for tensor parallelism")
        if hasattr(layer, "add_param"):  # a linear layer (its dense weight is already gone)
            layer.add_param("weight", (layer.output_size, row_bytes(self.in_features, self.bits, self.pair_bytes)),
                            torch.uint8, input_dim=None)
            return
        rows = layer.weight
        packed = checkpoint_param((rows.shape[0], row_bytes(self.in_features, self.bits, self.pair_bytes)),
                                  torch.uint8, input_dim=None)
        packed.weight_loader, packed.expected_shards = rows.weight_loader, rows.expected_shards
        layer.weight = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.forward(x, layer.weight, self.bits, self.in_features, bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_rows(layer.weight, self.in_features, self.bits)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(rows, self.in_features, self.bits)
