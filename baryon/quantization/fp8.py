"""FP8 (e4m3) linear layers: the `fp8` checkpoint format (AutoFP8 / ModelOpt per-tensor scales,
DeepSeek-V3 / Qwen3-FP8 128 x 128 block scales), compressed-tensors' float-quantized schemes (which
build `Fp8LinearMethod` directly) and online FP8 of a float checkpoint.

Checkpoint tensors of one linear layer (per fused part for q/k/v and gate/up):
    weight        float8_e4m3fn [N, K]
    tensor:  weight_scale f32 []                       -> one value per fused part
    channel: weight_scale f32 [N, 1]
    block:   weight_scale_inv (fp8) / weight_scale (compressed-tensors) f32 [ceil(N/bn), ceil(K/bk)]
    static activations: input_scale f32 []             -> the largest over the fused parts
weight = q * scale (the block scale multiplies too, despite its `_inv` name). Activations are
quantized per token (tensor / channel weights) or per 1 x bk group (block weights) at run time,
or with the checkpoint's static input_scale. Per-tensor weight scales are expanded to one per
output channel after loading, so every non-block layout runs the same rowwise GEMM.

On CPU (the torch kernel) a layer dequantizes its weight and multiplies the float activations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.kernels.quant.act_quant import FP8
from baryon.kernels.selector import select
from baryon.quantization.base import (DENSE, ActivationQuantizedLinearMethod, LinearMethod, QuantizationConfig,
                                      is_ignored)
from baryon.quantization.fp8_rounding import quantize_fp8_per_channel
from baryon.quantization.moe_fp8 import Fp8MoEMethod

STRATEGIES = ("tensor", "channel", "block")


class Fp8LinearMethod(ActivationQuantizedLinearMethod):
    def __init__(self, strategy: str, static_input: bool, block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale", online: bool = False) -> None:
        """strategy: tensor | channel | block (block needs `block` = (bn, bk)); static_input: the
        checkpoint has input_scale; scale_name: the block scale's checkpoint name; online: the
        checkpoint holds float weights, quantized per channel after loading."""
        if strategy not in STRATEGIES:
            raise ValueError(f"FP8 weight strategy {strategy!r} is not supported; supported: {list(STRATEGIES)}")
        if (strategy == "block") != (block is not None):
            raise ValueError("FP8 block scales need weight_block_size [bn, bk] (and only block scales take it)")
        self.strategy, self.static_input, self.block = strategy, static_input, block
        self.scale_name, self.online = scale_name, online

    def create_weights(self, layer: nn.Module) -> None:
        n, k, parts = layer.output_size, layer.input_size, len(layer.shard_order)
        if self.online:
            DENSE.create_weights(layer)
        else:
            layer.add_param("weight", (n, k), FP8)
            if self.strategy == "tensor":
                layer.add_param("weight_scale", (parts,), torch.float32, output_dim=None, input_dim=None,
                                per_shard=True)
            elif self.strategy == "channel":
                layer.add_param("weight_scale", (n, 1), torch.float32, input_dim=None)
            else:
                bn, bk = self.block
                layer.add_param(self.scale_name, (-(-n // bn), -(-k // bk)), torch.float32, output_block=bn)
        if self.static_input:
            layer.add_param("input_scale", (parts,), torch.float32, output_dim=None, input_dim=None, per_shard=True)
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        self.act_quant = select("act_quant", device)
        self.kernel = select("fp8_linear", device, in_features=k, out_features=n, block=self.block, dtype=dtype)
        if self.block is None:  # block-scaled layers keep their GEMM: the GEMV measured no faster
            self.select_decode_kernels()  # for them (H100, Qwen3-8B shapes: 125 us against 118 us a layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            q, scale = quantize_fp8_per_channel(layer.weight.data)
        elif self.strategy == "tensor":  # one scale per fused part -> one per output row
            q = layer.weight.data
            sizes = torch.tensor(layer.shard_sizes, device=q.device)
            scale = layer.weight_scale.data.repeat_interleave(sizes)
        elif self.strategy == "channel":
            q, scale = layer.weight.data, layer.weight_scale.data.reshape(-1)
        else:
            q, scale = layer.weight.data, getattr(layer, self.scale_name).data
        self.weights = self.kernel.prepare(q, scale.float(), self.block)
        self.gemv_weight = self.weights.weight  # [N, K] fp8 for every kernel
        self.gemv_scale = scale.float().contiguous()  # [N]
        self.input_scale = layer.input_scale.data.max().reshape(1, 1) if self.static_input else None
        for name in ("weight", "weight_scale", self.scale_name, "input_scale"):
            if name in layer._parameters:
                delattr(layer, name)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block is not None:
            return self.act_quant.per_group(x, self.block[1], FP8)
        if self.input_scale is not None:
            return self.act_quant.static(x, self.input_scale, FP8), self.input_scale.expand(x.shape[0], 1)
        return self.act_quant.per_token(x, FP8)


class Fp8Config(QuantizationConfig):
    """`quant_method: fp8` checkpoints, and online FP8 (`quantization="fp8"` on a float checkpoint)."""

    name = "fp8"

    def __init__(self, static_input: bool, block: tuple[int, int] | None, ignored: list[str],
                 online: bool = False) -> None:
        self.static_input, self.block, self.ignored, self.online = static_input, block, ignored, online

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported; supported: static, dynamic")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 fmt {fmt!r} is not supported; supported: e4m3")
        block = config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or scheme != "dynamic":
                raise ValueError(f"fp8 weight_block_size {block} needs two sizes and dynamic activations")
            block = (int(block[0]), int(block[1]))
        ignored = list(config.get("ignored_layers") or []) + list(config.get("modules_to_not_convert") or [])
        return cls(scheme == "static", block, ignored)

    @classmethod
    def online_config(cls) -> Fp8Config:
        return cls(static_input=False, block=None, ignored=[], online=True)

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_ignored(prefix, self.ignored):
            return None
        if self.online:
            return Fp8LinearMethod("channel", False, online=True)
        if self.block is not None:
            return Fp8LinearMethod("block", False, self.block, scale_name="weight_scale_inv")
        return Fp8LinearMethod("tensor", self.static_input)

    def moe_method(self, layer: nn.Module, prefix: str):
        if is_ignored(prefix, self.ignored):
            return None
        if self.online:
            return Fp8MoEMethod((128, 128), online=True)
        if self.block is None:
            return Fp8MoEMethod(None, strategy="tensor", static_input=self.static_input)
        return Fp8MoEMethod(self.block, scale_name="weight_scale_inv")
