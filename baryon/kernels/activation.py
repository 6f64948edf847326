"""SiLU-and-mul (the gated MLP activation): torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel


class TorchSiluAndMul(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
