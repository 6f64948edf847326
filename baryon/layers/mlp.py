"""The gated MLP of Llama-family decoders (and of shared experts): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from baryon.layers.activation import SiluAndMul
from baryon.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu",
                 reduce_results: bool = True) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; only 'silu'.")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
