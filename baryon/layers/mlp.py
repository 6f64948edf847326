"""The gated MLP of Llama-family decoders (and of shared experts): down(act(gate(x)) * up(x)), act
SiLU or (Gemma) GELU with the tanh approximation."""

from __future__ import annotations

import torch
from torch import nn

from baryon.layers.activation import GATED_ACTIVATIONS
from baryon.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu",
                 reduce_results: bool = True) -> None:
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported: {sorted(GATED_ACTIVATIONS)}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results)
        self.act_fn = GATED_ACTIVATIONS[hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
