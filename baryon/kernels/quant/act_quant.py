"""Activation quantization before a quantized GEMM (family `act_quant`): torch references here.

Three shapes of scale, all float32, symmetric (no zero point):

    per token  x [M, K] -> q [M, K], scale [M, 1]           (FP8 / INT8 dynamic, rowwise GEMMs)
    per group  x [M, K] -> q [M, K], scale [M, ceil(K / g)] (FP8 1 x 128 groups, block-scaled GEMMs)
    static     x [M, K], scale [] -> q [M, K]               (a checkpoint's per-tensor input_scale)

with x ~= q * scale. q is float8_e4m3fn (saturated to +-448) or int8 (round half to even,
saturated to +-127). A dynamic scale is amax / qmax, with amax floored at 1e-10 so an all-zero
row quantizes to zeros instead of NaN.

`TritonActQuant` computes the same in one kernel launch per call: float32 math, correctly rounded
divisions (div_rn) and round-half-to-even, so it matches these references bit for bit (on CUDA,
torch divides by a Python scalar as a multiply by its reciprocal, so the reference's dynamic
scales there can sit one ulp from the correctly rounded quotient the kernel computes). On Hopper
its kernels are launched with programmatic dependent launch and wait for the kernel before at
their first statement (`triton_utils.wait_and_release`), so their launch hides behind it.
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import (INTERPRETED, TritonKernel, next_power_of_2, pdl_launch, tl, triton,
                                        wait_and_release)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
MIN_AMAX = 1e-10


_FP8_VALUES: dict[torch.device, torch.Tensor] = {}


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly. On CPU through a 256-entry table (torch's element-wise
    cast there is twice as slow); elsewhere the cast."""
    if q.device.type != "cpu":
        return q.float()
    table = _FP8_VALUES.get(q.device)
    if table is None:  # every byte's value
        table = _FP8_VALUES[q.device] = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return table.index_select(0, q.contiguous().view(torch.uint8).reshape(-1).int()).view(q.shape)


def quant_max(dtype: torch.dtype) -> float:
    if dtype == FP8:
        return FP8_MAX
    if dtype == torch.int8:
        return INT8_MAX
    raise ValueError(f"activations quantize to {FP8} or torch.int8, not {dtype}")


def _cast(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> dtype, saturated."""
    qmax = quant_max(dtype)
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp(-qmax, qmax).to(dtype)


def quantize_per_token_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] dtype, scale [M, 1] float32)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / quant_max(dtype)
    return _cast(x32 / scale, dtype), scale


def quantize_per_group_reference(x: torch.Tensor, group_size: int,
                                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] dtype, scale [M, ceil(K / group_size)] float32); the last group
    may be short."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scale = padded.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / quant_max(dtype)  # [M, G, 1]
    q = _cast(padded / scale, dtype).view(m, groups * group_size)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def quantize_static_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [M, K], scale [] or [1] float32 -> q [M, K] dtype."""
    return _cast(x.float() / scale.float().reshape(()), dtype)


class TorchActQuant(Kernel):
    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, **_: Any) -> str | None:
        return None

    per_token = staticmethod(quantize_per_token_reference)
    per_group = staticmethod(quantize_per_group_reference)
    static = staticmethod(quantize_static_reference)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

# A program quantizes at most MAX_BLOCK elements in registers; longer rows (per token) or groups
# loop over chunks of LONG_CHUNK: one pass for the amax, a second (from L2) to quantize.
MAX_BLOCK = 8192
LONG_CHUNK = 4096
# Per group: a program takes several groups of a row, about this many elements in all.
GROUP_TILE = 2048

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _rint(y, INTERPRETED: tl.constexpr):
        """Round half to even (torch.round). The interpreter has no libdevice: there, adding and
        subtracting 1.5 * 2**23 rounds |y| < 2**22 to an integer (one RNE addition)."""
        if INTERPRETED:
            return (y + 12582912.0) - 12582912.0
        else:
            return libdevice.rint(y)

    @triton.jit
    def _fp8_e4m3_grid(y):
        """|y| <= 448 -> the nearest float8_e4m3fn value (ties to even), still float32. Only for the
        interpreter, whose float32 -> fp8 cast rounds without carrying into the exponent; on the
        GPU the cast is cvt.rn.satfinite.e4m3x2.f32."""
        a = tl.abs(y)
        exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # 2**-6: smallest normal
        ulp = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2**(exponent - 3): 3 mantissa bits
        r = _rint(a / ulp, True) * ulp
        return tl.where(y < 0, -r, r)

    @triton.jit
    def _quantize(v, scale, QMAX: tl.constexpr, IS_INT8: tl.constexpr, INTERPRETED: tl.constexpr):
        """float32 v / scale -> the values of q (still float32; the store casts), as _cast does."""
        y = tl.math.div_rn(v, scale)
        if IS_INT8:
            y = _rint(y, INTERPRETED)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if not IS_INT8:
            if INTERPRETED:
                y = _fp8_e4m3_grid(y)
        return y

    @triton.jit
    def _quant_groups_kernel(x, q, s, K, num_groups, stride_xm, stride_qm, stride_sm,
                             GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, BLOCK_G: tl.constexpr,
                             QMAX: tl.constexpr, IS_INT8: tl.constexpr, INTERPRETED: tl.constexpr,
                             PDL: tl.constexpr):
        """Program (row, block of GROUPS_PER_PROG groups), all in registers: a [groups, BLOCK_G]
        tile, one amax and one scale per group. Per token is one group of K columns."""
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
        inner = tl.arange(0, BLOCK_G)
        cols = groups[:, None] * GROUP + inner[None, :]
        mask = (inner[None, :] < GROUP) & (cols < K)  # groups past the last start at or past K
        v = tl.load(x + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-10), QMAX)
        tl.store(s + row * stride_sm + groups, scale, mask=groups < num_groups)
        y = _quantize(v, scale[:, None], QMAX, IS_INT8, INTERPRETED)
        tl.store(q + row * stride_qm + cols, y.to(q.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_long_group_kernel(x, q, s, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr,
                                 CHUNK: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
                                 INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        """Program (row, group) for groups longer than a register tile (per token over a long row):
        the amax over chunks of CHUNK columns, then each chunk quantized."""
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        start = group * GROUP
        offs = tl.arange(0, CHUNK)
        x_row = x + row * stride_xm
        running = tl.zeros([CHUNK], tl.float32)
        for c in range(0, GROUP, CHUNK):
            mask = (c + offs < GROUP) & (start + c + offs < K)
            running = tl.maximum(running, tl.abs(tl.load(x_row + start + c + offs, mask=mask, other=0.0)
                                                 .to(tl.float32)))
        scale = tl.math.div_rn(tl.maximum(tl.max(running, axis=0), 1e-10), QMAX)
        tl.store(s + row * stride_sm + group, scale)
        for c in range(0, GROUP, CHUNK):
            mask = (c + offs < GROUP) & (start + c + offs < K)
            v = tl.load(x_row + start + c + offs, mask=mask, other=0.0).to(tl.float32)
            y = _quantize(v, scale, QMAX, IS_INT8, INTERPRETED)
            tl.store(q + row * stride_qm + start + c + offs, y.to(q.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_static_kernel(x, q, s, K, stride_xm, stride_qm, BLOCK: tl.constexpr, QMAX: tl.constexpr,
                             IS_INT8: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        """Program (row, column block): x / scale with one scale for the whole tensor."""
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < K
        scale = tl.load(s).to(tl.float32)
        v = tl.load(x + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        y = _quantize(v, scale, QMAX, IS_INT8, INTERPRETED)
        tl.store(q + row * stride_qm + cols, y.to(q.dtype.element_ty), mask=mask)


def _num_warps(elements: int) -> int:
    """About 8 to 16 elements a thread (16-byte loads of 16-bit x), 1 to 8 warps."""
    return max(1, min(8, elements // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"activation quantization takes [M, K] activations, not {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _reference_only(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """FP8 casts need sm_89 (cvt e4m3): older GPUs quantize to FP8 with the reference."""
    return dtype == FP8 and x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9)


def _quantize_groups(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = quant_max(dtype)
    x = _rows(x)
    m, k = x.shape
    groups = -(-k // group_size)
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    common = dict(QMAX=qmax, IS_INT8=dtype == torch.int8, INTERPRETED=INTERPRETED, **pdl_launch(x.device))
    block_g = next_power_of_2(group_size)
    if block_g <= MAX_BLOCK:
        per_prog = min(max(1, GROUP_TILE // block_g), next_power_of_2(groups))
        grid = (m, triton.cdiv(groups, per_prog))
        _quant_groups_kernel[grid](x, q, scale, k, groups, x.stride(0), q.stride(0), scale.stride(0),
                                   GROUP=group_size, GROUPS_PER_PROG=per_prog, BLOCK_G=block_g,
                                   num_warps=_num_warps(per_prog * block_g), **common)
    else:
        _quant_long_group_kernel[(m, groups)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                              GROUP=group_size, CHUNK=LONG_CHUNK, num_warps=8, **common)
    return q, scale


class TritonActQuant(TritonKernel):
    """Per token, per group and static activation quantization, one launch each (see the module
    docstring for the semantics; results equal the references)."""

    family = "act_quant"

    @classmethod
    def cannot_implement_reason(cls, **_: Any) -> str | None:
        return None

    @staticmethod
    def per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] (bf16 / fp16 / fp32) -> (q [M, K] dtype, scale [M, 1] float32)."""
        if _reference_only(x, dtype):
            return quantize_per_token_reference(x, dtype)
        return _quantize_groups(x, max(x.shape[1], 1), dtype)

    @staticmethod
    def per_group(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (q [M, K] dtype, scale [M, ceil(K / group_size)] float32); the last group
        may be short."""
        if _reference_only(x, dtype):
            return quantize_per_group_reference(x, group_size, dtype)
        return _quantize_groups(x, group_size, dtype)

    @staticmethod
    def static(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x [M, K], scale [] or [1] (float32, on x's device) -> q [M, K] dtype."""
        if _reference_only(x, dtype):
            return quantize_static_reference(x, scale, dtype)
        qmax = quant_max(dtype)
        if scale.numel() != 1:
            raise ValueError(f"a static activation scale has one element, not {tuple(scale.shape)}")
        x = _rows(x)
        m, k = x.shape
        q = torch.empty(m, k, dtype=dtype, device=x.device)
        if m and k:
            block = min(next_power_of_2(k), 2048)
            _quant_static_kernel[(m, triton.cdiv(k, block))](
                x, q, scale.reshape(1), k, x.stride(0), q.stride(0), BLOCK=block, QMAX=qmax,
                IS_INT8=dtype == torch.int8, INTERPRETED=INTERPRETED, num_warps=_num_warps(block),
                **pdl_launch(x.device))
        return q
