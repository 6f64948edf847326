"""4-bit weight-only GEMM for decode batches on tensor cores: the codes become 16-bit floats with
two integer instructions per pair and enter `tl.dot` from registers.

Layout ("triton-mma" in `w4a16.WNA16Weights`): K is padded to Kp, a multiple of 128 (zero codes,
never read against a nonzero x), N to Np, a multiple of ROW_PAD, and every 128-code block of a row
is 32 16-bit elements; element e holds the codes of columns 32 j + e (j = 0..3) of the block in its
nibble j:

    qweight  int16 [Kp / 128, Np, 32]   qweight[b, n, e] = sum_j codes[n, 128 b + 32 j + e] << 4 j
    scales   [Gp, Np] (the checkpoint's float dtype; channel strategy: [1, Np]; padded rows 0)
    zeros    uint8 [Gp, Np], or None when every zero point is the same (`zero_point`)

A block's tile of BLOCK_N rows is one contiguous run of BLOCK_N x 64 bytes. Nibble j of every
element of a [BLOCK_N, 32] tile is the weight tile of columns 32 j .. 32 j + 31, so each of the
four is one `tl.dot` against a [32, BLOCK_M] slice of x as it lies in memory. The conversion is
elementwise on 16-bit lanes, f_j(h) = ((h >> 4 j) & 15) - 8 as a bf16 / fp16 value, done on two
lanes at once on the GPU (`tl.inline_asm_elementwise`, pack=2): one shift (none for j = 0), one
`lop3` that masks the nibbles and ORs in the exponent of 128 (bf16: 0x4300, 128 + code; fp16:
0x6400, 1024 + code; exact), and one packed FMA that subtracts 136 (1032): code - 8, exact. Being
unary and pure, the conversion lets Triton hand the loaded tile to the MMA in registers (Hopper:
wgmma with A from registers), no shared-memory round trip of the converted weight.

The weight rows are the dot's tall side (out^T = W x^T), so a batch of one token pads x to 16
columns but fills the MMA's M with weight rows. The scale and zero point apply per group to the
float32 dot: out[m, n] += s[g, n] (P[n, m] - (z[g, n] - 8) X[g, m]), P the group's dot over
code - 8 and X the group's sum of x (skipped when every zero point is 8, the symmetric formats).
Groups of 32, 64 or multiples of 128 columns (and the channel strategy) align with the dots;
other group sizes are not this kernel's. K may be split over programs (float32 partial sums
added in order by `reduce_split_k`, deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baryon.kernels.quant.split_k import reduce_split_k, store_transposed_tile
from baryon.kernels.triton_utils import INTERPRETED, multiprocessor_count, pdl_launch, tl, triton, wait_and_release

KBLOCK = 128  # codes per block of a row
ROW_PAD = 64  # N is padded to a multiple of this (the smallest BLOCK_N)
CENTER = 8  # the kernel multiplies code - CENTER


def supports(bits: int, group_size: int, in_features: int) -> bool:
    """Whether this layout takes the weight: 4-bit codes in groups that align with the 32-column
    dots (32, 64, a multiple of 128, or one group per row)."""
    if bits != 4:
        return False
    if group_size <= 0 or group_size >= in_features:
        return True
    return group_size in (32, 64) or group_size % KBLOCK == 0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> int16 [Kp / 128, Np, 32] (see the module docstring)."""
    n, k = codes.shape
    kp = -(-k // KBLOCK) * KBLOCK
    np_ = -(-n // ROW_PAD) * ROW_PAD
    padded = F.pad(codes, (0, kp - k, 0, np_ - n)).to(torch.int32)  # [Np, Kp]
    nibbles = padded.view(np_, kp // KBLOCK, 4, 32)  # [Np, blocks, j, e]
    shifts = (torch.arange(4, device=codes.device, dtype=torch.int32) * 4).view(1, 1, 4, 1)
    halves = (nibbles << shifts).sum(dim=2)  # [Np, blocks, 32]: 0 .. 65535
    halves = torch.where(halves >= 1 << 15, halves - (1 << 16), halves).to(torch.int16)
    return halves.transpose(0, 1).contiguous()  # [blocks, Np, 32]


def unpack(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack`: uint8 codes [n, k]."""
    blocks, np_, _ = qweight.shape
    halves = qweight.to(torch.int32) & 0xFFFF  # [blocks, Np, 32]
    shifts = (torch.arange(4, device=qweight.device, dtype=torch.int32) * 4).view(1, 1, 4, 1)
    nibbles = (halves.unsqueeze(2) >> shifts) & 15  # [blocks, Np, j, e]
    return nibbles.permute(1, 0, 2, 3).reshape(np_, blocks * KBLOCK)[:n, :k].to(torch.uint8)


@dataclass(frozen=True)
class MmaTiles:
    """One launch: [block_n, block_m] output tiles, K split over split_k programs per tile."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


MAX_M = 128  # larger batches: the weight dequantized once, then cuBLAS
SPLIT_K_MAX = 16
SPLIT_K_MIN_BLOCKS = 4  # K blocks per split at least
# (largest M, smallest N, block_n, num_warps, num_stages, programs resident per SM): first match
# wins. On an H100 (Qwen3-8B's projections, `python benchmarks/tune_quant_gemv.py --kernels w4-mma
# --m 1 16 64`, 2026-11-26) a token tile of 16 streams best with 64-row tiles and four warps, except
# the widest layer at one token (gate/up: 128-row tiles, eight warps, K in two: 21.9 against 23.7
# us); larger batches take 128-row tiles and eight warps (one token tile of 32 or 64 each). The
# residency gives the split that the sweep found best on 14 of the 16 (layer, batch) pairs.
TILE_TABLE: tuple[tuple[int | None, int, int, int, int, int], ...] = (
    (1, 16384, 128, 8, 3, 4),
    (16, 0, 64, 4, 3, 4),
    (None, 0, 128, 8, 3, 2),
)


def tiles_for(m: int, n: int, k: int, device: torch.device, num_sms: int | None = None) -> MmaTiles:
    """TILE_TABLE by m (128-row tiles only where they divide the padded rows); block_m: the batch
    rounded up to 16, 32 or 64; K split in two while twice the programs fit the row's residency
    and each split keeps SPLIT_K_MIN_BLOCKS blocks."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    for max_m, min_n, block_n, num_warps, num_stages, resident in TILE_TABLE:
        if (max_m is None or m <= max_m) and n >= min_n:
            break
    if -(-n // ROW_PAD) * ROW_PAD % block_n:
        block_n, num_warps, resident = ROW_PAD, 4, 4
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    blocks = triton.cdiv(k, KBLOCK)
    slots = resident * (num_sms or multiprocessor_count(device, off_gpu=4))
    split = 1
    while split < SPLIT_K_MAX and tiles * split * 2 <= slots and blocks // (2 * split) >= SPLIT_K_MIN_BLOCKS:
        split *= 2
    return MmaTiles(block_m, block_n, split, num_warps, num_stages)


# Per 16-bit lane h (two at a time): ((h >> shift) & 15) | exponent, then fma(v, 1, -(magic + 8)):
# bf16 0x4300 = 128 (+ code, exact), 0x3F80 = 1.0, 0xC308 = -136; fp16 0x6400 = 1024, 0x3C00 = 1.0,
# 0xE408 = -1032.
_ASM = """{{
.reg .b32 t, one, neg;
mov.b32 one, {one};
mov.b32 neg, {neg};
shr.b32 t, $1, {shift};
lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;
fma.rn.{kind} $0, t, one, neg;
}}"""
_MAGIC = {"bf16x2": ("0x43004300", "0x3F803F80", "0xC308C308"), "f16x2": ("0x64006400", "0x3C003C00", "0xE408E408")}


def _asm(j: int, kind: str) -> str:
    magic, one, neg = _MAGIC[kind]
    return _ASM.format(one=one, neg=neg, shift=4 * j, magic=magic, kind=kind)



if triton is not None:
    # The kernels may read globals only as constexprs: one per nibble and dtype.
    _ASM_BF16_0, _ASM_BF16_1, _ASM_BF16_2, _ASM_BF16_3 = (tl.constexpr(_asm(j, "bf16x2")) for j in range(4))
    _ASM_F16_0, _ASM_F16_1, _ASM_F16_2, _ASM_F16_3 = (tl.constexpr(_asm(j, "f16x2")) for j in range(4))

    @triton.jit
    def _nibble(h, J: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
        """[BN, 32] int16 -> [BN, 32] DTYPE: nibble J of each element minus CENTER, exact."""
        if ASM:
            if DTYPE == tl.bfloat16:
                if J == 0:
                    return tl.inline_asm_elementwise(_ASM_BF16_0, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)
                elif J == 1:
                    return tl.inline_asm_elementwise(_ASM_BF16_1, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)
                elif J == 2:
                    return tl.inline_asm_elementwise(_ASM_BF16_2, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)
                else:
                    return tl.inline_asm_elementwise(_ASM_BF16_3, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)
            else:
                if J == 0:
                    return tl.inline_asm_elementwise(_ASM_F16_0, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
                elif J == 1:
                    return tl.inline_asm_elementwise(_ASM_F16_1, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
                elif J == 2:
                    return tl.inline_asm_elementwise(_ASM_F16_2, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
                else:
                    return tl.inline_asm_elementwise(_ASM_F16_3, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
        else:
            code = (h.to(tl.int32) >> (4 * J)) & 15
            return (code - 8).to(tl.float32).to(DTYPE)  # (the interpreter turns int32 into bfloat16 wrongly)

    @triton.jit
    def _w4_mma_kernel(x, qweight, scales, zeros, bias, out, partial, M, N, Np, K, stride_xm, stride_om,
                       blocks_per_split, zero_shift, GROUP_SIZE: tl.constexpr, CHANNEL: tl.constexpr,
                       ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
                       DOT_F32: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        """out^T tile [BLOCK_N, BLOCK_M] of program (row tile, token tile, K slice) over the K
        blocks of its slice. ZEROS: 0 every zero point is CENTER (no correction), 1 one shared
        zero point (zero_shift = it - CENTER), 2 per-group zeros."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        wait_and_release(PDL)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows (< Np: the grid covers Np)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens
        offs_e = tl.arange(0, 32)
        w_ptrs = qweight + offs_n[:, None] * 32 + offs_e[None, :]  # [BN, 32] of block 0
        x_ptrs = x + offs_m[None, :].to(tl.int64) * stride_xm + offs_e[:, None]  # [32, BM] of columns 0..31
        m_ok = (offs_m < M)[None, :]
        DPG: tl.constexpr = 4 if CHANNEL or GROUP_SIZE >= 128 else GROUP_SIZE // 32  # dots per group
        first = pid_k * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(K, 128))
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        xtotal = tl.zeros([BLOCK_M], dtype=tl.float32)
        for blk in tl.range(first, last, num_stages=STAGES):
            h = tl.load(w_ptrs + blk * Np * 32)  # int16 [BN, 32] (int32 offsets: N x K / 4 elements)
            for j in tl.static_range(4):
                col0 = blk * 128 + j * 32
                if EVEN_K:
                    xj = tl.load(x_ptrs + col0, mask=m_ok, other=0.0)  # [32, BM]
                else:
                    xj = tl.load(x_ptrs + col0, mask=m_ok & ((col0 + offs_e) < K)[:, None], other=0.0)
                a = _nibble(h, j, x.dtype.element_ty, ASM)  # [BN, 32]
                if DOT_F32:  # the interpreter's bfloat16 dot is broken: the same products in float32
                    a = a.to(tl.float32)
                    xj = xj.to(tl.float32)
                if CHANNEL:
                    acc = tl.dot(a, xj, acc, input_precision="ieee" if IEEE or DOT_F32 else None)
                    if ZEROS != 0:
                        xtotal += tl.sum(xj.to(tl.float32), axis=0)
                else:
                    if j % DPG == 0:
                        part = tl.dot(a, xj, input_precision="ieee" if IEEE or DOT_F32 else None)
                        if ZEROS != 0:
                            xs = tl.sum(xj.to(tl.float32), axis=0)
                    else:
                        part = tl.dot(a, xj, part, input_precision="ieee" if IEEE or DOT_F32 else None)
                        if ZEROS != 0:
                            xs += tl.sum(xj.to(tl.float32), axis=0)
                    if j % DPG == DPG - 1:
                        g = col0 // GROUP_SIZE
                        s = tl.load(scales + g * Np + offs_n).to(tl.float32)[:, None]  # [BN, 1]
                        if ZEROS == 0:
                            acc += part * s
                        elif ZEROS == 1:
                            acc += (part - zero_shift * xs[None, :]) * s
                        else:
                            zs = tl.load(zeros + g * Np + offs_n).to(tl.float32)[:, None] - 8.0
                            acc += (part - zs * xs[None, :]) * s
        if CHANNEL:
            s = tl.load(scales + offs_n).to(tl.float32)[:, None]
            if ZEROS == 0:
                acc = acc * s
            elif ZEROS == 1:
                acc = (acc - zero_shift * xtotal[None, :]) * s
            else:
                zs = tl.load(zeros + offs_n).to(tl.float32)[:, None] - 8.0
                acc = (acc - zs * xtotal[None, :]) * s
        store_transposed_tile(acc, out, partial, bias, offs_n, offs_m, N, M, stride_om, pid_k, SPLIT, HAS_BIAS)

    @triton.jit
    def _w4_dequantize_kernel(qweight, scales, zeros, out, N, Np, K, zero_point, GROUP_SIZE: tl.constexpr,
                              HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
        """out [N, K] in its dtype: float32 (code - zero) * scale rounded once, for one
        [BLOCK_N, 128] tile of program (row tile, block)."""
        pid_n = tl.program_id(0)
        blk = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_e = tl.arange(0, 32)
        h = tl.load(qweight + blk.to(tl.int64) * Np * 32 + offs_n[:, None] * 32 + offs_e[None, :]).to(tl.int32)
        for j in tl.static_range(4):
            cols = blk * 128 + j * 32 + offs_e  # [32]
            g = tl.minimum(cols, K - 1) // GROUP_SIZE  # padded columns: the last group (stored masked)
            s = tl.load(scales + g[None, :] * Np + offs_n[:, None]).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(zeros + g[None, :] * Np + offs_n[:, None]).to(tl.float32)
            else:
                z = zero_point
            code = ((h >> (4 * j)) & 15).to(tl.float32)
            tl.store(out + offs_n[:, None].to(tl.int64) * K + cols[None, :], ((code - z) * s).to(out.dtype.element_ty),
                     mask=(offs_n < N)[:, None] & (cols < K)[None, :])



def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, zero_point: int,
           group_size: int, n: int, bias: torch.Tensor | None = None, tiles: MmaTiles | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; float16 / bfloat16, float32 in the interpreter), unit stride in K,
    times the packed weight (see the module docstring) -> [M, N] in x's dtype."""
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"{m} rows: the kernel takes at most {MAX_M}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    np_ = qweight.shape[1]
    cfg = tiles or tiles_for(m, n, k, x.device)
    blocks = triton.cdiv(k, KBLOCK)
    per_split = triton.cdiv(blocks, cfg.split_k)
    split = triton.cdiv(blocks, per_split)  # no empty slices
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    mode = 2 if zeros is not None else 0 if zero_point == CENTER else 1
    if np_ % cfg.block_n:
        raise ValueError(f"block_n={cfg.block_n} does not divide the padded rows ({np_})")
    grid = (np_ // cfg.block_n, triton.cdiv(m, cfg.block_m), split)
    _w4_mma_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else out, out, partial,
        m, n, np_, k, x.stride(0), out.stride(0), per_split, float(zero_point - CENTER),
        GROUP_SIZE=min(group_size, k), CHANNEL=group_size >= k, ZEROS=mode, HAS_BIAS=bias is not None,
        SPLIT=split > 1, EVEN_K=k % KBLOCK == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
        ASM=not INTERPRETED, DOT_F32=INTERPRETED and x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, **pdl_launch(x.device))
    if split > 1:
        reduce_split_k(partial, out, bias)
    return out


def dequantize_to(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, zero_point: int,
                  group_size: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in dtype: float32 (code - zero) * scale rounded once, written by one kernel."""
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    np_ = qweight.shape[1]
    block_n = 64
    _w4_dequantize_kernel[(np_ // block_n, qweight.shape[0])](
        qweight, scales, zeros if zeros is not None else scales, out, n, np_, k, float(zero_point),
        GROUP_SIZE=min(group_size, k), HAS_ZEROS=zeros is not None, BLOCK_N=block_n,
        num_warps=4)
    return out
