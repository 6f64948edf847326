"""The gated MLP activations, act(gate) * up: SiLU (Llama-family) and GELU with the tanh
approximation (Gemma, `gelu_pytorch_tanh`); torch references and one Triton kernel for both."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import (TritonKernel, next_power_of_2, pdl_launch, tl, triton,
                                         wait_and_release)


class TorchSiluAndMul(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class TorchGeluTanhAndMul(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = gelu_tanh(gate) * up."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


if triton is not None:

    @triton.jit
    def _act_and_mul_kernel(x, out, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr,
                            PDL: tl.constexpr):
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x + row * stride_x + D + cols, mask=mask, other=0.0)
        if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^2z + 1)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        act = act.to(up.dtype)  # rounded like torch's F.silu / F.gelu
        tl.store(out + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=mask)

    def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
        rows, d = x.shape[0], x.shape[-1] // 2
        out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
        if rows:
            block = min(1024, next_power_of_2(d))
            _act_and_mul_kernel[(rows, -(-d // block))](x, out, x.stride(0), out.stride(0), D=d, BLOCK=block,
                                                        GELU=gelu, **pdl_launch(x.device))
        return out


class TritonSiluAndMul(TritonKernel):
    family = "silu_and_mul"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]."""
        return _act_and_mul(x, gelu=False)


class TritonGeluTanhAndMul(TritonKernel):
    family = "gelu_tanh_and_mul"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]."""
        return _act_and_mul(x, gelu=True)
