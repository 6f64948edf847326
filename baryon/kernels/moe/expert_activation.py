"""The activation between an expert's gate/up and down projections.

    silu:           silu(gate) * up                                          (Qwen, Mixtral, DeepSeek)
    clamped_swiglu: gate = min(gate, limit); up = clamp(up, -limit, limit);
                    (up + 1) * gate * sigmoid(alpha * gate)                  (GPT-OSS: alpha 1.702, limit 7)

The Triton expert kernels apply it in their gate/up epilogue (ACT constexpr: the `code`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"expert activation {self.kind!r} is not supported; supported: {list(KINDS)}")

    @property
    def code(self) -> int:
        """The kernels' ACT constexpr."""
        return KINDS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [rows, inter] -> [rows, inter] (the torch reference)."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


SILU = ExpertActivation()
