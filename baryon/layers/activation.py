"""The gated MLP activations: act(gate) * up, by the config's `hidden_act` / `hidden_activation`."""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.activation import TorchGeluTanhAndMul, TorchSiluAndMul
from baryon.kernels.selector import Kernel, select


class GatedActivation(nn.Module):
    family: str
    reference: type[Kernel]  # the plain torch ops, which inductor fuses with their neighbours

    def __init__(self) -> None:
        super().__init__()
        self.kernel = select(self.family, torch.get_default_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] -> [num_tokens, d]."""
        kernel = self.reference if torch.compiler.is_compiling() else self.kernel
        return kernel.forward(x)


class SiluAndMul(GatedActivation):
    family, reference = "silu_and_mul", TorchSiluAndMul


class GeluTanhAndMul(GatedActivation):
    family, reference = "gelu_tanh_and_mul", TorchGeluTanhAndMul


# hidden_act -> its gated activation
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
