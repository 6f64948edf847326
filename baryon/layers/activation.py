"""The gated MLP activation: silu(gate) * up."""

from __future__ import annotations

import torch
from torch import nn

from baryon.kernels.activation import TorchSiluAndMul
from baryon.kernels.selector import select


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernel = select("silu_and_mul", torch.get_default_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] -> [num_tokens, d]."""
        # Under torch.compile the plain torch ops, which inductor fuses with their neighbours.
        kernel = TorchSiluAndMul if torch.compiler.is_compiling() else self.kernel
        return kernel.forward(x)
