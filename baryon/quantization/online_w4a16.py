"""Online W4A16 (`quantization="w4a16"`): a float checkpoint's linear layers and experts rounded
to 4-bit symmetric groups at load (the "online" layout of `wna16.WNA16LinearMethod`)."""

from __future__ import annotations

from torch import nn

from baryon.quantization.base import LinearMethod, QuantizationConfig
from baryon.quantization.moe_int4 import Int4MoEMethod
from baryon.quantization.wna16 import WNA16LinearMethod


class OnlineW4A16Config(QuantizationConfig):
    """`quantization="w4a16"` on a float checkpoint: 4-bit symmetric groups of 128 (one group per
    row when a row is shorter), round to nearest; linear layers and experts."""

    name = "w4a16"

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        group = 128 if layer.input_size >= 128 else None
        return WNA16LinearMethod("online", 4, group)

    def moe_method(self, layer: nn.Module, prefix: str):
        """Experts too: groups of 128, 64 or 32, the largest that both the hidden size and a rank's
        intermediate size hold whole (else one group per row), packed for the int4 expert kernels
        on a GPU."""
        sizes = (layer.hidden_size, layer.intermediate_size_per_rank)
        group = next((g for g in (128, 64, 32) if all(size % g == 0 for size in sizes)), None)
        return Int4MoEMethod(WNA16LinearMethod("online", 4, group), self.name)
