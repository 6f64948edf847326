"""INT8 W8A8 linear layers (compressed-tensors `int-quantized`: symmetric int8 weights with one
float32 scale per output channel, activations quantized per token at run time) and online W8A8
(`quantization="w8a8"`: a float checkpoint rounded to that layout after loading).

Checkpoint tensors: weight int8 [N, K], weight_scale f32 [N, 1]; weight = q * scale.
On CPU (the torch kernel) a layer dequantizes its weight and multiplies the float activations.
"""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.quant.act_quant import INT8_MAX
from baryon.kernels.selector import select
from baryon.quantization.base import DENSE, ActivationQuantizedLinearMethod, LinearMethod, QuantizationConfig


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q int8 [N, K], scale f32 [N]), scale = row amax / 127, round to nearest."""
    w32 = weight.float()
    scale = w32.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    return torch.round(w32 / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


class Int8LinearMethod(ActivationQuantizedLinearMethod):
    def __init__(self, online: bool = False) -> None:
        self.online = online

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.output_size, layer.input_size
        if self.online:
            DENSE.create_weights(layer)
        else:
            layer.add_param("weight", (n, k), torch.int8)
            layer.add_param("weight_scale", (n, 1), torch.float32, input_dim=None)
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        self.act_quant = select("act_quant", device)
        self.kernel = select("int8_linear", device, in_features=k, out_features=n, dtype=dtype)
        # No decode GEMV: with it, W8A8 Qwen3-8B latency-bs1 measured 5.881 ms against 5.640 ms
        # with the INT8 GEMM at every batch (H100, 2026-11-23).

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            q, scale = quantize_int8_per_channel(layer.weight.data)
        else:
            q, scale = layer.weight.data, layer.weight_scale.data.reshape(-1).float()
        self.weights = self.kernel.prepare(q, scale)
        for name in ("weight", "weight_scale"):
            if name in layer._parameters:
                delattr(layer, name)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.act_quant.per_token(x, torch.int8)


class OnlineInt8Config(QuantizationConfig):
    """`quantization="w8a8"` on a float checkpoint: every decoder linear layer to INT8 W8A8."""

    name = "w8a8"

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return Int8LinearMethod(online=True)
