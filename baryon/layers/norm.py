"""Normalisation layers: RMSNorm with an optional fused residual add, and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from baryon.distributed.parallel_state import (dp_reduce_scatter, dp_reduce_scatter_add_rms_norm, dp_world_size,
                                               tp_all_reduce_add_rms_norm)
from baryon.kernels.norm import TorchRMSNorm
from baryon.kernels.selector import select
from baryon.layers.linear import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, weight_dtype: torch.dtype | None = None) -> None:
        """weight_dtype: the weight's dtype (default: the model's); a float32 weight in a 16-bit
        model scales the normalised values in float32 (see rms_norm_reference)."""
        super().__init__()
        self.eps = eps
        # x is the ranks' partial sums, left unreduced by the block before, and this norm adds
        # them up with the residual add: under tensor parallelism an all-reduce
        # (tp_all_reduce_add_rms_norm); under DP attention, after a MoE block, x holds every
        # replica's rows and the sum is reduce-scattered to this replica's own
        # (dp_reduce_scatter_add_rms_norm: the residual's rows are the replica's tokens).
        self.reduces_input = False
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param.data, loaded)
        self.weight.expected_shards = frozenset([None])
        self.kernel = select("rms_norm", torch.get_default_device())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., hidden]. Without residual returns rms_norm(x); with it returns
        (rms_norm(x + residual), x + residual), the new residual stream."""
        if self.reduces_input and dp_world_size() > 1:
            fused = dp_reduce_scatter_add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = dp_reduce_scatter(x)[: residual.shape[0]]  # [tokens, hidden], then the norm as usual
        elif self.reduces_input:
            hidden = x.shape[-1]
            out, residual_out = tp_all_reduce_add_rms_norm(x.reshape(-1, hidden), residual.reshape(-1, hidden),
                                                           self.weight, self.eps)
            return out.view(x.shape), residual_out.view(x.shape)
        # Under torch.compile the plain torch ops, which inductor fuses with their neighbours.
        kernel = TorchRMSNorm if torch.compiler.is_compiling() else self.kernel
        out, residual_out = kernel.forward(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual_out)


def norm_add_norm(first: RMSNorm, x: torch.Tensor, residual: torch.Tensor,
                  second: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """second(first(x), residual): a block's output norm, the residual add and the next norm
    (Gemma's sandwich norms) as one kernel where both norms are plain (no reduction of their
    input, one eps): returns (the next block's normalised input, the new residual)."""
    if first.reduces_input or second.reduces_input or first.eps != second.eps or torch.compiler.is_compiling():
        return second(first(x), residual)
    return first.kernel.norm_add_norm(x, first.weight, residual, second.weight, first.eps)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and a bias (DeepSeek-V3.2's indexer key norm), in the input dtype
    as torch's nn.LayerNorm computes it."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        for param in (self.weight, self.bias):
            param.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param.data, loaded)
            param.expected_shards = frozenset([None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
