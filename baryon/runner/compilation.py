"""Compilation levels: what runs the model's forward pass (input ids, positions -> hidden states).

  0  eager: the layers call the selected kernels (Triton on GPU) directly.
  1  dynamo with the eager backend: the forward is traced into one FX graph and run as traced
     (a debugging level: it checks that the model traces with no graph break).
  2  inductor: the traced graph is compiled by inductor, which fuses the elementwise ops
     (RMSNorm, SiLU-and-mul, residual adds; the layers hand it their torch forms).
  3  inductor, and decode steps replay CUDA graphs captured over the compiled forward.

At every level attention (the QKV prologue + paged attention) is the opaque custom op
`baryon::attention`, so dynamo traces neither the Triton kernels nor the per-step metadata. Shapes
are dynamic: one compilation serves every number of tokens. CUDA graphs for decode are captured
at levels 0 and 3 unless `enforce_eager`; levels 1 and 2 run every step through the compiled code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ModelForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

LEVEL_NAMES = {0: "eager", 1: "dynamo (eager backend)", 2: "inductor", 3: "inductor + CUDA graphs"}


def compile_forward(model: nn.Module, level: int) -> ModelForward:
    if level == 0:
        return model
    backend = "eager" if level == 1 else "inductor"
    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True)


def uses_cuda_graphs(level: int, device: torch.device, enforce_eager: bool) -> bool:
    return device.type == "cuda" and not enforce_eager and level in (0, 3)
