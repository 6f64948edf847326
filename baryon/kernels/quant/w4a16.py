"""Weight-only quantized linear layers, W4A16 and W8A16 (GPTQ, AWQ, compressed-tensors pack-quantized).

The loaders turn every checkpoint format into one canonical form and hand it to `prepare` once:

    codes   uint8 [N, K]   unsigned codes 0 .. 2**bits - 1 (bits 4 or 8)
    scales  [N, G]         float32, float16 or bfloat16; G = ceil(K / group_size)
    zeros   uint8 [N, G]   unsigned zero-point codes (symmetric formats: 2**(bits - 1) everywhere)

    weight[n, k] = (codes[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]

computed in float32 (the product of two exact values, rounded once, so every implementation here
gives the same bits). group_size >= K (or <= 0) is the channel strategy: one group per row. GPTQ
act-order is the caller's business: it permutes the columns of codes and x so that groups are
contiguous. `prepare` returns a `WNA16Weights` whose tensors are laid out for the kernel that made
it; every layout keeps the codes packed, `bits` bits per weight. The Triton kernel has two: 4-bit
codes in groups of 32, 64, a multiple of 128 or one per row take "triton-mma" (`w4_mma.py`: a
tensor-core GEMM for 1-128 rows, its module docstring describes the layout), every other weight
the interleaved "triton" layout below.

Torch layout (`TorchW4A16Linear`, the reference; family `w4a16_linear`, name "torch"):

    qweight  uint8 [N, ceil(K * bits / 8)]  bits 4: byte b holds k = 2b (low nibble) and 2b + 1
                                            (high nibble); bits 8: the codes as they are
    scales   [N, G]  the given dtype
    zeros    uint8 [N, G], or None when every zero point is the same (`zero_point` holds it)

Interleaved Triton layout (`TritonW4A16Linear`, layout "triton"): K is padded with zero codes to Kp, a multiple of
KBLOCK = 128, and each row is cut into blocks of 128 codes. A block is PACK = 32 / bits chunks of
CK = 128 / PACK consecutive codes (bits 4: 8 chunks of 16; bits 8: 4 chunks of 32), stored as CK
int32 words: word j of a block holds code (chunk i, position j) in bits [i * bits, (i + 1) * bits).
N is padded with empty rows to Np, a multiple of ROWS = 8, and the rows are interleaved in groups
of ROWS: word w of rows 8g .. 8g + 7 lie side by side (32 bytes), so that one thread of the GEMV
loads one word of eight rows and multiplies each x value it loads into eight rows.

    qweight  int32 [Np / ROWS, Kp / PACK, ROWS]   qweight[g, w, r] = word w of row ROWS * g + r
    scales   [Gp, Np] the given dtype, Gp = ceil(Kp / group_size) (padded groups and rows: scale 0);
             channel strategy: [1, Np]
    zeros    uint8 [Gp, Np], or None when every zero point is the same (`zero_point`)

The GEMM loads a [BLOCK_N / ROWS, CK, ROWS]-word tile per block, unpacks it as
[BLOCK_N / ROWS, CK, ROWS, PACK] with one constant shift per field (the chunk) and one mask,
dequantizes, and permutes (row group, position, row, chunk) back to a [BLOCK_N, 128] tile in
column order for one dot over the block, against the block's 128 columns of x as they lie in
memory. Scales and zeros are N-major, so a row tile's scales are one contiguous load; groups of a
whole block (group_size a multiple of 128) or of whole chunks need one load per block or per
chunk, any other group size one per code.

The GEMM computes the transposed product out^T[n, m] = sum_k W[n, k] x[m, k], so the dequantized
weight tile is the left operand of `tl.dot` (it stays in registers; the activation tile is the one
staged through shared memory) and a decode step of a few tokens still fills the MMA's tall side
with weight rows (on sm_90 a warpgroup MMA, 64 weight rows per warpgroup). Codes become float32
through the exponent trick (bitcast(code | 0x4B000000) = 2**23 + code, exact), then
(code - zero) * scale in float32 (the same bits as the reference), then x's dtype for the dot,
which accumulates in float32. The tile sizes come from `tile_config` (a small table by M); decode
batches (M <= 128) split K over several programs when the row tiles alone cannot fill the GPU,
writing float32 partial sums that a second kernel adds in a fixed order (deterministic) together
with the bias.

The GEMV (one row of x per program, GEMV_MAX_M rows at most) uses no tl.dot and never builds the
weight: for field i of a word it places the code in the high mantissa of 1.0,
f = bitcast(((word >> i * bits) & mask) << (23 - bits) | 0x3F800000) = 1 + code / 2**bits (exact,
one shift and one mask-or), and uses sum_k x_k (code_k - zero) = 2**bits sum_k x_k f_k
- (2**bits + zero) sum_k x_k per group, so a code costs a shift, a mask-or and one fused
multiply-add; the sums of x are shared by the eight interleaved rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel
from baryon.kernels.quant import w4_mma
from baryon.kernels.quant.split_k import reduce_split_k, store_transposed_tile
from baryon.kernels.triton_utils import INTERPRETED, TritonKernel, multiprocessor_count, pdl_launch, tl, triton

BITS = (4, 8)
KBLOCK = 128  # codes per packed block of the Triton layout (and the kernel's K step)
ROWS = 8  # weight rows interleaved word by word in the Triton layout
_MAGIC = 0x4B000000  # float32 bits of 2**23: OR a small integer into the mantissa to convert it


def _group_size(group_size: int, in_features: int) -> int:
    """The group size that the kernels use: the channel strategy (group_size <= 0 or >= K) is one
    group of K columns."""
    return in_features if group_size <= 0 or group_size >= in_features else group_size


def _check_canonical(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                     group_size: int) -> int:
    """Validates the canonical inputs; returns the effective group size."""
    if bits not in BITS:
        raise ValueError(f"bits={bits} (supported: {BITS})")
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be uint8 [N, K], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    gs = _group_size(group_size, k)
    groups = -(-k // gs)
    if scales.shape != (n, groups) or not scales.is_floating_point():
        raise ValueError(f"scales must be float [{n}, {groups}] (group_size {group_size}), got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if zeros.dtype != torch.uint8 or zeros.shape != (n, groups):
        raise ValueError(f"zeros must be uint8 [{n}, {groups}], got {zeros.dtype} {tuple(zeros.shape)}")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes exceed {bits} bits")
    return gs


def _uniform_zero(zeros: torch.Tensor) -> int | None:
    """The zero point shared by every group, or None when they differ."""
    if zeros.numel() == 0:
        return 1 << 7
    first = zeros.reshape(-1)[:1]
    return int(first) if bool((zeros == first).all()) else None


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | int,
                group_size: int) -> torch.Tensor:
    """codes [N, K] integer, scales [N, G], zeros [N, G] or one int -> float32 [N, K]. The one
    formula every path shares: (code - zero) is an exact integer, times the float32 scale."""
    k = codes.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    if isinstance(zeros, int):
        return (codes.to(torch.int32) - zeros).float() * s
    z = zeros.to(torch.int32).repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    return (codes.to(torch.int32) - z).float() * s


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """Canonical codes uint8 [N, K], scales [N, G], zeros uint8 [N, G] -> float32 [N, K]."""
    return _dequantize(codes, scales, zeros, _group_size(group_size, codes.shape[1]))


def w4a16_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: dequantize to float32, linear in float32, cast back."""
    w = dequantize_reference(codes, scales, zeros, group_size)
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


@dataclass
class WNA16Weights:
    """A weight as one kernel's `prepare` laid it out (see the module docstring for each layout)."""

    qweight: torch.Tensor  # packed codes: uint8 [N, ceil(K * bits / 8)] (torch), int32 [Np / 8, Kp / PACK, 8] (triton)
    scales: torch.Tensor  # [N, G] (torch) or [Gp, Np] (triton), the checkpoint's float dtype
    zeros: torch.Tensor | None  # uint8, shaped like scales; None: every zero point is `zero_point`
    bits: int
    group_size: int  # effective: in_features for the channel strategy
    in_features: int  # K
    out_features: int  # N
    zero_point: int = 0  # the shared zero point when zeros is None
    layout: str = "torch"  # the kernel that prepared it: "torch", "triton" or "triton-mma" (w4_mma)

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)


def _check_layout(weights: WNA16Weights, *layouts: str) -> None:
    if weights.layout not in layouts:
        raise ValueError(f"weights prepared for the {weights.layout} kernel, not {' or '.join(layouts)}")


class TorchW4A16Linear(Kernel):
    """The reference: codes stay packed in memory; every call dequantizes the whole weight in
    float32 and runs an ordinary linear in x's dtype."""

    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, *, bits: int = 4, dtype: torch.dtype = torch.float32, **_: Any) -> str | None:
        if bits not in BITS:
            return f"bits={bits} (supported: {BITS})"
        if not dtype.is_floating_point:
            return f"activations in {dtype}"
        return None

    @staticmethod
    def prepare(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                group_size: int) -> WNA16Weights:
        gs = _check_canonical(codes, scales, zeros, bits, group_size)
        n, k = codes.shape
        if bits == 4:
            padded = F.pad(codes, (0, k % 2))  # [N, K rounded up to even]
            qweight = padded[:, 0::2] | (padded[:, 1::2] << 4)  # uint8 [N, ceil(K / 2)]
        else:
            qweight = codes  # uint8 [N, K]
        zp = _uniform_zero(zeros)
        return WNA16Weights(qweight.contiguous(), scales.contiguous(), None if zp is not None else zeros.contiguous(),
                            bits, gs, k, n, zero_point=zp or 0, layout="torch")

    @staticmethod
    def dequantize(weights: WNA16Weights) -> torch.Tensor:
        """float32 [N, K], equal to dequantize_reference of the canonical inputs."""
        _check_layout(weights, "torch")
        q = weights.qweight
        if weights.bits == 4:
            codes = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1)[:, :weights.in_features]
        else:
            codes = q
        zeros = weights.zero_point if weights.zeros is None else weights.zeros
        return _dequantize(codes, weights.scales, zeros, weights.group_size)

    @staticmethod
    def forward(x: torch.Tensor, weights: WNA16Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        w = TorchW4A16Linear.dequantize(weights).to(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))


# ----------------------------------------------------------------------------------------------
# Triton


@dataclass(frozen=True)
class TileConfig:
    """One launch of the Triton kernel: [block_n, block_m] output tiles (K steps of KBLOCK), and
    split_k programs per tile, each over a K slice (1: no split, no second pass)."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# (largest M, BLOCK_M, BLOCK_N, num_warps, num_stages), first match wins. Decode batches keep the
# token tile small (the MMA's short side) and get their parallelism from N and a K split; prefill
# uses square 128 x 128 tiles, eight warps.
TILE_TABLE: tuple[tuple[int | None, int, int, int, int], ...] = (
    (16, 16, 64, 4, 4),
    (32, 32, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 128, 64, 4, 3),
    (None, 128, 128, 8, 3),
)
SPLIT_K_MAX_M = 128  # larger batches have enough row tiles
# From this many rows the weight is dequantized to x's dtype by one kernel and multiplied by cuBLAS:
# the tiled GEMM dequantizes every weight tile once per row tile, so past decode sizes it is bound
# by unpacking, while dequantizing once costs one read of the 4-bit weight and one write of a
# 16-bit copy. On an H100 (`benchmarks/w4a16_paths.py`, Qwen3-8B's projections, 2026-11-24) the
# GEMM wins up to 128 rows (gate/up: 114 against 175 us) and loses from where its 128 x 128 tiles
# start (256 rows: 335 against 180 us; 4096: 5,173 against 1,245 us).
DEQUANTIZE_MIN_M = 129
SPLIT_K_MAX = 16
SPLIT_K_MIN_BLOCKS = 4  # K blocks per split at least (a longer slice streams better)
RESIDENT = 3  # decode programs resident per SM (4 warps, ~100-200 registers, <= 100 KB shared)


def tile_config(m: int, n: int, k: int, device: torch.device, num_sms: int | None = None) -> TileConfig:
    """The tiles for x [m, k] times a [n, k] weight: TILE_TABLE by m; then, for m <= SPLIT_K_MAX_M,
    K is split in two while twice the programs still fit in one wave (RESIDENT per SM) and each
    split keeps SPLIT_K_MIN_BLOCKS blocks of K. (H100, M = 1: 4096 x 4096 -> 64 row tiles x 4
    splits of 1024; 12288 x 4096 -> 192 x 2.)"""
    for max_m, block_m, block_n, num_warps, num_stages in TILE_TABLE:
        if max_m is None or m <= max_m:
            break
    split = 1
    if m <= SPLIT_K_MAX_M:
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        blocks = triton.cdiv(k, KBLOCK)
        slots = RESIDENT * (num_sms or multiprocessor_count(device, off_gpu=4))
        while (split < SPLIT_K_MAX and tiles * split * 2 <= slots
               and blocks // (2 * split) >= SPLIT_K_MIN_BLOCKS):
            split *= 2
    return TileConfig(block_m, block_n, split, num_warps, num_stages)


@dataclass(frozen=True)
class GemvTiles:
    """One launch of the GEMV: row_groups groups of ROWS interleaved weight rows per program,
    blocks_per_step 128-code blocks of K per loop step (reduced to a power of two that divides the
    row's blocks), num_warps; prefetch: load the next step's words before working on this one."""

    row_groups: int
    blocks_per_step: int
    num_warps: int = 4
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("row_groups", "blocks_per_step"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvTiles.{name} must be a power of two, got {value}")

    def blocks(self, num_blocks: int) -> int:
        nb = self.blocks_per_step
        while num_blocks % nb:
            nb //= 2
        return nb


# Batches of at most GEMV_MAX_M rows take the GEMV. On an H100 (benchmarks/tune_quant_gemv.py
# --kernels w4a16 --m 1 --quick, Qwen3-8B's projections, 4-bit groups of 128, 2026-11-24) it streams
# the weight at 1.15-1.63 TB/s, 1.6-2.4x the GEMV it replaced (one weight row per thread, x loaded
# once per code), ahead of the tiled GEMM at one row.
GEMV_MAX_M = 1
# (bits, smallest N, smallest K, row_groups, blocks_per_step, num_warps, prefetch): first match
# wins. Wide layers (gate/up) run many small programs; the others hold a 4096-code stretch of 8-16
# weight rows per program and step. The 8-bit rows carry the 4-bit choices over at the same bytes
# per step (half the blocks); they were not timed.
GEMV_TABLE: tuple[tuple[int, int, int, int, int, int, bool], ...] = (
    (4, 12288, 0, 1, 4, 4, False),
    (4, 0, 8192, 2, 32, 4, False),
    (4, 6144, 0, 2, 32, 4, True),
    (4, 0, 0, 1, 32, 8, True),
    (8, 12288, 0, 1, 2, 4, False),
    (8, 0, 0, 1, 16, 8, True),
)


def gemv_tiles(n: int, k: int, bits: int) -> GemvTiles:
    return next(GemvTiles(*cfg[3:]) for cfg in GEMV_TABLE if bits == cfg[0] and n >= cfg[1] and k >= cfg[2])


# Scale / zero modes: how a K block finds its groups.
_CHANNEL, _PER_BLOCK, _PER_CHUNK, _GATHER = 0, 1, 2, 3


def _group_mode(group_size: int, in_features: int, chunk: int) -> int:
    if group_size >= in_features:
        return _CHANNEL  # one group per row: loaded once per program
    if group_size % KBLOCK == 0:
        return _PER_BLOCK  # one scale vector per K block
    if group_size % chunk == 0:
        return _PER_CHUNK  # one scale vector per chunk of CK codes
    return _GATHER  # groups smaller than a chunk (or ragged): one scale per code


if triton is not None:

    @triton.jit
    def _group_params(scales, zeros, g, rows, Np, zf_const, HAS_ZEROS: tl.constexpr):
        """float32 scale and zero term zf of weight rows `rows` in groups g (tensors that broadcast
        together; always in bounds). zf = zf_const + the group's zero point when HAS_ZEROS; else
        zf_const, which then already holds the shared zero point."""
        idx = g * Np + rows
        s = tl.load(scales + idx).to(tl.float32)
        if HAS_ZEROS:
            zf = tl.load(zeros + idx).to(tl.float32) + zf_const
        else:
            zf = tl.zeros_like(s) + zf_const
        return s, zf

    @triton.jit
    def _block_tile(w_ptrs, scales, zeros, rows, k0, s, zf, Np, zf_const, like, BITS: tl.constexpr,
                    GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, R: tl.constexpr):
        """The dequantized weight of one 128-code block (column k0 on) of BLOCK_N / R row groups,
        [BLOCK_N, 128] in like's dtype, rows g R + r and columns in order. w_ptrs [BG, CK, R]: the
        block's words; rows [BG, 1, R, 1]; s, zf: the channel groups' scale and zero term."""
        KB: tl.constexpr = 128
        PACK: tl.constexpr = 32 // BITS
        CK: tl.constexpr = KB // PACK
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_i = tl.arange(0, PACK)  # chunk = field of a word
        offs_j = tl.arange(0, CK)
        words = tl.load(w_ptrs)  # int32 [BG, CK, R]
        # [BG, CK, R, PACK]: codes[g, j, r, i] is row g R + r, column k0 + i * CK + j
        codes = (words[:, :, :, None] >> (offs_i * BITS)[None, None, None, :]) & MASK
        if GROUP_MODE == 1:  # the block is inside one group
            s, zf = _group_params(scales, zeros, k0 // GROUP_SIZE, rows, Np, zf_const, HAS_ZEROS)
        elif GROUP_MODE == 2:  # each chunk is inside one group: [BG, 1, R, PACK]
            s, zf = _group_params(scales, zeros, ((k0 + offs_i * CK) // GROUP_SIZE)[None, None, None, :], rows,
                                  Np, zf_const, HAS_ZEROS)
        elif GROUP_MODE == 3:  # any groups: [BG, CK, R, PACK]
            g = (k0 + offs_i[None, None, None, :] * CK + offs_j[None, :, None, None]) // GROUP_SIZE
            s, zf = _group_params(scales, zeros, g, rows, Np, zf_const, HAS_ZEROS)
        w = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s  # exact (code - zero) * scale
        w = w.to(like.dtype.element_ty)
        return tl.reshape(tl.permute(w, (0, 2, 3, 1)), (BLOCK_N, KB))  # [BN, KB]: row g R + r, column k - k0

    @triton.jit
    def _wna16_dequantize_kernel(qweight, scales, zeros, out, N, Np, K, words_per_row, zf_const,
                                 BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr,
                                 HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr):
        """out [N, K] (x's dtype) = the weight of BLOCK_N rows and one 128-code block (program (row
        tile, block)), the values the GEMM multiplies."""
        KB: tl.constexpr = 128
        CK: tl.constexpr = KB * BITS // 32
        BG: tl.constexpr = BLOCK_N // R
        pid_n = tl.program_id(0)
        k0 = tl.program_id(1) * KB
        offs_g = (pid_n * BG + tl.arange(0, BG)) % (Np // R)
        offs_r = tl.arange(0, R)
        rows = (offs_g * R)[:, None, None, None] + offs_r[None, None, :, None]  # [BG, 1, R, 1]
        w_ptrs = (qweight + offs_g[:, None, None].to(tl.int64) * words_per_row * R
                  + (k0 // KB * CK + tl.arange(0, CK))[None, :, None] * R + offs_r[None, None, :])  # [BG, CK, R]
        s, zf = _group_params(scales, zeros, 0, rows, Np, zf_const, HAS_ZEROS)  # channel groups; else unused
        w = _block_tile(w_ptrs, scales, zeros, rows, k0, s, zf, Np, zf_const, out, BITS, GROUP_SIZE, GROUP_MODE,
                        HAS_ZEROS, BLOCK_N, R)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, KB)
        tl.store(out + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w,
                 mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])

    @triton.jit
    def _wna16_gemm_kernel(x, qweight, scales, zeros, bias, out, partial,
                           M, N, Np, K, stride_xm, stride_om, words_per_row, blocks_per_split, zf_const,
                           BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr,
                           HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                           EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
                           DOT_F32: tl.constexpr, IEEE: tl.constexpr):
        """out[m, n] (or partial[pid_k, m, n], float32) for one [BLOCK_N, BLOCK_M] tile of out^T,
        over the K blocks [pid_k * blocks_per_split, ... + blocks_per_split). zf_const: 2**23 plus
        the shared zero point (0 with per-group zeros)."""
        KB: tl.constexpr = 128  # codes per block (KBLOCK)
        CK: tl.constexpr = KB * BITS // 32  # words per block
        BG: tl.constexpr = BLOCK_N // R  # row groups per tile
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        offs_g = (pid_n * BG + tl.arange(0, BG)) % (Np // R)  # [BG] row groups always in bounds: stores mask
        rm = offs_m % M
        offs_j = tl.arange(0, CK)  # position in a chunk = word of a block
        offs_r = tl.arange(0, R)  # row in a group
        offs_k = tl.arange(0, KB)
        rows = (offs_g * R)[:, None, None, None] + offs_r[None, None, :, None]  # [BG, 1, R, 1]
        block_start = pid_k * blocks_per_split
        block_end = tl.minimum(block_start + blocks_per_split, tl.cdiv(K, KB))
        w_ptrs = (qweight + offs_g[:, None, None].to(tl.int64) * words_per_row * R
                  + (block_start * CK + offs_j)[None, :, None] * R + offs_r[None, None, :])  # [BG, CK, R]
        x_ptrs = x + rm[None, :].to(tl.int64) * stride_xm + block_start * KB + offs_k[:, None]  # [KB, BM]
        s, zf = _group_params(scales, zeros, 0, rows, Np, zf_const, HAS_ZEROS)  # channel groups; else unused
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for b in range(block_start, block_end):
            k0 = b * KB
            w = _block_tile(w_ptrs, scales, zeros, rows, k0, s, zf, Np, zf_const, x, BITS, GROUP_SIZE, GROUP_MODE,
                            HAS_ZEROS, BLOCK_N, R)  # [BN, KB] in x's dtype
            if EVEN_K:
                xt = tl.load(x_ptrs)  # [KB, BM]
            else:
                xt = tl.load(x_ptrs, mask=(k0 + offs_k < K)[:, None], other=0.0)
            if DOT_F32:  # the interpreter's bfloat16 dot is broken: the same products in float32
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
            w_ptrs += CK * R
            x_ptrs += KB
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        store_transposed_tile(acc, out, partial, bias, offs_n, offs_m, N, M, stride_om, pid_k, SPLIT, HAS_BIAS)

    @triton.jit
    def _gemv_step(acc, xsum, words, x_row, scales, zeros, rows, k0, cols0, offs_b, K, Np, zf_const,
                   BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   EVEN_K: tl.constexpr):
        """acc [BG, NB, CK, R] and xsum [NB, CK] after the words [BG, NB, CK, R] of the step at
        column k0 (cols0 [NB, CK]: the columns of field 0 within the step). Channel groups:
        acc += x * f and xsum += x, the zero point and scale are applied once at the end; other
        groups apply 2**bits s (per word, or per field for groups within a block) and subtract
        s (2**bits + zero) times the sum of x at once."""
        KB: tl.constexpr = 128
        PACK: tl.constexpr = 32 // BITS
        CK: tl.constexpr = KB // PACK
        ONE: tl.constexpr = 1 << BITS
        HI: tl.constexpr = 23 - BITS  # the code's lowest bit in f
        FIELD: tl.constexpr = ((1 << BITS) - 1) << HI
        if GROUP_MODE == 1:  # each block inside one group: one scale per block and row, [BG, NB, 1, R]
            grp = ((k0 + offs_b * KB) // GROUP_SIZE)[None, :, None, None]
            s, zf = _group_params(scales, zeros, grp, rows, Np, zf_const, HAS_ZEROS)
            part = tl.zeros_like(acc)
            xs = tl.zeros_like(xsum)
        for i in tl.static_range(PACK):
            cols = k0 + cols0 + i * CK  # [NB, CK]
            if EVEN_K:
                xv = tl.load(x_row + cols).to(tl.float32)
            else:
                xv = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            if HI >= i * BITS:
                moved = words << (HI - i * BITS)
            else:
                moved = words >> (i * BITS - HI)
            f = ((moved & FIELD) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + code / 2**bits, exact
            x4 = xv[None, :, :, None]
            if GROUP_MODE == 0:
                acc += x4 * f
                xsum += xv
            elif GROUP_MODE == 1:
                part += x4 * f
                xs += xv
            else:  # groups within a block: per field ([BG, NB, 1, R]) or per code ([BG, NB, CK, R])
                if GROUP_MODE == 2:
                    grp = ((k0 + offs_b * KB + i * CK) // GROUP_SIZE)[None, :, None, None]
                else:
                    grp = (cols // GROUP_SIZE)[None, :, :, None]
                s, zf = _group_params(scales, zeros, grp, rows, Np, zf_const, HAS_ZEROS)
                acc += (x4 * f) * (s * ONE) - x4 * (s * zf)
        if GROUP_MODE == 1:
            acc += part * (s * ONE) - xs[None, :, :, None] * (s * zf)
        return acc, xsum

    @triton.jit
    def _wna16_gemv_kernel(x, qweight, scales, zeros, bias, out, N, Np, K, stride_xm, stride_om, words_per_row,
                           n_steps, zf_const, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr,
                           HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, R: tl.constexpr, BG: tl.constexpr,
                           NB: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
        """out[m, n] for BG groups of R interleaved weight rows and one row m of x (program
        (row groups, m)), over the whole of K in n_steps steps of NB blocks: each thread holds
        one word of R rows at a time and multiplies each x value it loads into all R of them.
        zf_const: 2**bits plus the shared zero point (2**bits with per-group zeros). With PDL the
        first words are loaded before waiting for the kernel that wrote x."""
        KB: tl.constexpr = 128
        PACK: tl.constexpr = 32 // BITS
        CK: tl.constexpr = KB // PACK
        ONE: tl.constexpr = 1 << BITS
        STEP: tl.constexpr = NB * CK * R  # words per step
        pid = tl.program_id(0)
        row = tl.program_id(1)
        offs_g = pid * BG + tl.arange(0, BG)  # [BG]
        offs_b = tl.arange(0, NB)
        offs_j = tl.arange(0, CK)
        offs_r = tl.arange(0, R)
        g4 = (offs_g % (Np // R))[:, None, None, None]  # [BG, 1, 1, 1]: always in bounds, the stores mask
        rows = g4 * R + offs_r[None, None, None, :]  # [BG, 1, 1, R] weight rows
        w_ptrs = qweight + g4.to(tl.int64) * words_per_row * R + (
            (offs_b[None, :, None, None] * CK + offs_j[None, None, :, None]) * R + offs_r[None, None, None, :])
        cols0 = offs_b[:, None] * KB + offs_j[None, :]  # [NB, CK]: column of field 0 of each word
        x_row = x + row * stride_xm
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        words = tl.load(w_ptrs)  # int32 [BG, NB, CK, R]
        if GROUP_MODE == 0:
            s, zf = _group_params(scales, zeros, 0, rows, Np, zf_const, HAS_ZEROS)  # [BG, 1, 1, R]
        if PDL:  # the weight never depends on an earlier kernel; x does
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros([BG, NB, CK, R], dtype=tl.float32)
        xsum = tl.zeros([NB, CK], dtype=tl.float32)
        for step in range(n_steps):
            # the next step's words (the last step reloads its own: a cache hit, no branch)
            next_ptrs = w_ptrs + tl.minimum(step + 1, n_steps - 1) * STEP
            if PREFETCH:
                nxt = tl.load(next_ptrs)
            acc, xsum = _gemv_step(acc, xsum, words, x_row, scales, zeros, rows, step * NB * KB, cols0, offs_b, K,
                                   Np, zf_const, BITS, GROUP_SIZE, GROUP_MODE, HAS_ZEROS, EVEN_K)
            if PREFETCH:
                words = nxt
            else:
                words = tl.load(next_ptrs)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BG, R]
        if GROUP_MODE == 0:  # s (2**bits sum x f - zf sum x), per row
            total = tl.sum(tl.sum(xsum, axis=1), axis=0)
            y = tl.sum(tl.sum(s, axis=2), axis=1) * (y * ONE - tl.sum(tl.sum(zf, axis=2), axis=1) * total)
        n2 = offs_g[:, None] * R + offs_r[None, :]  # [BG, R]
        if HAS_BIAS:
            y += tl.load(bias + n2, mask=n2 < N, other=0.0).to(tl.float32)
        tl.store(out + row * stride_om + n2, y.to(out.dtype.element_ty), mask=n2 < N)


_TRITON_DTYPES = (torch.float16, torch.bfloat16)


class TritonW4A16Linear(TritonKernel):
    """Dequantizes in registers inside one tiled GEMM (tl.dot in x's dtype, float32 accumulation);
    decode batches split K across programs and add the partial sums in a second, ordered pass;
    single rows take the GEMV."""

    family = "w4a16_linear"

    @classmethod
    def cannot_implement_reason(cls, *, in_features: int = 1, out_features: int = 1, bits: int = 4,
                                group_size: int = 128, dtype: torch.dtype = torch.float16, **_: Any) -> str | None:
        if bits not in BITS:
            return f"bits={bits} (supported: {BITS})"
        allowed = _TRITON_DTYPES + ((torch.float32,) if INTERPRETED else ())
        if dtype not in allowed:
            return f"activations in {dtype} (supported: {', '.join(map(str, allowed))})"
        if in_features <= 0 or out_features <= 0:
            return f"empty weight [{out_features}, {in_features}]"
        return None

    @staticmethod
    def prepare(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                group_size: int, layout: str | None = None) -> WNA16Weights:
        """layout: "triton-mma" (`w4_mma`: 4-bit codes in groups of 32, 64, a multiple of 128 or
        one per row) or "triton" (the interleaved layout, any weight); None: triton-mma where it
        takes the weight."""
        gs = _check_canonical(codes, scales, zeros, bits, group_size)
        n, k = codes.shape
        mma = w4_mma.supports(bits, gs, k)
        if layout == "triton-mma" and not mma:
            raise ValueError(f"the triton-mma layout takes 4-bit codes in groups of 32, 64 or a multiple of "
                             f"{KBLOCK} columns (or one group per row), not {bits}-bit groups of {group_size}")
        if layout not in (None, "triton", "triton-mma"):
            raise ValueError(f"layout={layout!r} (the Triton kernel's: 'triton-mma', 'triton')")
        if mma and layout != "triton":
            return TritonW4A16Linear._prepare_mma(codes, scales, zeros, gs)
        pack = 32 // bits
        ck = KBLOCK // pack
        kp = -(-k // KBLOCK) * KBLOCK
        np_ = -(-n // ROWS) * ROWS
        padded = F.pad(codes, (0, kp - k, 0, np_ - n))  # [Np, Kp]
        blocks = padded.view(np_, kp // KBLOCK, pack, ck).transpose(2, 3)  # [Np, blocks, j, i]: word j's codes by chunk
        if bits == 4:
            blocks = blocks[..., 0::2] | (blocks[..., 1::2] << 4)  # [Np, blocks, CK, 4] bytes, chunk 2b low
        words = blocks.contiguous().view(torch.int32).view(np_ // ROWS, ROWS, kp // pack)  # [Np / 8, 8, Kp / PACK]
        qweight = words.transpose(1, 2).contiguous()  # [Np / 8, Kp / PACK, 8]: a word of eight rows side by side
        zp = _uniform_zero(zeros)
        groups = 1 if gs >= k else -(-kp // gs)  # pad with empty groups (scale 0) so every block of Kp has its groups
        scales_t = F.pad(scales, (0, groups - scales.shape[1], 0, np_ - n)).t().contiguous()  # [Gp, Np]
        zeros_t = F.pad(zeros, (0, groups - zeros.shape[1], 0, np_ - n)).t().contiguous()
        return WNA16Weights(qweight, scales_t, None if zp is not None else zeros_t, bits, gs, k, n,
                            zero_point=zp or 0, layout="triton")

    @staticmethod
    def _prepare_mma(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, gs: int) -> WNA16Weights:
        """The layout of `w4_mma` (4-bit codes, groups aligned with its 32-column dots)."""
        n, k = codes.shape
        qweight = w4_mma.pack(codes)  # int16 [Kp / 128, Np, 32]
        blocks, np_, _ = qweight.shape
        zp = _uniform_zero(zeros)
        groups = 1 if gs >= k else -(-blocks * KBLOCK // gs)  # empty groups (scale 0) pad K to Kp
        scales_t = F.pad(scales, (0, groups - scales.shape[1], 0, np_ - n)).t().contiguous()  # [Gp, Np]
        zeros_t = None if zp is not None else F.pad(zeros, (0, groups - zeros.shape[1], 0, np_ - n)).t().contiguous()
        return WNA16Weights(qweight, scales_t, zeros_t, 4, gs, k, n, zero_point=zp or 0, layout="triton-mma")

    @staticmethod
    def dequantize(weights: WNA16Weights) -> torch.Tensor:
        """float32 [N, K], equal to dequantize_reference of the canonical inputs."""
        _check_layout(weights, "triton", "triton-mma")
        bits, n, k = weights.bits, weights.out_features, weights.in_features
        groups = weights.num_groups
        if weights.layout == "triton-mma":
            codes = w4_mma.unpack(weights.qweight, n, k)
            zeros = weights.zero_point if weights.zeros is None else weights.zeros.t()[:n, :groups]
            return _dequantize(codes, weights.scales.t()[:n, :groups], zeros, weights.group_size)
        pack = 32 // bits
        rows = weights.qweight.transpose(1, 2).reshape(-1, weights.qweight.shape[1])[:n]  # [N, Kp / PACK]
        words = rows.view(n, -1, KBLOCK // pack, 1)  # [N, blocks, j, 1]
        shifts = torch.arange(pack, device=words.device, dtype=torch.int32) * bits  # [i]
        codes = (words >> shifts) & ((1 << bits) - 1)  # [N, blocks, j, i]
        codes = codes.transpose(2, 3).reshape(n, -1)[:, :k]  # [N, K] in column order
        scales = weights.scales.t()[:n, :groups]  # [N, G]
        zeros = weights.zero_point if weights.zeros is None else weights.zeros.t()[:n, :groups]
        return _dequantize(codes, scales, zeros, weights.group_size)

    @staticmethod
    def dequantize_to(weights: WNA16Weights, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in dtype: the weight as the GEMM multiplies it (float32 (code - zero) * scale,
        rounded once to dtype), written by one kernel."""
        _check_layout(weights, "triton", "triton-mma")
        n, k, bits = weights.out_features, weights.in_features, weights.bits
        if weights.layout == "triton-mma":
            return w4_mma.dequantize_to(weights.qweight, weights.scales, weights.zeros, weights.zero_point,
                                        weights.group_size, n, k, dtype)
        out = torch.empty(n, k, dtype=dtype, device=weights.qweight.device)
        np_, words_per_row = weights.scales.shape[1], weights.qweight.shape[1]
        block_n = 64
        _wna16_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, KBLOCK))](
            weights.qweight, weights.scales, weights.zeros if weights.zeros is not None else weights.scales, out,
            n, np_, k, words_per_row, float(2**23 + (weights.zero_point if weights.zeros is None else 0)),
            BITS=bits, GROUP_SIZE=weights.group_size,
            GROUP_MODE=_group_mode(weights.group_size, k, KBLOCK * bits // 32),
            HAS_ZEROS=weights.zeros is not None, BLOCK_N=block_n, R=ROWS, num_warps=4)
        return out

    @staticmethod
    def forward(x: torch.Tensor, weights: WNA16Weights, bias: torch.Tensor | None = None,
                tiles: TileConfig | GemvTiles | w4_mma.MmaTiles | None = None) -> torch.Tensor:
        """x [..., K] (float16 / bfloat16; float32 in the interpreter) -> [..., N] in x's dtype:
        the GEMV for at most GEMV_MAX_M rows, the tiled GEMM up to DEQUANTIZE_MIN_M rows, and from
        there the weight dequantized to x's dtype once (`dequantize_to`) and cuBLAS. tiles: a
        TileConfig (the GEMM) or GemvTiles (the GEMV) instead of these choices (tests, tuning).
        Weights in the triton-mma layout: `w4_mma.matmul` up to its MAX_M rows (MmaTiles), then
        the weight dequantized and cuBLAS."""
        _check_layout(weights, "triton", "triton-mma")
        k, n = weights.in_features, weights.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        if tiles is not None and isinstance(tiles, w4_mma.MmaTiles) != (weights.layout == "triton-mma"):
            raise ValueError(f"{type(tiles).__name__} are not tiles of the {weights.layout} layout's kernel")
        if weights.layout == "triton-mma":
            if m > w4_mma.MAX_M and tiles is None:
                return F.linear(x2, w4_mma.dequantize_to(weights.qweight, weights.scales, weights.zeros,
                                                         weights.zero_point, weights.group_size, n, k, x.dtype),
                                bias).view(*lead, n)
            return w4_mma.matmul(x2, weights.qweight, weights.scales, weights.zeros, weights.zero_point,
                                 weights.group_size, n, bias, tiles).view(*lead, n)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return out.view(*lead, n)
        has_bias = bias is not None
        bias_arg = bias if has_bias else out
        bits = weights.bits
        chunk = KBLOCK * bits // 32
        zeros = weights.zeros if weights.zeros is not None else weights.scales  # unused when None
        mode = _group_mode(weights.group_size, k, chunk)
        np_, words_per_row = weights.scales.shape[1], weights.qweight.shape[1]
        shared_zero = weights.zero_point if weights.zeros is None else 0
        if (tiles is None and m <= GEMV_MAX_M) or isinstance(tiles, GemvTiles):
            cfg = tiles or gemv_tiles(n, k, bits)
            num_blocks = words_per_row * 32 // bits // KBLOCK
            nb = cfg.blocks(num_blocks)
            _wna16_gemv_kernel[(triton.cdiv(np_ // ROWS, cfg.row_groups), m)](
                x2, weights.qweight, weights.scales, zeros, bias_arg, out, n, np_, k, x2.stride(0), out.stride(0),
                words_per_row, num_blocks // nb, float((1 << bits) + shared_zero),
                BITS=bits, GROUP_SIZE=weights.group_size, GROUP_MODE=mode, HAS_ZEROS=weights.zeros is not None,
                HAS_BIAS=has_bias, R=ROWS, BG=cfg.row_groups, NB=nb, EVEN_K=k % KBLOCK == 0,
                PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, **pdl_launch(x.device))
            return out.view(*lead, n)
        if tiles is None and m >= DEQUANTIZE_MIN_M:
            w = TritonW4A16Linear.dequantize_to(weights, x.dtype)
            return F.linear(x2, w, bias).view(*lead, n)
        cfg = tiles or tile_config(m, n, k, x.device)
        if cfg.block_n % ROWS:
            raise ValueError(f"block_n={cfg.block_n} must be a multiple of the {ROWS} interleaved rows")
        blocks = triton.cdiv(k, KBLOCK)
        per_split = triton.cdiv(blocks, cfg.split_k)
        split = triton.cdiv(blocks, per_split)  # no empty slices
        partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
        # Gathered scales are a whole tile per stage: two stages keep 128 x 128 tiles in shared memory.
        stages = min(cfg.num_stages, 2) if mode == _GATHER else cfg.num_stages
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        _wna16_gemm_kernel[grid](
            x2, weights.qweight, weights.scales, zeros, bias_arg, out, partial,
            m, n, np_, k, x2.stride(0), out.stride(0), words_per_row, per_split, float(2**23 + shared_zero),
            BITS=bits, GROUP_SIZE=weights.group_size, GROUP_MODE=mode,
            HAS_ZEROS=weights.zeros is not None, HAS_BIAS=has_bias, SPLIT=split > 1, EVEN_K=k % KBLOCK == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, R=ROWS,
            DOT_F32=INTERPRETED and x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=stages)
        if split > 1:
            reduce_split_k(partial, out, bias)
        return out.view(*lead, n)
