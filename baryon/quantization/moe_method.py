"""How a FusedMoE layer's expert weights are stored and multiplied: a `MoEMethod`, the expert
counterpart of `LinearMethod` (unquantized by default; quantization schemes add their own)."""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.selector import select


class MoEMethod:
    """Creates the layer's expert parameters and runs the experts on routed tokens."""

    # Whether apply() adds the layer's expert biases and applies its activation (other methods
    # run SiLU-and-mul experts without biases only; FusedMoE refuses the rest by name).
    biases_and_activations = False

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        """Parameter name -> parameter (without loaders; the layer attaches its own)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack what loaded into the kernel's layout (default: nothing to do)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden], routing [num_tokens, top_k] -> [num_tokens, hidden]."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts as held, float32: (w13 [E, 2I, H], w2 [E, H, I])."""
        raise NotImplementedError


def expert_extras(layer: nn.Module) -> dict:
    """The keyword arguments of a biased or non-SiLU layer for the expert kernels (none otherwise,
    so kernels without them keep their signature)."""
    if not layer.has_bias and layer.activation.kind == "silu":
        return {}
    return {"w13_bias": getattr(layer, "w13_bias", None), "w2_bias": getattr(layer, "w2_bias", None),
            "activation": layer.activation}


class UnquantizedMoEMethod(MoEMethod):
    """Float expert weights: w13 [local experts, 2 * inter, hidden] (gate rows, then up rows) and
    w2 [local experts, hidden, inter], multiplied by the `fused_moe` kernel the selector picks."""

    biases_and_activations = True

    def __init__(self, device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                 biased: bool = False, activation: str = "silu") -> None:
        self.kernel = select("fused_moe", device, dtype=dtype, hidden=hidden_size, inter=intermediate_size,
                             device_type=device.type, biased=biased, activation=activation)

    @staticmethod
    def float_weights(experts: int, hidden: int, inter: int) -> dict[str, nn.Parameter]:
        return {"w13_weight": nn.Parameter(torch.empty(experts, 2 * inter, hidden), requires_grad=False),
                "w2_weight": nn.Parameter(torch.empty(experts, hidden, inter), requires_grad=False)}

    def create_weights(self, layer: nn.Module) -> dict[str, nn.Parameter]:
        return self.float_weights(layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_rank)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                   layer.expert_start, layer.num_experts, **expert_extras(layer))

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13_weight.float(), layer.w2_weight.float()
