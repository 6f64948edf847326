"""A whole decoder layer as one kernel call (family `decoder_layer`).

- `cpu`: the C++ op `baryon_cpu::decoder_layer` (kernels/cpu/decoder_layer.cpp) runs a Llama-family
  layer (norms, QKV, prologue, paged attention, o-proj, gated MLP) in one call, through the same
  kernels the op-by-op path runs, so its results are bit-identical to it; a decode step of the
  default model then crosses from Python to C++ 30 times instead of ~300.
- `modules`: the layer's own modules, op by op (the reference; what every other device and layer
  runs). `BARYON_KERNEL_DECODER_LAYER=modules` forces it.

Which layers qualify is the layer's business (`baryon.layers.fused_decoder_layer`); it passes the
reason a layer cannot be fused as `structure`.
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.selector import Kernel


class CpuDecoderLayer(Kernel):
    name = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        from baryon.kernels.cpu import unsupported_reason

        return unsupported_reason(device)

    @classmethod
    def cannot_implement_reason(cls, *, structure: str | None = None, dtype: torch.dtype = torch.float32,
                                **_: Any) -> str | None:
        if dtype != torch.float32:
            return f"{dtype} (the C++ decoder layer is float32)"
        return structure


class ModulesDecoderLayer(Kernel):
    name = "modules"
