"""The linear-method lifecycle: a layer holds a `LinearMethod` that creates its weight parameter,
repacks it after loading if needed, and multiplies by it.

Layers start dense (`DenseLinearMethod`: a float weight [out, in]); a quantization scheme chosen
at load time swaps in another method before any tensor is loaded, so the checkpoint streams
straight into the quantized layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """Base of every weight layout a linear layer (or the LM head) can use."""

    def create_weights(self, layer: nn.Module, weight: nn.Parameter) -> nn.Parameter:
        """The parameter that replaces `weight` (the dense one the layer was built with); it keeps
        the dense one's `weight_loader` and `expected_shards`."""
        return weight

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out]."""
        raise NotImplementedError

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Selected rows of the stored weight as floats (an embedding lookup)."""
        raise NotImplementedError


class DenseLinearMethod(LinearMethod):
    """A float weight [out, in] multiplied with F.linear."""

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


DENSE = DenseLinearMethod()
