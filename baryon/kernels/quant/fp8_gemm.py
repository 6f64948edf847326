"""FP8 (e4m3) GEMMs of quantized linear layers (family `fp8_linear`):

    y = dequant(x_q) @ dequant(w_q).T (+ bias)      x_q [M, K], w_q [N, K] float8_e4m3fn -> y [M, N]

with float32 scales that multiply (a checkpoint's `weight_scale_inv` is multiplied too, despite
its name), in one of two layouts:

    rowwise  x_scale [M, 1]                   per token (dynamic), or a static per-tensor scale
                                              expanded to [M, 1] by the caller (stride 0 is fine)
             w_scale [N]                      per output channel (per-tensor checkpoints are
                                              expanded to [N] by the caller)
             x[m, k] = x_q[m, k] * x_scale[m, 0];  w[n, k] = w_q[n, k] * w_scale[n]

    block    block = (bn, bk), e.g. (128, 128) for DeepSeek-V3 / Qwen3-FP8 `weight_block_size`
             x_scale [M, ceil(K / bk)]        1 x bk activation groups (act_quant's per-group quant)
             w_scale [ceil(N / bn), ceil(K / bk)]   bn x bk weight blocks; the last blocks of N and
                                              K may be partial
             x[m, k] = x_q[m, k] * x_scale[m, k // bk];  w[n, k] = w_q[n, k] * w_scale[n // bn, k // bk]

Every kernel has prepare(w_q, w_scale, block) -> Fp8Weights (repacks once, at load),
forward(x_q, x_scale, weights, out_dtype, bias=None) -> [M, N] out_dtype, and
dequantize(weights) -> float32 [N, K], equal exactly to `dequantize_weight_reference`.

Kernels, in the selector's order:

- `scaled_mm` (ScaledMMFp8Linear): cuBLASLt through torch. Rowwise: torch._scaled_mm with
  scale_a [M, 1], scale_b [1, N] and b = w_q.t() (column-major view of the row-major [N, K]
  weight). Block (128, 128) only, on sm_90 with cuBLASLt >= 12.9: torch.nn.functional.scaled_mm
  with ScalingType.BlockWise1x128 for x (scale_a [M, K/128] M-major, strides (1, M)) and
  BlockWise128x128 for w (scale_b [L4, N/128], strides (1, L4): the [N/128, K/128] weight scales
  padded with zero columns to L4 = round_up(K/128, 4), then transposed). The block path is tried
  once per device on a small product and checked against the reference; if it fails the kernel
  says so and the selector falls back to Triton. K and N must be multiples of 16 (of 128 for
  blocks), activations bf16 or fp16.
- `triton` (TritonFp8Linear): one Triton GEMM, fp8 tiles into tl.dot with float32 accumulation.
  Block scales are applied per K tile (BLOCK_K divides bk: the partial dot is multiplied by
  x_scale[m, kb] * w_scale[n // bn, kb] and added), rowwise scales in the epilogue; then bias and
  the cast. The weight stays [N, K] row-major: both wgmma operands K-major, as FP8 needs.
- `torch` (TorchFp8Linear): the reference (dequantize both, float32 matmul); runs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from baryon.kernels.quant.act_quant import FP8, fp8_to_float
from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, tl, triton

CUBLAS_BLOCK = (128, 128)  # the one block shape cuBLASLt scales (1x128 activations, 128x128 weights)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Fp8Weights:
    """A weight prepared by one kernel's `prepare`: `weight` and `scale` in the layout that
    kernel reads (see each kernel's prepare); `block` None for rowwise scales, else (bn, bk)."""

    weight: torch.Tensor  # float8_e4m3fn, [out_features, in_features] for every kernel here
    scale: torch.Tensor  # float32, kernel-specific layout
    block: tuple[int, int] | None
    in_features: int
    out_features: int


# ---------------------------------------------------------------------------------------------
# Reference


def _check_block(block: Any) -> tuple[int, int] | None:
    if block is None:
        return None
    block = tuple(int(b) for b in block)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (bn, bk) with positive sizes, got {block}")
    return block  # type: ignore[return-value]


def _expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(rows / bn), ceil(cols / bk)] -> float32 [rows, cols] (each block's scale repeated)."""
    bn, bk = block
    return scale.float().repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def _normalise_weight_scale(w_q: torch.Tensor, w_scale: torch.Tensor,
                            block: tuple[int, int] | None) -> torch.Tensor:
    """The weight scale as float32 [N] (rowwise; a single per-tensor value is expanded) or
    contiguous [ceil(N / bn), ceil(K / bk)] (block). Raises on a shape that does not fit."""
    if w_q.dim() != 2 or w_q.dtype != FP8:
        raise ValueError(f"w_q must be a 2-D {FP8} tensor [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
    n, k = w_q.shape
    if block is None:
        if w_scale.numel() == 1:
            return w_scale.float().reshape(1).expand(n).contiguous()  # [N]
        if w_scale.numel() != n:
            raise ValueError(f"rowwise w_scale must have {n} values (one per output channel), "
                             f"got {tuple(w_scale.shape)}")
        return w_scale.float().reshape(n).contiguous()  # [N]
    bn, bk = block
    expected = (_cdiv(n, bn), _cdiv(k, bk))
    if tuple(w_scale.shape) != expected:
        raise ValueError(f"block {block} w_scale must be {expected} for a [{n}, {k}] weight, "
                         f"got {tuple(w_scale.shape)}")
    return w_scale.float().contiguous()  # [ceil(N / bn), ceil(K / bk)]


def dequantize_weight_reference(w_q: torch.Tensor, w_scale: torch.Tensor,
                                block: tuple[int, int] | None = None) -> torch.Tensor:
    """w_q [N, K] fp8, w_scale [N] (rowwise) or [ceil(N / bn), ceil(K / bk)] (block) -> float32 [N, K]."""
    block = _check_block(block)
    scale = _normalise_weight_scale(w_q, w_scale, block)
    n, k = w_q.shape
    weight = fp8_to_float(w_q)
    if block is None:
        return weight * scale[:, None]
    bn, bk = block
    if n % bn == 0 and k % bk == 0:  # whole blocks: broadcast the scales, no [N, K] scale tensor
        return (weight.view(n // bn, bn, k // bk, bk) * scale[:, None, :, None]).view(n, k)
    return weight * _expand_block_scale(scale, n, k, block)


def dequantize_activation_reference(x_q: torch.Tensor, x_scale: torch.Tensor,
                                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """x_q [M, K] fp8, x_scale [M, 1] (or one value; rowwise) or [M, ceil(K / bk)] (block) -> float32 [M, K]."""
    m, k = x_q.shape
    if block is None:
        scale = x_scale.float()
        scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(m, 1)
        return x_q.float() * scale
    bk = block[1]
    if tuple(x_scale.shape) != (m, _cdiv(k, bk)):
        raise ValueError(f"block x_scale must be {(m, _cdiv(k, bk))}, got {tuple(x_scale.shape)}")
    return x_q.float() * x_scale.float().repeat_interleave(bk, dim=1)[:, :k]


def fp8_linear_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None) -> torch.Tensor:
    """[M, N] out_dtype: both operands dequantized to float32 (block scales expanded), a float32
    matmul, the bias added in float32, then the cast."""
    block = _check_block(block)
    x = dequantize_activation_reference(x_q, x_scale, block)  # [M, K] float32
    w = dequantize_weight_reference(w_q, w_scale, block)  # [N, K] float32
    y = x @ w.t()  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# torch reference kernel


class TorchFp8Linear(Kernel):
    """The reference as a kernel: dequantizes the whole weight every call (the CPU fallback)."""

    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, **_: Any) -> str | None:
        return None

    @staticmethod
    def prepare(w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weights:
        """weight [N, K] fp8 contiguous; scale [N] or [ceil(N / bn), ceil(K / bk)] float32."""
        block = _check_block(block)
        scale = _normalise_weight_scale(w_q, w_scale, block)
        return Fp8Weights(w_q.contiguous(), scale, block, w_q.shape[1], w_q.shape[0])

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, weights: Fp8Weights, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear_reference(x_q, x_scale, weights.weight, weights.scale, out_dtype, bias, weights.block)

    @staticmethod
    def dequantize(weights: Fp8Weights) -> torch.Tensor:
        return dequantize_weight_reference(weights.weight, weights.scale, weights.block)


# ---------------------------------------------------------------------------------------------
# cuBLASLt through torch


def _scaled_mm_api() -> Any:
    """torch.nn.functional when it has scaled_mm with ScalingType (torch >= 2.10), else None."""
    functional = torch.nn.functional
    if all(hasattr(functional, name) for name in ("scaled_mm", "ScalingType", "SwizzleType")):
        return functional
    return None


def _m_major(x_scale: torch.Tensor) -> torch.Tensor:
    """[M, G] -> float32 [M, G] with strides exactly (1, M), as cuBLAS reads 1x128 scales (built
    with empty_strided: `.t().contiguous().t()` keeps strides (G, 1) when M == 1, which torch's
    check refuses)."""
    m, groups = x_scale.shape
    out = torch.empty_strided((m, groups), (1, max(m, 1)), dtype=torch.float32, device=x_scale.device)
    return out.copy_(x_scale)


# device index -> None (blockwise scaled_mm works and matches the reference) or why not.
_BLOCKWISE_PROBED: dict[int, str | None] = {}


def blockwise_scaled_mm_reason(device: torch.device | None = None) -> str | None:
    """Whether torch's blockwise FP8 scaled_mm (1x128 activations x 128x128 weights) runs on this
    CUDA device and agrees with the reference: tried once per device on a small product (K/128 = 3,
    not a multiple of 4, so the padded scale layout is exercised; M of 1, 5 and 64), then cached."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    device = torch.device("cuda", torch.cuda.current_device()) if device is None or device.index is None \
        else device
    if device.index in _BLOCKWISE_PROBED:
        return _BLOCKWISE_PROBED[device.index]
    if torch.cuda.is_current_stream_capturing():
        return "cannot try blockwise scaled_mm while a CUDA graph is captured"  # not cached
    reason = _probe_blockwise(device)
    _BLOCKWISE_PROBED[device.index] = reason
    return reason


def _probe_blockwise(device: torch.device) -> str | None:
    if _scaled_mm_api() is None:
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (blockwise scaling needs torch >= 2.10)"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return (f"cuBLAS blockwise FP8 scaling (1x128 x 128x128) runs on sm_90 only, "
                f"not sm_{capability[0]}{capability[1]}")
    gen = torch.Generator().manual_seed(0)  # inputs drawn on the CPU (whatever the default device is), then moved
    n, k = 256, 384
    w_q = (torch.randn(n, k, generator=gen, device="cpu") * 64).to(FP8)  # [N, K]
    w_scale = torch.rand(n // 128, k // 128, generator=gen, device="cpu") + 0.5  # [N/128, K/128], distinct per block
    weights = ScaledMMFp8Linear.prepare(w_q.to(device), w_scale.to(device), CUBLAS_BLOCK)
    for m in (1, 5, 64):
        x_q = (torch.randn(m, k, generator=gen, device="cpu") * 64).to(FP8)  # [M, K]
        x_scale = torch.rand(m, k // 128, generator=gen, device="cpu") + 0.5  # [M, K/128]
        try:
            out = ScaledMMFp8Linear.forward(x_q.to(device), x_scale.to(device), weights, torch.bfloat16)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure means: not here, fall back
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"blockwise scaled_mm failed on this torch/cuBLAS: {type(exc).__name__}: {message[:200]}"
        ref = fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, block=CUBLAS_BLOCK)
        err = float((out.float().cpu() - ref).norm() / ref.norm().clamp(min=1e-30))
        if not err < 2e-2:
            return (f"blockwise scaled_mm disagrees with the reference (relative error {err:.3g} at M={m}): "
                    "this torch/cuBLAS wants another scale layout")
    return None


class ScaledMMFp8Linear(Kernel):
    """cuBLASLt's FP8 GEMM: torch._scaled_mm (rowwise) or torch.nn.functional.scaled_mm (1x128 x
    128x128 blocks, sm_90, checked once per device). Prepared layouts:

        weight  fp8 [N, K] row-major (passed as its transpose: the column-major [K, N] cuBLAS wants)
        scale   rowwise: float32 [1, N] contiguous
                block:   float32 [L4, N/128] with strides (1, L4), L4 = round_up(K/128, 4): the
                         [N/128, K/128] block scales padded with zero columns, transposed
    """

    name = "scaled_mm"
    use_fast_accum = False  # cuBLAS promotes the FP8 partial sums to float32 (as the Triton kernel)

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device (cuBLASLt FP8 GEMM)"
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return f"FP8 tensor cores need compute capability >= 8.9, this device is {capability[0]}.{capability[1]}"
        return None

    @classmethod
    def cannot_implement_reason(cls, *, in_features: int | None = None, out_features: int | None = None,
                                block: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
                                **_: Any) -> str | None:
        if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
            return f"activations in {dtype} (cuBLAS FP8 GEMMs here write bf16 or fp16)"
        if in_features is not None and in_features % 16:
            return f"in_features={in_features} is not a multiple of 16 (cuBLAS FP8 alignment)"
        if out_features is not None and out_features % 16:
            return f"out_features={out_features} is not a multiple of 16 (cuBLAS FP8 alignment)"
        if block is not None:
            if tuple(block) != CUBLAS_BLOCK:
                return f"block {tuple(block)}: cuBLAS scales only {CUBLAS_BLOCK} blocks"
            if (in_features is not None and in_features % 128) or (out_features is not None and out_features % 128):
                return f"[{out_features}, {in_features}] is not a whole number of 128 x 128 blocks"
            return blockwise_scaled_mm_reason()
        return None

    @staticmethod
    def prepare(w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weights:
        block = _check_block(block)
        scale = _normalise_weight_scale(w_q, w_scale, block)
        n, k = w_q.shape
        if block is None:
            return Fp8Weights(w_q.contiguous(), scale.reshape(1, n), None, k, n)  # scale [1, N]
        if block != CUBLAS_BLOCK or n % 128 or k % 128:
            raise ValueError(f"scaled_mm takes {CUBLAS_BLOCK} blocks of a weight of whole blocks, "
                             f"not {block} blocks of [{n}, {k}]")
        kb = k // 128
        padded = torch.zeros(n // 128, _cdiv(kb, 4) * 4, dtype=torch.float32, device=scale.device)  # [N/128, L4]
        padded[:, :kb] = scale
        return Fp8Weights(w_q.contiguous(), padded.t(), block, k, n)  # scale [L4, N/128], strides (1, L4)

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, weights: Fp8Weights, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if x_q.stride(-1) != 1 or (x_q.shape[0] > 1 and x_q.stride(0) != x_q.shape[1]):
            x_q = x_q.contiguous()  # cuBLAS wants a row-major a
        m = x_q.shape[0]
        if weights.block is None:
            scale_a = x_scale.float().reshape(-1, 1).expand(m, 1).contiguous()  # [M, 1]
            fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
            out = torch._scaled_mm(x_q, weights.weight.t(), scale_a=scale_a, scale_b=weights.scale,
                                   bias=bias if fused_bias else None, out_dtype=out_dtype,
                                   use_fast_accum=ScaledMMFp8Linear.use_fast_accum)
            if bias is not None and not fused_bias:
                out = (out.float() + bias.float()).to(out_dtype)
            return out
        functional = _scaled_mm_api()
        if functional is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
        recipe, swizzle = functional.ScalingType, functional.SwizzleType
        out = functional.scaled_mm(x_q, weights.weight.t(), _m_major(x_scale), recipe.BlockWise1x128,
                                   weights.scale, recipe.BlockWise128x128, swizzle_a=swizzle.NO_SWIZZLE,
                                   swizzle_b=swizzle.NO_SWIZZLE, output_dtype=out_dtype,
                                   use_fast_accum=ScaledMMFp8Linear.use_fast_accum)
        if bias is not None:  # added outside: the blockwise epilogue's bias support is not relied on
            out = (out.float() + bias.float()).to(out_dtype)
        return out

    @staticmethod
    def dequantize(weights: Fp8Weights) -> torch.Tensor:
        if weights.block is None:
            return dequantize_weight_reference(weights.weight, weights.scale.reshape(-1), None)
        scale = weights.scale.t()[:, :_cdiv(weights.in_features, weights.block[1])]  # drop the padding
        return dequantize_weight_reference(weights.weight, scale, weights.block)


# ---------------------------------------------------------------------------------------------
# Triton


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def tile_config(m: int, n: int, k: int, block: tuple[int, int] | None = None, has_bias: bool = False) -> TileConfig:
    """Tiles by token count: decode (M <= 16) is a weight stream, so narrow column tiles give
    more programs; prefill (M in the thousands) takes 128 x 128 tiles with 8 warps. BLOCK_K is 128
    for rowwise scales (cut to the power of 2 above a small K) and, for block scales, the largest
    power of 2 <= 128 that divides bk, so no K tile straddles two scale blocks. Block scales with
    a bias take 128 x 64 prefill tiles (128 x 128 used all 255 registers and spilled 76 bytes in
    an sm_90 compile with Triton 3.6)."""
    if block is None:
        block_k = min(128, max(32, next_power_of_2(k)))
    else:
        bk = block[1]
        block_k = min(128, bk & -bk)  # lowest set bit: a power of 2 dividing bk
    if m <= 16:
        return TileConfig(16, 64 if n >= 8192 else 32, block_k, 1, 4, 4)
    if m <= 64:
        return TileConfig(64, 64, block_k, 8, 4, 4)
    if m <= 512:
        return TileConfig(64, 128, block_k, 8, 4, 4)
    return TileConfig(128, 64 if block is not None and has_bias else 128, block_k, 8, 8, 3)


if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(x, w, xs, ws, bias, out, M, N, K, scale_bn, scale_bk,
                         stride_xm, stride_xk, stride_wn, stride_wk, stride_xsm, stride_xsk,
                         stride_wsn, stride_wsk, stride_om, stride_on,
                         BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
        """out[M, N] = (x[M, K] * xs) @ (w[N, K] * ws).T (+ bias); x, w float8_e4m3fn.
        Rowwise: xs[m] (stride_xsm), ws[n] (stride_wsn), applied in the epilogue. Block: xs[m, kb],
        ws[n // scale_bn, kb] for the K tile starting at k0 (kb = k0 // scale_bk; BLOCK_K divides
        scale_bk), applied to each tile's partial dot."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        # Grouped order: GROUP_M row tiles share each column tile's weights while they are in L2.
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_m % M  # wrapped, so the main loop loads without row / column masks
        cols = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
        w_ptrs = w + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
        xs_ptrs = xs + rows * stride_xsm  # [BM]
        if BLOCK_SCALES:
            ws_ptrs = ws + (cols // scale_bn) * stride_wsn  # [BN]
        else:
            ws_ptrs = ws + cols * stride_wsn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                k_left = K - kt * BLOCK_K
                a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if BLOCK_SCALES:
                kb = (kt * BLOCK_K) // scale_bk
                a_s = tl.load(xs_ptrs + kb * stride_xsk)  # [BM]
                b_s = tl.load(ws_ptrs + kb * stride_wsk)  # [BN]
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
            else:
                # Promote the FP8 partial sums to float32 every tile (Hopper's default accumulates
                # the whole K in the tensor cores' reduced precision).
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

        if not BLOCK_SCALES:
            acc = acc * tl.load(xs_ptrs)[:, None] * tl.load(ws_ptrs)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + cols).to(tl.float32)[None, :]
        out_ptrs = out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


class TritonFp8Linear(TritonKernel):
    """One Triton GEMM for both scale layouts. Prepared layout: weight fp8 [N, K] row-major
    (K-major B tiles for the FP8 wgmma), scale float32 [N] (rowwise) or contiguous
    [ceil(N / bn), ceil(K / bk)] (block)."""

    family = "fp8_linear"

    @classmethod
    def cannot_implement_reason(cls, *, block: tuple[int, int] | None = None, **_: Any) -> str | None:
        if block is not None and int(block[1]) % 32:
            return f"block {tuple(block)}: bk must be a multiple of 32 (Triton's FP8 dot takes K tiles of 32 or more)"
        return None

    prepare = TorchFp8Linear.prepare  # the same layout: row-major [N, K], what the FP8 dot reads

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, weights: Fp8Weights, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
        """`config` overrides the tile heuristic (tests, tuning)."""
        m, k = x_q.shape
        n = weights.out_features
        if k != weights.in_features:
            raise ValueError(f"x has {k} features, the weight {weights.in_features}")
        out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)  # [M, N]
        if m == 0:
            return out
        block = weights.block
        if block is None:
            x_scale = x_scale.float().reshape(-1, 1).expand(m, 1)  # [M, 1], stride 0 for one value
            scale_bn = scale_bk = 1
            stride_wsn, stride_wsk = weights.scale.stride(0), 0
        else:
            bn, bk = block
            if tuple(x_scale.shape) != (m, _cdiv(k, bk)):
                raise ValueError(f"block x_scale must be {(m, _cdiv(k, bk))}, got {tuple(x_scale.shape)}")
            if x_scale.dtype != torch.float32:
                x_scale = x_scale.float()
            scale_bn, scale_bk = bn, bk
            stride_wsn, stride_wsk = weights.scale.stride()
        if bias is not None:
            bias = bias.contiguous()  # [N]
        cfg = config or tile_config(m, n, k, block, bias is not None)
        if block is not None and block[1] % cfg.block_k:
            raise ValueError(f"BLOCK_K={cfg.block_k} must divide bk={block[1]}")
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _fp8_gemm_kernel[grid](
            x_q, weights.weight, x_scale, weights.scale, bias if bias is not None else out, out,
            m, n, k, scale_bn, scale_bk,
            x_q.stride(0), x_q.stride(1), weights.weight.stride(0), weights.weight.stride(1),
            x_scale.stride(0), x_scale.stride(1), stride_wsn, stride_wsk, out.stride(0), out.stride(1),
            BLOCK_SCALES=block is not None, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out

    @staticmethod
    def dequantize(weights: Fp8Weights) -> torch.Tensor:
        return dequantize_weight_reference(weights.weight, weights.scale, weights.block)
