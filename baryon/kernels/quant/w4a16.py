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
it; both layouts keep the codes packed, `bits` bits per weight.

Torch layout (`TorchW4A16Linear`, the reference; family `w4a16_linear`, name "torch"):

    qweight  uint8 [N, ceil(K * bits / 8)]  bits 4: byte b holds k = 2b (low nibble) and 2b + 1
                                            (high nibble); bits 8: the codes as they are
    scales   [N, G]  the given dtype
    zeros    uint8 [N, G], or None when every zero point is the same (`zero_point` holds it)

Triton layout (`TritonW4A16Linear`, name "triton"): K is padded with zero codes to Kp, a multiple of
KBLOCK = 128, and each row is cut into blocks of 128 codes. A block is PACK = 32 / bits chunks of
CK = 128 / PACK consecutive codes (bits 4: 8 chunks of 16; bits 8: 4 chunks of 32), stored as CK
int32 words: word j of a block holds code (chunk i, position j) in bits [i * bits, (i + 1) * bits).

    qweight  int32 [N, Kp / PACK]   one 128-code block = CK words (64 bytes for bits 4, 128 for 8)
    scales   [Gp, N] the given dtype, Gp = ceil(Kp / group_size) (padded groups: scale 0);
             channel strategy: [1, N]
    zeros    uint8 [Gp, N], or None when every zero point is the same (`zero_point`)

The kernel loads a [BLOCK_N, CK]-word tile per block (16-byte vectors along K), unpacks it as
[BLOCK_N, CK, PACK] with one constant shift per field (the chunk) and one mask, dequantizes, and
permutes (chunk, position) back to column order: a [BLOCK_N, 128] tile for one dot over the
block, against the block's 128 columns of x as they lie in memory. Scales and zeros are N-major,
so a row tile's scales are one contiguous load; groups of a whole block (group_size a multiple of
128) or of whole chunks need one load per block or per chunk, any other group size one per code.

The Triton kernel computes the transposed product out^T[n, m] = sum_k W[n, k] x[m, k], so the
dequantized weight tile is the left operand of `tl.dot` (it stays in registers; the activation
tile is the one staged through shared memory) and a decode step of a single token still fills the
MMA's tall side with weight rows (on sm_90 a warpgroup MMA, 64 weight rows per warpgroup). Codes
become float32 through the exponent trick (bitcast(code | 0x4B000000) = 2**23 + code, exact),
then (code - zero) * scale in float32 (the same bits as the reference), then x's dtype for the
dot, which accumulates in float32. The tile sizes come from `tile_config` (a small table by M);
decode batches (M <= 128) split K over several programs when the row tiles alone cannot fill the
GPU, writing float32 partial sums that a second kernel adds in a fixed order (deterministic)
together with the bias.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import INTERPRETED, TritonKernel, next_power_of_2, pdl_launch, tl, triton

BITS = (4, 8)
KBLOCK = 128  # codes per packed block of the Triton layout (and the kernel's K step)
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

    qweight: torch.Tensor  # packed codes: uint8 [N, ceil(K * bits / 8)] (torch) or int32 [N, Kp / PACK] (triton)
    scales: torch.Tensor  # [N, G] (torch) or [Gp, N] (triton), the checkpoint's float dtype
    zeros: torch.Tensor | None  # uint8, shaped like scales; None: every zero point is `zero_point`
    bits: int
    group_size: int  # effective: in_features for the channel strategy
    in_features: int  # K
    out_features: int  # N
    zero_point: int = 0  # the shared zero point when zeros is None
    layout: str = "torch"  # the kernel that prepared it: "torch" or "triton"

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)


def _check_layout(weights: WNA16Weights, layout: str) -> None:
    if weights.layout != layout:
        raise ValueError(f"weights prepared for the {weights.layout} kernel, not {layout}")


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
SPLIT_K_MAX = 16
SPLIT_K_MIN_BLOCKS = 4  # K blocks per split at least (a longer slice streams better)
RESIDENT = 3  # decode programs resident per SM (4 warps, ~100-200 registers, <= 100 KB shared)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keeps splits rare on test shapes


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
        slots = RESIDENT * (num_sms or _num_sms(device))
        while (split < SPLIT_K_MAX and tiles * split * 2 <= slots
               and blocks // (2 * split) >= SPLIT_K_MIN_BLOCKS):
            split *= 2
    return TileConfig(block_m, block_n, split, num_warps, num_stages)


@dataclass(frozen=True)
class GemvTiles:
    """One launch of the GEMV (decode batches of at most GEMV_MAX_M rows): block_n weight rows per
    program over the whole of K, blocks_per_step 128-code blocks of each row per loop step."""

    block_n: int
    blocks_per_step: int
    num_warps: int = 4

    def block_w(self, bits: int) -> int:
        """int32 words per row per step."""
        return self.blocks_per_step * KBLOCK * bits // 32


# Batches of at most GEMV_MAX_M rows take the GEMV. On an H100 (benchmarks/tune_quant_gemv.py,
# Qwen3-8B's projections) it beats the tiled GEMM by 10-25% at one row and loses to it at four.
# It streams 0.5-1.2 TB/s of 4-bit weight (16 rows x 512 codes per step, 8 warps; 2026-11-24),
# bound by the L1 traffic of x (Nsight Compute, gate/up with 8-row tiles: L1/TEX 86% busy, DRAM
# 32%): each thread holds one or two weight rows, so x is gathered about once per code.
GEMV_MAX_M = 1
# (largest M, bits, block_n, blocks_per_step, num_warps): first match wins; any M up to 4 runs.
GEMV_TABLE: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 4, 16, 4, 8),
    (4, 4, 8, 4, 8),
    (1, 8, 8, 2, 4),
    (4, 8, 4, 2, 4),
)


def gemv_tiles(m: int, bits: int) -> GemvTiles:
    return next(GemvTiles(*cfg[2:]) for cfg in GEMV_TABLE if m <= cfg[0] and bits == cfg[1])


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
    def _group_params(scales, zeros, g, offs_n, n_mask, N, zf_const, HAS_ZEROS: tl.constexpr):
        """float32 scale and 2**23 + zero of rows offs_n ([BLOCK_N, 1, 1]) in groups g (a scalar or
        a tensor of group indices that broadcasts against offs_n)."""
        idx = g * N + offs_n
        s = tl.load(scales + idx, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zf = tl.load(zeros + idx, mask=n_mask, other=0).to(tl.float32) + 8388608.0
        else:
            zf = tl.zeros_like(s) + zf_const
        return s, zf

    @triton.jit
    def _wna16_gemm_kernel(x, qweight, scales, zeros, bias, out, partial,
                           M, N, K, stride_xm, stride_om, words_per_row, blocks_per_split, zf_const,
                           BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr,
                           HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                           EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           DOT_F32: tl.constexpr, IEEE: tl.constexpr):
        """out[m, n] (or partial[pid_k, m, n], float32) for one [BLOCK_N, BLOCK_M] tile of out^T,
        over the K blocks [pid_k * blocks_per_split, ... + blocks_per_split)."""
        KB: tl.constexpr = 128  # codes per block (KBLOCK)
        PACK: tl.constexpr = 32 // BITS  # codes per word = chunks per block
        CK: tl.constexpr = KB // PACK  # codes per chunk = words per block
        MASK: tl.constexpr = (1 << BITS) - 1
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        rn = offs_n % N  # rows always in bounds: weight loads need no mask, stores do
        rm = offs_m % M
        offs_j = tl.arange(0, CK)  # position in a chunk = word of a block
        offs_i = tl.arange(0, PACK)  # chunk = field of a word
        offs_k = tl.arange(0, KB)
        n3 = offs_n[:, None, None]  # [BN, 1, 1]
        n3_mask = n3 < N
        block_start = pid_k * blocks_per_split
        block_end = tl.minimum(block_start + blocks_per_split, tl.cdiv(K, KB))
        w_ptrs = qweight + rn[:, None].to(tl.int64) * words_per_row + block_start * CK + offs_j[None, :]  # [BN, CK]
        x_ptrs = x + rm[None, :].to(tl.int64) * stride_xm + block_start * KB + offs_k[:, None]  # [KB, BM]
        shifts = (offs_i * BITS)[None, None, :]  # [1, 1, PACK]
        if GROUP_MODE == 0:
            s, zf = _group_params(scales, zeros, 0, n3, n3_mask, N, zf_const, HAS_ZEROS)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for b in range(block_start, block_end):
            k0 = b * KB
            words = tl.load(w_ptrs)  # int32 [BN, CK]
            codes = (words[:, :, None] >> shifts) & MASK  # [BN, CK, PACK]: [n, j, i] is column k0 + i * CK + j
            if GROUP_MODE == 1:  # the block is inside one group
                s, zf = _group_params(scales, zeros, k0 // GROUP_SIZE, n3, n3_mask, N, zf_const, HAS_ZEROS)
            elif GROUP_MODE == 2:  # each chunk is inside one group: [BN, 1, PACK]
                s, zf = _group_params(scales, zeros, ((k0 + offs_i * CK) // GROUP_SIZE)[None, None, :], n3,
                                      n3_mask, N, zf_const, HAS_ZEROS)
            elif GROUP_MODE == 3:  # any groups: [BN, CK, PACK]
                g = (k0 + offs_i[None, None, :] * CK + offs_j[None, :, None]) // GROUP_SIZE
                s, zf = _group_params(scales, zeros, g, n3, n3_mask, N, zf_const, HAS_ZEROS)
            w = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s  # exact (code - zero) * scale
            w = w.to(x.dtype.element_ty)
            w = tl.reshape(tl.permute(w, (0, 2, 1)), (BLOCK_N, KB))  # [BN, KB]: column k - k0
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
            w_ptrs += CK
            x_ptrs += KB
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        if SPLIT:
            base = partial + pid_k.to(tl.int64) * M * N
            tl.store(base + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
                     acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _wna16_gemv_kernel(x, qweight, scales, zeros, bias, out, M, N, K, stride_xm, stride_om, words_per_row,
                           zf_const, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_MODE: tl.constexpr,
                           HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
        """out[m, n] for BLOCK_N rows over the whole of K, without tl.dot: [BLOCK_N, BLOCK_W] word
        tiles (BLOCK_W a multiple of CK, so a tile holds whole 128-code blocks), unpacked field by
        field; field i of word (block b, position j) is column 128 b + i CK + j, so each field
        multiplies a [BLOCK_M, BLOCK_W] gather of x. Float32 partial sums [BM, BN, BW], reduced once.
        With PDL the programs start during the previous kernel's tail and wait for it before the
        loop (only x depends on it)."""
        KB: tl.constexpr = 128
        PACK: tl.constexpr = 32 // BITS
        CK: tl.constexpr = KB // PACK
        MASK: tl.constexpr = (1 << BITS) - 1
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_m = tl.arange(0, BLOCK_M)  # [BM]
        offs_w = tl.arange(0, BLOCK_W)  # [BW]
        n_mask = offs_n < N
        m_mask = offs_m < M
        n2 = offs_n[:, None]  # [BN, 1]
        n2_mask = n2 < N
        col0 = (offs_w // CK) * KB + offs_w % CK  # [BW]: column of field 0 of each word, from the tile's start
        col0 = tl.max_contiguous(tl.multiple_of(col0, CK), CK)  # runs of CK columns: vector loads of x
        w_ptrs = qweight + n2.to(tl.int64) * words_per_row + offs_w[None, :]  # [BN, BW]
        x_rows = x + offs_m[:, None] * stride_xm  # [BM, 1]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if GROUP_MODE == 0:
            s, zf = _group_params(scales, zeros, 0, n2, n2_mask, N, zf_const, HAS_ZEROS)  # [BN, 1]
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], dtype=tl.float32)
        for w0 in range(0, words_per_row, BLOCK_W):
            tile_mask = n2_mask & (w0 + offs_w < words_per_row)[None, :]  # [BN, BW]: the last step may overhang
            words = tl.load(w_ptrs, mask=tile_mask, other=0)  # int32 [BN, BW]
            k_tile = (w0 // CK) * KB  # first column of the tile
            if GROUP_MODE == 1:  # each 128-code block inside one group: [BN, BW]
                s, zf = _group_params(scales, zeros, ((k_tile + col0) // GROUP_SIZE)[None, :], n2, tile_mask, N,
                                      zf_const, HAS_ZEROS)
            # A word's fields share its group when groups hold whole blocks: sum x * (code - zero)
            # over the fields first, then one multiply by the scale per word, not per code.
            step = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], dtype=tl.float32)
            for i in tl.static_range(PACK):
                cols = k_tile + col0 + i * CK  # [BW]
                if GROUP_MODE >= 2:
                    s, zf = _group_params(scales, zeros, (cols // GROUP_SIZE)[None, :], n2, tile_mask, N,
                                          zf_const, HAS_ZEROS)
                codes = (words >> (i * BITS)) & MASK
                w = (codes | 0x4B000000).to(tl.float32, bitcast=True) - zf  # [BN, BW] code - zero, exact
                if GROUP_MODE >= 2:
                    w = w * s
                xt = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
                step += xt.to(tl.float32)[:, None, :] * w[None, :, :]
            if GROUP_MODE >= 2:
                acc += step
            else:
                acc += step * s[None, :, :]
            w_ptrs += BLOCK_W
        y = tl.sum(acc, axis=2)  # [BM, BN]
        if HAS_BIAS:
            y += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _split_k_reduce_kernel(partial, bias, out, M, N, stride_om, SPLIT_K: tl.constexpr,
                               HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """out[m, n] = sum over s in order of partial[s, m, n] (+ bias[n]), in out's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mn = M * N
        mask = offs < mn
        acc = tl.load(partial + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(partial + s * mn + offs, mask=mask, other=0.0)
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + (offs // N) * stride_om + n, acc.to(out.dtype.element_ty), mask=mask)


_TRITON_DTYPES = (torch.float16, torch.bfloat16)


class TritonW4A16Linear(TritonKernel):
    """Dequantizes in registers inside one tiled GEMM (tl.dot in x's dtype, float32 accumulation);
    decode batches split K across programs and add the partial sums in a second, ordered pass."""

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
                group_size: int) -> WNA16Weights:
        gs = _check_canonical(codes, scales, zeros, bits, group_size)
        n, k = codes.shape
        pack = 32 // bits
        ck = KBLOCK // pack
        kp = -(-k // KBLOCK) * KBLOCK
        blocks = F.pad(codes, (0, kp - k)).view(n, kp // KBLOCK, pack, ck)  # [N, blocks, chunk i, position j]
        blocks = blocks.transpose(2, 3)  # [N, blocks, j, i]: the codes of word j, chunk order
        if bits == 4:
            blocks = blocks[..., 0::2] | (blocks[..., 1::2] << 4)  # [N, blocks, CK, 4] bytes, chunk 2b low
        qweight = blocks.contiguous().view(torch.int32).view(n, kp // pack)  # int32 [N, Kp / PACK]
        zp = _uniform_zero(zeros)
        if gs >= k:  # channel: [1, N]
            scales_t, zeros_t = scales.t(), zeros.t()
        else:  # pad with empty groups (scale 0) so every block of Kp has its groups: [Gp, N]
            gp = -(-kp // gs)
            scales_t = F.pad(scales, (0, gp - scales.shape[1])).t()
            zeros_t = F.pad(zeros, (0, gp - zeros.shape[1])).t()
        return WNA16Weights(qweight, scales_t.contiguous(), None if zp is not None else zeros_t.contiguous(),
                            bits, gs, k, n, zero_point=zp or 0, layout="triton")

    @staticmethod
    def dequantize(weights: WNA16Weights) -> torch.Tensor:
        """float32 [N, K], equal to dequantize_reference of the canonical inputs."""
        _check_layout(weights, "triton")
        bits, n, k = weights.bits, weights.out_features, weights.in_features
        pack = 32 // bits
        words = weights.qweight.view(n, -1, KBLOCK // pack, 1)  # [N, blocks, j, 1]
        shifts = torch.arange(pack, device=words.device, dtype=torch.int32) * bits  # [i]
        codes = (words >> shifts) & ((1 << bits) - 1)  # [N, blocks, j, i]
        codes = codes.transpose(2, 3).reshape(n, -1)[:, :k]  # [N, K] in column order
        groups = weights.num_groups
        scales = weights.scales.t()[:, :groups]  # [N, G]
        zeros = weights.zero_point if weights.zeros is None else weights.zeros.t()[:, :groups]
        return _dequantize(codes, scales, zeros, weights.group_size)

    @staticmethod
    def forward(x: torch.Tensor, weights: WNA16Weights, bias: torch.Tensor | None = None,
                tiles: TileConfig | GemvTiles | None = None) -> torch.Tensor:
        """x [..., K] (float16 / bfloat16; float32 in the interpreter) -> [..., N] in x's dtype:
        the GEMV for at most GEMV_MAX_M rows, else the tiled GEMM. tiles: a TileConfig (the GEMM)
        or GemvTiles (the GEMV) instead of the tables' choice (tests, tuning)."""
        _check_layout(weights, "triton")
        k, n = weights.in_features, weights.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return out.view(*lead, n)
        has_bias = bias is not None
        bias_arg = bias if has_bias else out
        bits = weights.bits
        chunk = KBLOCK * bits // 32
        zeros = weights.zeros if weights.zeros is not None else weights.scales  # unused when None
        mode = _group_mode(weights.group_size, k, chunk)
        if (tiles is None and m <= GEMV_MAX_M) or isinstance(tiles, GemvTiles):
            cfg = tiles or gemv_tiles(m, bits)
            _wna16_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
                x2, weights.qweight, weights.scales, zeros, bias_arg, out, m, n, k, x2.stride(0), out.stride(0),
                weights.qweight.shape[1], float(2**23 + weights.zero_point),
                BITS=bits, GROUP_SIZE=weights.group_size, GROUP_MODE=mode, HAS_ZEROS=weights.zeros is not None,
                HAS_BIAS=has_bias, BLOCK_M=next_power_of_2(m), BLOCK_N=cfg.block_n,
                BLOCK_W=cfg.block_w(bits), num_warps=cfg.num_warps, **pdl_launch(x.device))
            return out.view(*lead, n)
        cfg = tiles or tile_config(m, n, k, x.device)
        blocks = triton.cdiv(k, KBLOCK)
        per_split = triton.cdiv(blocks, cfg.split_k)
        split = triton.cdiv(blocks, per_split)  # no empty slices
        partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
        # Gathered scales are a whole tile per stage: two stages keep 128 x 128 tiles in shared memory.
        stages = min(cfg.num_stages, 2) if mode == _GATHER else cfg.num_stages
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        _wna16_gemm_kernel[grid](
            x2, weights.qweight, weights.scales, zeros, bias_arg, out, partial,
            m, n, k, x2.stride(0), out.stride(0), weights.qweight.shape[1], per_split,
            float(2**23 + weights.zero_point),
            BITS=bits, GROUP_SIZE=weights.group_size, GROUP_MODE=mode,
            HAS_ZEROS=weights.zeros is not None, HAS_BIAS=has_bias, SPLIT=split > 1, EVEN_K=k % KBLOCK == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            DOT_F32=INTERPRETED and x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=stages)
        if split > 1:
            block = 1024
            _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
                partial, bias_arg, out, m, n, out.stride(0), SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block)
        return out.view(*lead, n)
