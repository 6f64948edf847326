"""MXFP4 checkpoints (`quant_method: mxfp4`, GPT-OSS): the experts are MXFP4, everything else
(attention, router, embeddings, LM head: `modules_to_not_convert`) is float.

Expert parameters (FusedMoE's stacked layout; the model converts the published tensors):
    w13_blocks uint8 [E, 2I, H / 2]   w13_scales uint8 [E, 2I, H / 32]   (gate rows, then up rows)
    w2_blocks  uint8 [E, H, I / 2]    w2_scales  uint8 [E, H, I / 32]
(`kernels/quant/mxfp4.py`: two e2m1 codes a byte, one e8m0 scale per 32 values.)

On a GPU the Triton expert kernels read them packed (family `fused_moe_mxfp4`); where only the
torch kernel runs (CPU), the experts are dequantized once after loading into float experts in the
model dtype, which the `fused_moe` kernel multiplies.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from baryon.kernels.quant.mxfp4 import GROUP, dequantize_mxfp4
from baryon.kernels.selector import select
from baryon.logger import get_logger
from baryon.quantization.base import LinearMethod, QuantizationConfig
from baryon.quantization.moe_method import MoEMethod, UnquantizedMoEMethod, expert_extras

logger = get_logger(__name__)


class Mxfp4MoEMethod(MoEMethod):
    biases_and_activations = True

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        experts, hidden, inter = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank
        if hidden % GROUP or inter % GROUP:
            raise ValueError(f"MXFP4 experts need the hidden size ({hidden}) and the intermediate size per rank "
                             f"({inter}) to be multiples of {GROUP} (the scale groups)")
        self.kernel = select("fused_moe_mxfp4", device, dtype=dtype, hidden=hidden, inter=inter)
        self.dequantized: UnquantizedMoEMethod | None = None
        if self.kernel.name == "torch":  # dequantize once at load; the float kernels run them
            self.dequantized = UnquantizedMoEMethod(device, dtype, hidden, inter, layer.has_bias,
                                                    layer.activation.kind)

        def packed(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        return {"w13_blocks": packed(experts, 2 * inter, hidden // 2),
                "w13_scales": packed(experts, 2 * inter, hidden // GROUP),
                "w2_blocks": packed(experts, hidden, inter // 2),
                "w2_scales": packed(experts, hidden, inter // GROUP)}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.dequantized is None:
            return
        dtype = torch.get_default_dtype()
        for name in ("w13", "w2"):
            weight = dequantize_mxfp4(getattr(layer, f"{name}_blocks"), getattr(layer, f"{name}_scales"), dtype)
            delattr(layer, f"{name}_blocks")
            delattr(layer, f"{name}_scales")
            layer.register_parameter(f"{name}_weight", nn.Parameter(weight, requires_grad=False))
        logger.debug("MXFP4 experts of %s dequantized to %s", type(layer).__name__, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None:
            return self.dequantized.apply(layer, x, topk_weights, topk_ids)
        return self.kernel.forward(x, layer.w13_blocks, layer.w2_blocks, layer.w13_scales, layer.w2_scales,
                                   topk_weights, topk_ids, layer.expert_start, layer.num_experts,
                                   **expert_extras(layer))

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dequantized is not None:
            return self.dequantized.dequantize(layer)
        return (dequantize_mxfp4(layer.w13_blocks, layer.w13_scales),
                dequantize_mxfp4(layer.w2_blocks, layer.w2_scales))


class Mxfp4Config(QuantizationConfig):
    """`quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`: the
    experts are MXFP4; linear layers stay float (the published checkpoints quantize nothing else)."""

    name = "mxfp4"

    def __init__(self, config: dict[str, Any]) -> None:
        # module names or globs (`model.layers.*.self_attn`) kept in float
        self.not_converted = list(config.get("modules_to_not_convert") or [])

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None

    def moe_method(self, layer: nn.Module, prefix: str) -> MoEMethod | None:
        if any(fnmatch.fnmatch(prefix, pattern) or prefix.startswith(pattern + ".") for pattern in self.not_converted):
            return None
        return Mxfp4MoEMethod()
