"""RMSNorm with an optional fused residual add: torch reference and Triton kernel."""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import (TritonKernel, next_power_of_2, pdl_launch, tl, triton,
                                         wait_and_release)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Normalises in float32, then as transformers does for
    the weight's dtype: a weight in x's dtype (Llama and most models) scales the normalised values
    rounded to x's dtype; a float32 weight (Gemma's 1 + weight) scales them in float32, rounded once.
    The result is in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (weight * x32).to(x.dtype)
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

    @classmethod
    def norm_add_norm(cls, x: torch.Tensor, first_weight: torch.Tensor, residual: torch.Tensor,
                      second_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's output norm, the residual add and the next norm (Gemma's sandwich norms):
        s = rms_norm(x) * first_weight + residual; returns (rms_norm(s) * second_weight, s)."""
        return cls.forward(cls.forward(x, first_weight, eps)[0], second_weight, eps, residual)


class CpuRMSNorm(TorchRMSNorm):
    """The C++ kernel (kernels/cpu/rms_norm.cpp): residual add and norm in one pass per token;
    float32 rows only (other inputs take the torch reference); norm_add_norm as TorchRMSNorm's, two
    passes of this forward."""

    name = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        from baryon.kernels.cpu import unsupported_reason

        return unsupported_reason(device)

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or weight.dtype != torch.float32:
            return TorchRMSNorm.forward(x, weight, eps, residual)
        out, residual_out = torch.ops.baryon_cpu.rms_norm(x, weight, eps, residual)
        return out, (residual_out if residual is not None else None)


if triton is not None:

    @triton.jit
    def scaled_by_weight(normed, w, like):
        """rms_norm_reference's last step in a kernel: normed (the float32 normalised values) times
        the loaded weight w, in like's dtype: a float32 weight multiplies in float32 and rounds
        once, a weight of the model dtype multiplies the normalised values rounded to it first."""
        if w.dtype == tl.float32:
            return (normed * w).to(like.dtype)
        return (normed.to(like.dtype).to(tl.float32) * w.to(tl.float32)).to(like.dtype)

    @triton.jit
    def _rms_norm_row(h, weight, cols, mask, eps, HIDDEN: tl.constexpr):
        """One row h (model dtype) normalised in float32 and scaled by the norm's weight, in h's dtype."""
        h32 = h.to(tl.float32)
        variance = tl.sum(h32 * h32, axis=0) / HIDDEN
        w = tl.load(weight + cols, mask=mask, other=0.0)
        return scaled_by_weight(h32 * tl.rsqrt(variance + eps), w, h)

    @triton.jit
    def _rms_norm_kernel(x, residual, weight, out, residual_out, stride_x, stride_r, stride_o, stride_ro,
                         eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         PDL: tl.constexpr):
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            h = h + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
            tl.store(residual_out + row * stride_ro + cols, h, mask=mask)
        tl.store(out + row * stride_o + cols, _rms_norm_row(h, weight, cols, mask, eps, HIDDEN), mask=mask)

    @triton.jit
    def _norm_add_norm_kernel(x, residual, first_weight, second_weight, out, residual_out, stride_x, stride_r,
                              stride_o, stride_ro, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
        s = _rms_norm_row(h, first_weight, cols, mask, eps, HIDDEN) + tl.load(residual + row * stride_r + cols,
                                                                               mask=mask, other=0.0)
        tl.store(residual_out + row * stride_ro + cols, s, mask=mask)
        tl.store(out + row * stride_o + cols, _rms_norm_row(s, second_weight, cols, mask, eps, HIDDEN), mask=mask)


class TritonRMSNorm(TritonKernel):
    """One kernel per call: residual add, normalisation and scale fused; norm_add_norm's two
    norms and the add between them in one kernel too."""

    family = "rms_norm"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        rows = x2.shape[0]
        if residual is None:
            res2 = res_out = x2  # unused
        else:
            res2 = residual.reshape(-1, hidden)
            res_out = torch.empty_like(out)
        if rows:
            _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0),
                                      out.stride(0), res_out.stride(0), eps, HIDDEN=hidden,
                                      BLOCK=next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
                                      **pdl_launch(x.device))
        out = out.view(x.shape)
        return out, (None if residual is None else res_out.view(x.shape))

    @staticmethod
    def norm_add_norm(x: torch.Tensor, first_weight: torch.Tensor, residual: torch.Tensor,
                      second_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As TorchRMSNorm.norm_add_norm: x, residual [..., hidden] -> (out, the new residual). One
        kernel where both weights are float32 (Gemma's 1 + w; bit for bit the two passes on an
        H200); weights of a 16-bit model dtype take two passes of `forward`: in one kernel the sum
        of the first norm's rounded output and the residual came out of Triton 3.6 one ulp off
        torch's on 15% of a bf16 row's elements (the compiler does not keep that rounding)."""
        if x.dtype != torch.float32 and not (first_weight.dtype == second_weight.dtype == torch.float32):
            first, _ = TritonRMSNorm.forward(x, first_weight, eps)
            return TritonRMSNorm.forward(first, second_weight, eps, residual)
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        res2 = residual.reshape(-1, hidden)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        res_out = torch.empty_like(out)
        if x2.shape[0]:
            _norm_add_norm_kernel[(x2.shape[0],)](x2, res2, first_weight, second_weight, out, res_out, x2.stride(0),
                                                  res2.stride(0), out.stride(0), res_out.stride(0), eps, HIDDEN=hidden,
                                                  BLOCK=next_power_of_2(hidden), **pdl_launch(x.device))
        return out.view(x.shape), res_out.view(x.shape)
