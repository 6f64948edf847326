"""RMSNorm with an optional fused residual add: torch reference."""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Normalises in float32, scales in x's dtype (as HF does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class TorchRMSNorm(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (rms_norm(x + residual), x + residual); residual None: (rms_norm(x), None)."""
        if residual is not None:
            x = x + residual
            residual = x
        return rms_norm_reference(x, weight, eps), residual
