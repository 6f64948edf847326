"""W8A8 INT8 linear layers (family `int8_linear`): compressed-tensors int-quantized checkpoints.

Symmetric, no zero points: weights int8 [N, K] with one float32 scale per output channel,
activations int8 [M, K] quantized per token (or one static scale for the tensor) by `act_quant`:

    out [M, N] = (x_q @ w_q.T) * x_scale * w_scale (+ bias), in float32, cast to out_dtype.

`prepare` runs once per layer at load time and returns an `Int8Weights`; `forward` runs every
step. Both implementations read the same layout: w_q [N, K] contiguous (K-major), which is what
the int8 tensor-core instructions want for both operands (Hopper's wgmma takes 8-bit operands
K-major only), so preparing is a contiguous copy and the scale flattened to [N] float32.

The Triton kernels multiply int8 tiles with tl.dot into an int32 accumulator (exact) and apply
both scales and the bias in the epilogue; tiles by M (see `int8_tile`). Two ways to bring the
operands in: pointer loads (cp.async pipelined on sm_90) for decode-sized M, TMA descriptors for
prefill tiles. Any K and N: the pointer kernel masks the tails (K a multiple of BLOCK_K skips the
masks); TMA needs rows on 16-byte boundaries (K % 16 == 0), else the pointer kernel runs. Rows
whose stride is not a multiple of 16 bytes also keep cp.async from pipelining: real layers have
K % 16 == 0, odd K is for correctness only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, multiprocessor_count, next_power_of_2, tl, triton

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def int8_linear_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x_q int8 [M, K], x_scale float32 [M, 1] (or one element), w_q int8 [N, K], w_scale float32
    [N] -> [M, N] out_dtype: (x_q @ w_q.T) * x_scale * w_scale (+ bias), in float32."""
    out = (x_q.float() @ w_q.float().T) * x_scale.float() * w_scale.float().reshape(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@dataclass
class Int8Weights:
    """A layer's weights as the kernels read them: w_q int8 [N, K] contiguous, w_scale float32
    [N] contiguous."""

    w_q: torch.Tensor
    w_scale: torch.Tensor
    in_features: int
    out_features: int


def prepare_int8_weights(w_q: torch.Tensor, w_scale: torch.Tensor) -> Int8Weights:
    """w_q int8 [N, K]; w_scale [N] or [N, 1] (compressed-tensors stores [N, 1]) -> Int8Weights."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        raise ValueError(f"int8 weights are int8 [N, K], not {w_q.dtype} {tuple(w_q.shape)}")
    n, k = w_q.shape
    if w_scale.numel() != n:
        raise ValueError(f"per-channel weight scales: {n} expected, got shape {tuple(w_scale.shape)}")
    return Int8Weights(w_q.contiguous(), w_scale.reshape(n).to(torch.float32).contiguous(), k, n)


def dequantize_int8_weights(weights: Int8Weights) -> torch.Tensor:
    """-> float32 [N, K]: w_q * w_scale (exact: an int8 times a float32 is one rounding at most)."""
    return weights.w_q.float() * weights.w_scale[:, None]


def _rows(x_q: torch.Tensor, x_scale: torch.Tensor, weights: Int8Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """x_q [..., K] -> [M, K] K-contiguous; x_scale -> [M] or [1] float32."""
    if x_q.dtype != torch.int8 or x_q.shape[-1] != weights.in_features:
        raise ValueError(f"int8 activations [..., {weights.in_features}] expected, got {x_q.dtype} "
                         f"{tuple(x_q.shape)}")
    x2 = x_q.reshape(-1, weights.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    scale = x_scale.reshape(-1).to(torch.float32)
    if scale.numel() not in (1, x2.shape[0]):
        raise ValueError(f"activation scales: one per row ({x2.shape[0]}) or one, got {tuple(x_scale.shape)}")
    return x2, scale.contiguous()


class TorchInt8Linear(Kernel):
    """The reference: float32 matmul of the int8 values (exact while |partial sums| < 2**24)."""

    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, **_: Any) -> str | None:
        return None

    prepare = staticmethod(prepare_int8_weights)
    dequantize = staticmethod(dequantize_int8_weights)

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, weights: Int8Weights, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x_q int8 [..., K], x_scale float32 [..., 1] (or one element) -> [..., N] out_dtype."""
        x2, scale = _rows(x_q, x_scale, weights)
        out = int8_linear_reference(x2, scale[:, None], weights.w_q, weights.w_scale, out_dtype, bias)
        return out.view(*x_q.shape[:-1], weights.out_features)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


# Prefill tiles read their operands by TMA (both kernels compile to wgmma for sm_90; which is
# faster has not been measured yet: set False to take the cp.async kernel).
PREFILL_TMA = True


@dataclass(frozen=True)
class Int8Tile:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # operands by TMA (_int8_gemm_tma_kernel) where the rows are 16-byte aligned


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def int8_tile(m: int, n: int, k: int, num_sms: int = 132) -> Int8Tile:
    """Tiles by the number of rows M (a heuristic, not yet tuned on the GPU):

    decode, M <= 16: weight-bandwidth bound. BLOCK_M 16 (the smallest int8 MMA), long K steps
    (BLOCK_K 256) and the columns split finely enough (BLOCK_N 64 / 32 / 16) that about one
    program per SM streams its own slice of the weights.
    M <= 64: BLOCK_M 32 / 64, BLOCK_N 64 / 128.
    M <= 256: 64 x 128 x 128.
    prefill: 128 x 256 x 128 (8 warps, 3 stages: 48 KiB of int8 a stage) when that still makes at
    least one wave of tiles, else 128 x 128 x 128 (8 warps, 4 stages); GROUP_M 8 swizzle; operands
    by TMA (PREFILL_TMA) where rows are 16-byte aligned, else cp.async.

    Blocks shrink to the problem (a small N or K gets a smaller tile) but not below the int8
    MMA's 16 x 16 x 32.
    """
    if m <= 16:
        block_n = 64
        while block_n > 16 and _cdiv(n, block_n) < num_sms:
            block_n //= 2
        tile = Int8Tile(16, block_n, 256, group_m=1, num_warps=4, num_stages=4)
    elif m <= 64:
        block_m = 32 if m <= 32 else 64
        block_n = 128 if _cdiv(m, block_m) * _cdiv(n, 128) >= num_sms else 64
        tile = Int8Tile(block_m, block_n, 128, group_m=8, num_warps=4, num_stages=4)
    elif m <= 256:
        tile = Int8Tile(64, 128, 128, group_m=8, num_warps=4, num_stages=4)
    elif _cdiv(m, 128) * _cdiv(n, 256) >= num_sms:
        tile = Int8Tile(128, 256, 128, group_m=8, num_warps=8, num_stages=3, tma=PREFILL_TMA)
    else:
        tile = Int8Tile(128, 128, 128, group_m=8, num_warps=8, num_stages=4, tma=PREFILL_TMA)
    return Int8Tile(max(16, min(tile.block_m, next_power_of_2(m))), max(16, min(tile.block_n, next_power_of_2(n))),
                    max(32, min(tile.block_k, next_power_of_2(k))), tile.group_m, tile.num_warps, tile.num_stages,
                    tile.tma)


if triton is not None:

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Program id -> (row tile, column tile), GROUP_M row tiles sharing their column tiles in
        launch order (the standard swizzle: a group's weight tiles stay in L2)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % in_group) % group_rows, (pid % in_group) // group_rows

    @triton.jit
    def _int8_epilogue(acc, out, a_scale, b_scale, bias, M, N, stride_om, stride_as, pid_m, pid_n,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """int32 tile -> acc * a_scale[rows] * b_scale[cols] (+ bias) in float32 (the reference's
        order), cast to out's dtype, stored inside [M, N]."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        s_a = tl.load(a_scale + offs_m * stride_as, mask=m_mask, other=0.0)
        s_b = tl.load(b_scale + offs_n, mask=n_mask, other=0.0)
        c = acc.to(tl.float32) * s_a[:, None] * s_b[None, :]
        if HAS_BIAS:
            c = c + tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, c.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _int8_gemm_kernel(a, b, out, a_scale, b_scale, bias, M, N, K, stride_am, stride_bn, stride_om,
                          stride_as, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
        """out[M, N] = (a[M, K] @ b[N, K].T) * a_scale[M] * b_scale[N] (+ bias[N]); pointer loads
        (cp.async pipelined on sm_90 when the row strides are 16-byte multiples)."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # Rows and columns past the edge wrap around (loads stay unmasked; the store masks them).
        offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a + offs_am.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b + offs_bn.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a_tile = tl.load(a_ptrs)
                b_tile = tl.load(b_ptrs)
            else:
                k_left = K - kk * BLOCK_K
                a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
                b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
            acc = tl.dot(a_tile, b_tile, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        _int8_epilogue(acc, out, a_scale, b_scale, bias, M, N, stride_om, stride_as, pid_m, pid_n,
                       HAS_BIAS, BLOCK_M, BLOCK_N)

    @triton.jit
    def _int8_gemm_tma_kernel(a_desc, b_desc, out, a_scale, b_scale, bias, M, N, K, stride_om, stride_as,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """As _int8_gemm_kernel, with both operands brought in by TMA (host tensor descriptors of
        x_q [M, K] and w_q [N, K]; blocks past an edge read as zeros, so no masks and no K rule
        beyond TMA's 16-byte row alignment)."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            a_tile = a_desc.load([off_m, kk * BLOCK_K])
            b_tile = b_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a_tile, b_tile.T, acc, out_dtype=tl.int32)
        _int8_epilogue(acc, out, a_scale, b_scale, bias, M, N, stride_om, stride_as, pid_m, pid_n,
                       HAS_BIAS, BLOCK_M, BLOCK_N)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA reads rows that start on 16-byte boundaries (int8: base and row stride multiples of 16)."""
    return TensorDescriptor is not None and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1


def int8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None, tile: Int8Tile | None = None) -> torch.Tensor:
    """The Triton launch: x_q int8 [M, K] (K-contiguous), x_scale float32 [M] or [1], w_q int8 [N, K]
    contiguous, w_scale float32 [N] -> [M, N] out_dtype."""
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out_dtype).expand(m, n))
    tile = tile or int8_tile(m, n, k, multiprocessor_count(x_q.device))
    if bias is not None:
        bias = bias.contiguous()
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    bias_arg = bias if bias is not None else w_scale  # unread without HAS_BIAS
    scale_stride = 0 if x_scale.numel() == 1 else 1
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages)
    if tile.tma and _tma_ok(x_q) and _tma_ok(w_q):
        a_desc = TensorDescriptor(x_q, [m, k], [x_q.stride(0), 1], [tile.block_m, tile.block_k])
        b_desc = TensorDescriptor(w_q, [n, k], [w_q.stride(0), 1], [tile.block_n, tile.block_k])
        _int8_gemm_tma_kernel[grid](a_desc, b_desc, out, x_scale, w_scale, bias_arg, m, n, k, out.stride(0),
                                    scale_stride, **common)
    else:
        _int8_gemm_kernel[grid](x_q, w_q, out, x_scale, w_scale, bias_arg, m, n, k, x_q.stride(0), w_q.stride(0),
                                out.stride(0), scale_stride, EVEN_K=k % tile.block_k == 0, **common)
    return out


class TritonInt8Linear(TritonKernel):
    """int8 x int8 -> int32 tensor-core GEMM with the per-token and per-channel scales (and the
    bias) applied in the epilogue."""

    family = "int8_linear"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        reason = super().unsupported_reason(device)
        if reason is None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            return "int8 tensor-core dots need compute capability 8.0 or newer"
        return reason

    @classmethod
    def cannot_implement_reason(cls, in_features: int | None = None, out_features: int | None = None,
                                dtype: torch.dtype | None = None, **_: Any) -> str | None:
        if dtype is not None and dtype not in OUT_DTYPES:
            return f"activation dtype {dtype} (bf16, fp16 or fp32)"
        if (in_features is not None and in_features < 1) or (out_features is not None and out_features < 1):
            return f"empty layer ({in_features} -> {out_features})"
        return None

    prepare = staticmethod(prepare_int8_weights)
    dequantize = staticmethod(dequantize_int8_weights)

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, weights: Int8Weights, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None, tile: Int8Tile | None = None) -> torch.Tensor:
        """x_q int8 [..., K], x_scale float32 [..., 1] (or one element: a static per-tensor scale)
        -> [..., N] out_dtype. `tile` overrides the heuristic (tests, tuning)."""
        x2, scale = _rows(x_q, x_scale, weights)
        out = int8_gemm(x2, scale, weights.w_q, weights.w_scale, out_dtype, bias, tile)
        return out.view(*x_q.shape[:-1], weights.out_features)
