"""The expert computation as two Triton grouped GEMMs.

    gate/up:  inter[p] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)   for pair p = (t, k), e = its expert
    down:     y[p]     = weight[p] * inter[p] @ w2[e].T
    output:   out[t]   = sum over k of y[t * top_k + k]

Each program computes a tile of rows that all belong to one expert, so an expert's weights are
read once per tile of its tokens. The rows of a tile come one of three ways:

- pairs (a decode step of a few tokens): one program per (pair, column tile), a GEMV on the CUDA
  cores; every program has work, but an expert picked by two tokens is read twice;
- scan (decode and small batches): one program per (expert, column tile) finds its expert's
  pairs itself by scanning the step's expert ids, so no sorting pass and no index buffers are
  needed; experts that received nothing return at once. The grid depends only on the expert
  count and the shapes, so these steps replay inside CUDA graphs.
- sorted (large batches): `align.align_pairs_triton` sorts the pairs by expert and pads each
  expert's run to the tile height; one program per (row tile, column tile).

The gate/up GEMM keeps two accumulators (gate and up columns of the same tile) and applies
SiLU-and-mul in its epilogue, so the [pairs, 2 * I] product never reaches memory; the down GEMM
multiplies each row by its routing weight in its epilogue. Tile sizes come from
`tile_configs` (tuned per shape and batch bucket on the GPU, kept in `configs/`).

FP8 checkpoints with block weight scales (`TritonFp8FusedExperts`, family fused_moe_fp8) run the
same kernels with FP8=True: x and the intermediate are quantized per token in 1 x bk groups
(act_quant) to float8_e4m3fn, BLOCK_K is the scales' block width bk, and each K tile's float8
dot is multiplied by its row's activation scale and its column's weight-block scale before it
is added to the float32 accumulator. INT8 W8A8 experts (`TritonInt8FusedExperts`) take the same
path with int8 codes (int32 dots).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from baryon.kernels.activation import TritonSiluAndMul
from baryon.kernels.moe.align import align_pairs_triton
from baryon.kernels.moe.experts_grouped_mm import GroupedMMFusedExperts
from baryon.kernels.moe.expert_activation import SILU, ExpertActivation
from baryon.kernels.moe.tile_configs import (MoETiles, TileConfig, default_tiles, fp8_block_tiles, tile_configs,
                                              tuned_tiles)
from baryon.kernels.quant.act_quant import FP8
from baryon.kernels.selector import select
from baryon.kernels.triton_utils import INTERPRETED, TritonKernel, tl, triton

# Packed int4 experts decoded on 16-bit lanes, four codes (one 32-bit register of bytes) at a time:
# the nibbles masked, each byte placed under the exponent byte M of the magic (prmt; bf16 M = 0x43:
# 128 + code, fp16 0x64: 1024 + code, exact), then two packed FMAs: + -(magic + zero) (code - zero,
# exact) and * scale + -0.0 (the product rounded once). $2: the bytes, $3 $4: -(magic + zero), $5 $6:
# the scales (two lanes a register), $0 $1: the four values.
_INT4_LANES_ASM = """{{
.reg .b32 t, u, magic, one, nzero;
mov.b32 magic, {magic};
mov.b32 one, {one};
mov.b32 nzero, 0x80008000;
{nibbles}
prmt.b32 u, t, magic, 0x4140;
fma.rn.{kind} u, u, one, $3;
fma.rn.{kind} $0, u, $5, nzero;
prmt.b32 u, t, magic, 0x4342;
fma.rn.{kind} u, u, one, $4;
fma.rn.{kind} $1, u, $6, nzero;
}}"""


def _int4_lanes_asm(high: bool, kind: str) -> str:
    magic, one = {"bf16x2": ("0x43", "0x3F803F80"), "f16x2": ("0x64", "0x3C003C00")}[kind]
    nibbles = "shr.b32 t, $2, 4;\nand.b32 t, t, 0x0F0F0F0F;" if high else "and.b32 t, $2, 0x0F0F0F0F;"
    return _INT4_LANES_ASM.format(magic=magic, one=one, nibbles=nibbles, kind=kind)


if triton is not None:
    # Globals a kernel reads must be constexprs. The interpreter runs no PTX: float32 there.
    _INT4_IN_LANES = tl.constexpr(not INTERPRETED)
    _INT4_ASM_BF16_LOW, _INT4_ASM_BF16_HIGH, _INT4_ASM_F16_LOW, _INT4_ASM_F16_HIGH = (
        tl.constexpr(_int4_lanes_asm(high, kind)) for kind in ("bf16x2", "f16x2") for high in (False, True))

    @triton.jit
    def _e2m1_to_float(codes):
        """e2m1 codes (0..15 in uint8; bit 3 the sign) -> float32 value / 2^14, exactly: the code
        as an fp16 bit pattern (sign to bit 15, exponent and mantissa bits to bits 9-11; code 1
        lands on the fp16 subnormal 2^-15, which conversions keep). _e8m0_to_float returns the
        2^14 back with each scale."""
        c = codes.to(tl.uint16)
        return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _e8m0_to_float(scales):
        """e8m0 scales (uint8) -> 2^(s - 127) * 2^14 in float32 (see _e2m1_to_float)."""
        return (scales.to(tl.uint32) << 23).to(tl.float32, bitcast=True) * 16384.0

    @triton.jit
    def _int4_nibbles(packed, neg_magic_zero, scale, HIGH: tl.constexpr, dtype: tl.constexpr):
        """(nibble - zero) * scale of each byte of packed [...] (uint8; the low or HIGH nibble) in
        dtype (bfloat16 / float16), four bytes a time on 16-bit lanes (see _INT4_LANES_ASM): exactly the
        float32 (code - zero) * scale rounded once to dtype. neg_magic_zero: -(magic + zero) and
        scale in dtype, broadcast to packed's shape."""
        if dtype == tl.bfloat16:
            if HIGH:
                asm: tl.constexpr = _INT4_ASM_BF16_HIGH
            else:
                asm: tl.constexpr = _INT4_ASM_BF16_LOW
        else:
            if HIGH:
                asm: tl.constexpr = _INT4_ASM_F16_HIGH
            else:
                asm: tl.constexpr = _INT4_ASM_F16_LOW
        return tl.inline_asm_elementwise(asm, "=r,=r,r,r,r,r,r", [packed, neg_magic_zero, scale],
                                         dtype=neg_magic_zero.dtype, is_pure=True, pack=4)

    @triton.jit
    def _mxfp4_halves(w_ptrs, s_ptrs, n_mask, byte_mask, group_mask, dtype: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FOUR_BIT: tl.constexpr):
        """A K tile of packed weights w_ptrs [BN, BK / 32, 16] (bytes) with scales s_ptrs [BN, BK / 32]
        -> (even-k values, odd-k values), each [BN, BK / 2] in dtype: column j holds k = 2j and
        2j + 1 of the tile. FOUR_BIT 1: e2m1 codes, e8m0 scales (exact); 2: unsigned int4 codes,
        s_ptrs at (scale, zero) pairs: (code - zero) * scale, rounded once to dtype (on the GPU in
        16-bit lanes without conversion instructions: _int4_nibbles; else through float32).
        EVEN_K: the tile lies inside K, so only rows are masked and the loads stay vectorized."""
        if EVEN_K:
            packed = tl.load(w_ptrs, mask=n_mask[:, None, None], other=0)
            s_mask = n_mask[:, None]
        else:
            packed = tl.load(w_ptrs, mask=n_mask[:, None, None] & byte_mask[None, :, :], other=0)
            s_mask = n_mask[:, None] & group_mask[None, :]
        if FOUR_BIT == 2:  # the (scale, zero) pairs in one load: [BN, BK / 32, 2]
            pair = tl.load(s_ptrs[:, :, None] + tl.arange(0, 2)[None, None, :], mask=s_mask[:, :, None], other=0.0)
            scale, zero = tl.split(pair.to(tl.float32))
            scale, zero = scale[:, :, None], zero[:, :, None]
            if _INT4_IN_LANES and (dtype == tl.bfloat16 or dtype == tl.float16):
                if dtype == tl.bfloat16:  # -(magic + zero): integers <= 1039, exact in dtype
                    neg = tl.broadcast_to((-(128.0 + zero)).to(dtype), packed.shape)
                else:
                    neg = tl.broadcast_to((-(1024.0 + zero)).to(dtype), packed.shape)
                scale = tl.broadcast_to(scale.to(dtype), packed.shape)
                even = tl.reshape(_int4_nibbles(packed, neg, scale, False, dtype), [BLOCK_N, BLOCK_K // 2])
                odd = tl.reshape(_int4_nibbles(packed, neg, scale, True, dtype), [BLOCK_N, BLOCK_K // 2])
            else:
                even = tl.reshape(((packed & 0xF).to(tl.float32) - zero) * scale, [BLOCK_N, BLOCK_K // 2]).to(dtype)
                odd = tl.reshape(((packed >> 4).to(tl.float32) - zero) * scale, [BLOCK_N, BLOCK_K // 2]).to(dtype)
        else:
            scale = _e8m0_to_float(tl.load(s_ptrs, mask=s_mask, other=0))[:, :, None]
            even = tl.reshape(_e2m1_to_float(packed & 0xF) * scale, [BLOCK_N, BLOCK_K // 2]).to(dtype)
            odd = tl.reshape(_e2m1_to_float(packed >> 4) * scale, [BLOCK_N, BLOCK_K // 2]).to(dtype)
        return even, odd

    @triton.jit
    def _activate(gate, up, ACT: tl.constexpr, alpha, limit):
        """expert_activation.ExpertActivation with code ACT, in float32."""
        if ACT == 0:
            return gate / (1.0 + tl.exp(-gate)) * up
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))

    @triton.jit
    def _epilogue(acc, acc_up, b_expert, offs_n, n_mask, N, alpha, limit, GATED: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
        """acc ([BN] or [BM, BN]) plus the expert's bias b_expert[offs_n] (HAS_BIAS); with GATED,
        act(that, acc_up plus b_expert[N + offs_n])."""
        if HAS_BIAS:
            acc += tl.load(b_expert + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if GATED:
                acc_up += tl.load(b_expert + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            acc = _activate(acc, acc_up, ACT, alpha, limit)
        return acc

    @triton.jit
    def _expert_tile(x, stride_xm, a_rows, row_mask, w_expert, stride_wn, stride_wk, offs_n, n_mask, N, K,
                     up_offset, a_scale, stride_asm, stride_ask, ws_expert, stride_wsn, stride_wsk,
                     b_expert, alpha, limit,
                     GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                     FP8: tl.constexpr, SCALE_BN: tl.constexpr, FOUR_BIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
        """[BLOCK_M, BLOCK_N] float32: rows a_rows of x times columns offs_n of the expert's weight
        (w_expert[n, k]) plus its bias b_expert[n] (HAS_BIAS); with GATED, act(that, the same
        with the columns up_offset further, weight rows offs_n + N).

        FP8: x and the weight are float8 with block scales, BLOCK_K being the scales' block width:
        each K tile's dot is multiplied by a_scale[row, kb] (per row, kb-th group of x's row) and
        ws_expert[n // SCALE_BN, kb] (per weight row) before it is added (float32).
        FOUR_BIT: the weight is packed two 4-bit codes a byte (w_expert[n, k // 2]) with a scale
        per 32 values ws_expert[n, k // 32] (1: e2m1 codes, e8m0 scales; 2: unsigned int4 codes,
        (scale, zero) pairs), dequantized in registers to x's dtype: the low nibbles (even k) and
        the high nibbles (odd k) each meet their half of x's columns in a dot of BLOCK_K / 2."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if FOUR_BIT:  # the weight rows on the dot's tall side: out^T = W x^T, the decoded tile from registers
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_up_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            offs_k = tl.arange(0, BLOCK_K)
            offs_g, offs_b = tl.arange(0, BLOCK_K // 32), tl.arange(0, 16)
            a_ptrs = x + a_rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK], read whole
            byte = offs_g[:, None] * 16 + offs_b[None, :]  # [BK/32, 16]: the bytes of a K tile, by scale group
            w_ptrs = w_expert + offs_n[:, None, None].to(tl.int64) * stride_wn + byte[None, :, :] * stride_wk
            s_ptrs = ws_expert + offs_n[:, None].to(tl.int64) * stride_wsn + offs_g[None, :] * stride_wsk
            s_up_offset = N.to(tl.int64) * stride_wsn
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
                a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))  # k = 2j, 2j + 1
                a_even, a_odd = tl.trans(a_even), tl.trans(a_odd)  # [BK/2, BM]
                byte_mask, group_mask = byte < (K - k0) // 2, offs_g < (K - k0) // 32
                w, w_odd = _mxfp4_halves(w_ptrs, s_ptrs, n_mask, byte_mask, group_mask, a.dtype, BLOCK_N, BLOCK_K,
                                         EVEN_K, FOUR_BIT)
                acc_t = _dot_halves(w, w_odd, a_even, a_odd, acc_t, IEEE)
                if GATED:
                    w, w_odd = _mxfp4_halves(w_ptrs + up_offset, s_ptrs + s_up_offset, n_mask, byte_mask,
                                             group_mask, a.dtype, BLOCK_N, BLOCK_K, EVEN_K, FOUR_BIT)
                    acc_up_t = _dot_halves(w, w_odd, a_even, a_odd, acc_up_t, IEEE)
                a_ptrs += BLOCK_K
                w_ptrs += (BLOCK_K // 2) * stride_wk
                s_ptrs += (BLOCK_K // 32) * stride_wsk
            acc = tl.trans(acc_t)
            if GATED:
                acc_up = tl.trans(acc_up_t)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x + a_rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
            w_ptrs = w_expert + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
            if FP8:
                as_ptrs = a_scale + a_rows.to(tl.int64) * stride_asm  # [BM]
                ws_ptrs = ws_expert + (offs_n // SCALE_BN) * stride_wsn  # [BN]
                ws_up_ptrs = ws_expert + ((offs_n + N) // SCALE_BN) * stride_wsn
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                    w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
                else:
                    k_mask = offs_k < K - k0
                    a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if FP8:
                    s_a = tl.load(as_ptrs, mask=row_mask, other=0.0)[:, None]
                    acc += tl.dot(a, w) * (s_a * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :])
                elif IEEE:
                    acc = tl.dot(a, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
                if GATED:
                    if EVEN_K:
                        w_up = tl.load(w_ptrs + up_offset, mask=n_mask[None, :], other=0.0)
                    else:
                        w_up = tl.load(w_ptrs + up_offset, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                    if FP8:
                        acc_up += tl.dot(a, w_up) * (s_a * tl.load(ws_up_ptrs, mask=n_mask, other=0.0)[None, :])
                    elif IEEE:
                        acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
                    else:
                        acc_up = tl.dot(a, w_up, acc_up)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_wk
                if FP8:
                    as_ptrs += stride_ask
                    ws_ptrs += stride_wsk
                    ws_up_ptrs += stride_wsk
        return _epilogue(acc, acc_up, b_expert, offs_n, n_mask, N, alpha, limit, GATED, HAS_BIAS, ACT)

    @triton.jit
    def _dot_halves(a_even, a_odd, b_even, b_odd, acc, IEEE: tl.constexpr):
        """acc + a_even @ b_even + a_odd @ b_odd (the two halves of a K tile)."""
        if IEEE:
            acc = tl.dot(a_even, b_even, acc, input_precision="ieee")
            return tl.dot(a_odd, b_odd, acc, input_precision="ieee")
        return tl.dot(a_odd, b_odd, tl.dot(a_even, b_even, acc))

    @triton.jit
    def _store_rows(out, stride_om, pairs, row_mask, offs_n, n_mask, acc, topk_weights, MUL_WEIGHT: tl.constexpr):
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_weights + pairs, mask=row_mask, other=0.0)[:, None]
        tl.store(out + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _gemv_mxfp4(x_row, w_ptrs, s_ptrs, n_mask, K, stride_wsk, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    FOUR_BIT: tl.constexpr):
        """[BN] float32: one row of x (x_row) times 4-bit weight rows read as int32 words (w_ptrs
        [BN, BK / 32, 4]: word w of scale group g holds the codes of k = 32g + 8w + i in its
        nibble i) with scales s_ptrs [BN, BK / 32], both at k = 0: per group, the products of the
        codes with x are summed first, then scaled once (FOUR_BIT 2, int4 codes with (scale, zero)
        pairs: minus the zero times the group's sum of x, then scaled). Words rather than bytes: a
        quarter of the load instructions (measured 36 against 54 us for 33 MB on an H100)."""
        G: tl.constexpr = BLOCK_K // 32
        offs_g = tl.arange(0, G)
        word = offs_g[:, None] * 4 + tl.arange(0, 4)[None, :]  # [G, 4]
        acc = tl.zeros([w_ptrs.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = word * 8 < K - k0
            if EVEN_K:  # rows masked only: vectorized loads
                words = tl.load(w_ptrs, mask=n_mask[:, None, None], other=0)
            else:
                words = tl.load(w_ptrs, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0)
            part = tl.zeros(words.shape, tl.float32)
            x_sum = tl.zeros(word.shape, tl.float32)  # [G, 4]
            for i in tl.static_range(8):
                a = tl.load(x_row + k0 + word * 8 + i, mask=k_mask, other=0.0).to(tl.float32)
                if FOUR_BIT == 2:  # the code as float32 by its bits (2^23 + code) - 2^23: no conversion
                    code = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    part += code * a[None, :, :]
                    x_sum += a
                else:
                    part += _e2m1_to_float((words >> (4 * i)) & 0xF) * a[None, :, :]
            s_mask = n_mask[:, None] & (offs_g * 32 < K - k0)[None, :]
            if FOUR_BIT == 2:
                scale = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
                zero = tl.load(s_ptrs + 1, mask=s_mask, other=0.0).to(tl.float32)
                acc += tl.sum((tl.sum(part, axis=2) - zero * tl.sum(x_sum, axis=1)[None, :]) * scale, axis=1)
            else:
                scale = _e8m0_to_float(tl.load(s_ptrs, mask=s_mask, other=0))
                acc += tl.sum(tl.sum(part, axis=2) * scale, axis=1)
            w_ptrs += BLOCK_K // 8
            s_ptrs += (BLOCK_K // 32) * stride_wsk
        return acc

    @triton.jit
    def _moe_pairs_kernel(x, w, out, topk_ids, topk_weights, a_scale, w_scale, bias, N, K, expert_start, num_local,
                          stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                          stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be, alpha, limit,
                          ROWS_PER_X: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          FP8: tl.constexpr, SCALE_BN: tl.constexpr, FOUR_BIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
        """Program (pair, column tile): one row times its expert's weight columns, as a GEMV on
        the CUDA cores (a decode step of a few tokens: every program has work). FP8, bias and
        activation as in _expert_tile; 4-bit weights are read as int32 words (_gemv_mxfp4)."""
        pair = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        local_expert = tl.load(topk_ids + pair) - expert_start
        if (local_expert < 0) | (local_expert >= num_local):
            return
        x_row = x + (pair // ROWS_PER_X).to(tl.int64) * stride_xm
        w_rows = w + local_expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
        up_offset = N.to(tl.int64) * stride_wn
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        if FOUR_BIT:  # w: the packed rows as int32 words (stride_wn in words)
            offs_g = tl.arange(0, BLOCK_K // 32)
            w_ptrs = w_rows[:, :, None] + (offs_g[:, None] * 4 + tl.arange(0, 4)[None, :])[None, :, :]  # [BN, BK/32, 4]
            s_ptrs = (w_scale + local_expert.to(tl.int64) * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn
                      + offs_g[None, :] * stride_wsk)  # [BN, BK/32]
            acc = _gemv_mxfp4(x_row, w_ptrs, s_ptrs, n_mask, K, stride_wsk, BLOCK_K, EVEN_K, FOUR_BIT)
            if GATED:
                acc_up = _gemv_mxfp4(x_row, w_ptrs + up_offset, s_ptrs + N.to(tl.int64) * stride_wsn, n_mask, K,
                                     stride_wsk, BLOCK_K, EVEN_K, FOUR_BIT)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x_row + offs_k
            w_ptrs = w_rows + offs_k[None, :] * stride_wk  # [BN, BK]
            acc = tl.zeros([BLOCK_N], tl.float32)
            if FP8:
                as_ptr = a_scale + (pair // ROWS_PER_X).to(tl.int64) * stride_asm
                ws_ptrs = w_scale + local_expert.to(tl.int64) * stride_wse + (offs_n // SCALE_BN) * stride_wsn
                ws_up_ptrs = (w_scale + local_expert.to(tl.int64) * stride_wse
                              + ((offs_n + N) // SCALE_BN) * stride_wsn)
            for k0 in range(0, K, BLOCK_K):
                k_mask = offs_k < K - k0
                if EVEN_K:
                    a = tl.load(a_ptrs).to(tl.float32)
                    wt = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
                    wt = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                if FP8:
                    s_a = tl.load(as_ptr)
                    acc += tl.sum(wt.to(tl.float32) * a[None, :], axis=1) * (
                        s_a * tl.load(ws_ptrs, mask=n_mask, other=0.0))
                else:
                    acc += tl.sum(wt.to(tl.float32) * a[None, :], axis=1)
                if GATED:
                    if EVEN_K:
                        wu = tl.load(w_ptrs + up_offset, mask=n_mask[:, None], other=0.0)
                    else:
                        wu = tl.load(w_ptrs + up_offset, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    if FP8:
                        acc_up += tl.sum(wu.to(tl.float32) * a[None, :], axis=1) * (
                            s_a * tl.load(ws_up_ptrs, mask=n_mask, other=0.0))
                    else:
                        acc_up += tl.sum(wu.to(tl.float32) * a[None, :], axis=1)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_wk
                if FP8:
                    as_ptr += stride_ask
                    ws_ptrs += stride_wsk
                    ws_up_ptrs += stride_wsk
        acc = _epilogue(acc, acc_up, bias + local_expert.to(tl.int64) * stride_be, offs_n, n_mask, N, alpha, limit,
                        GATED, HAS_BIAS, ACT)
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_weights + pair)
        tl.store(out + pair.to(tl.int64) * stride_om + offs_n, acc.to(out.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _expert_pairs(topk_ids, num_pairs, expert, first_row, SCAN: tl.constexpr, BLOCK_M: tl.constexpr):
        """The pairs routed to `expert` with ranks first_row .. first_row + BLOCK_M - 1 (in pair
        order; 0 past the last) and the expert's pair count."""
        rows = first_row + tl.arange(0, BLOCK_M)
        pairs = tl.zeros([BLOCK_M], tl.int32)
        seen = 0
        for start in range(0, num_pairs, SCAN):
            offs = start + tl.arange(0, SCAN)
            match = tl.load(topk_ids + offs, mask=offs < num_pairs, other=-1) == expert
            rank = tl.cumsum(match.to(tl.int32), axis=0) + seen - 1
            hit = (rank[None, :] == rows[:, None]) & match[None, :]  # [BLOCK_M, SCAN]
            pairs += tl.sum(tl.where(hit, offs[None, :], 0), axis=1)
            seen += tl.sum(match.to(tl.int32), axis=0)
        return pairs, seen

    @triton.jit
    def _scan_row_tile(first_row, pairs, count, x, w_expert, out, topk_ids, topk_weights, num_pairs, expert,
                       offs_n, n_mask, N, K, up_offset, stride_xm, stride_wn, stride_wk, stride_om,
                       a_scale, stride_asm, stride_ask, ws_expert, stride_wsn, stride_wsk, b_expert, alpha, limit,
                       ROWS_PER_X: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr,
                       EVEN_K: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr,
                       FOUR_BIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
        """Rows first_row .. first_row + BLOCK_M - 1 of the expert's pairs (`pairs` holds the first
        tile's, found with the count)."""
        if first_row > 0:
            pairs, count = _expert_pairs(topk_ids, num_pairs, expert, first_row, SCAN, BLOCK_M)
        row_mask = first_row + tl.arange(0, BLOCK_M) < count
        acc = _expert_tile(x, stride_xm, pairs // ROWS_PER_X, row_mask, w_expert, stride_wn, stride_wk, offs_n,
                           n_mask, N, K, up_offset, a_scale, stride_asm, stride_ask, ws_expert, stride_wsn,
                           stride_wsk, b_expert, alpha, limit, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, FP8,
                           SCALE_BN, FOUR_BIT, HAS_BIAS, ACT)
        _store_rows(out, stride_om, pairs, row_mask, offs_n, n_mask, acc, topk_weights, MUL_WEIGHT)

    @triton.jit
    def _moe_scan_kernel(x, w, out, topk_ids, topk_weights, a_scale, w_scale, bias, num_pairs, N, K, expert_start,
                         stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                         stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be, alpha, limit,
                         ROWS_PER_X: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCAN: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, SCALE_BN: tl.constexpr, FOUR_BIT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ACT: tl.constexpr, INTERPRETED: tl.constexpr):
        """Program (local expert, column tile): every pair routed to that expert. Row of x for pair
        p: p // ROWS_PER_X (the token for gate/up, the pair itself for down)."""
        local_expert = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        expert = local_expert + expert_start
        pairs, count = _expert_pairs(topk_ids, num_pairs, expert, 0, SCAN, BLOCK_M)
        if count == 0:
            return
        w_expert = w + local_expert.to(tl.int64) * stride_we
        ws_expert = w_scale + local_expert.to(tl.int64) * stride_wse
        b_expert = bias + local_expert.to(tl.int64) * stride_be
        up_offset = N.to(tl.int64) * stride_wn
        first_row = 0
        if INTERPRETED:  # the interpreter cannot loop to a loaded bound: the same loop as a while
            while first_row < count:
                _scan_row_tile(first_row, pairs, count, x, w_expert, out, topk_ids, topk_weights, num_pairs, expert,
                               offs_n, n_mask, N, K, up_offset, stride_xm, stride_wn, stride_wk, stride_om,
                               a_scale, stride_asm, stride_ask, ws_expert, stride_wsn, stride_wsk, b_expert, alpha,
                               limit, ROWS_PER_X, GATED, MUL_WEIGHT, BLOCK_M, BLOCK_N, BLOCK_K, SCAN, EVEN_K, IEEE,
                               FP8, SCALE_BN, FOUR_BIT, HAS_BIAS, ACT)
                first_row += BLOCK_M
        else:
            for first_row in range(0, count, BLOCK_M):
                _scan_row_tile(first_row, pairs, count, x, w_expert, out, topk_ids, topk_weights, num_pairs, expert,
                               offs_n, n_mask, N, K, up_offset, stride_xm, stride_wn, stride_wk, stride_om,
                               a_scale, stride_asm, stride_ask, ws_expert, stride_wsn, stride_wsk, b_expert, alpha,
                               limit, ROWS_PER_X, GATED, MUL_WEIGHT, BLOCK_M, BLOCK_N, BLOCK_K, SCAN, EVEN_K, IEEE,
                               FP8, SCALE_BN, FOUR_BIT, HAS_BIAS, ACT)

    @triton.jit
    def _moe_sorted_kernel(x, w, out, sorted_pairs, block_experts, num_padded, topk_weights, a_scale, w_scale, bias,
                           num_pairs, N, K, num_blocks_m, stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                           stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be, alpha, limit,
                           ROWS_PER_X: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                           FP8: tl.constexpr, SCALE_BN: tl.constexpr, FOUR_BIT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
        """Program (row tile, column tile) over the sorted, padded pairs; GROUP_M row tiles share
        their column tiles in launch order (the standard tile swizzle)."""
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_rows
        pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows
        if pid_m * BLOCK_M >= tl.load(num_padded):
            return
        pairs = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < num_pairs
        local_expert = tl.load(block_experts + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = _expert_tile(x, stride_xm, pairs // ROWS_PER_X, row_mask, w + local_expert * stride_we,
                           stride_wn, stride_wk, offs_n, n_mask, N, K, N.to(tl.int64) * stride_wn,
                           a_scale, stride_asm, stride_ask, w_scale + local_expert * stride_wse, stride_wsn,
                           stride_wsk, bias + local_expert * stride_be, alpha, limit, GATED, BLOCK_M, BLOCK_N,
                           BLOCK_K, EVEN_K, IEEE, FP8, SCALE_BN, FOUR_BIT, HAS_BIAS, ACT)
        _store_rows(out, stride_om, pairs, row_mask, offs_n, n_mask, acc, topk_weights, MUL_WEIGHT)


if triton is not None:

    @triton.jit
    def _sum_topk_kernel(y, out, topk_ids, hidden, expert_start, num_local, TOP_K: tl.constexpr,
                         BLOCK_H: tl.constexpr, PARTIAL: tl.constexpr):
        """out[t] = sum over k of y[t * TOP_K + k], in float32, k in order (deterministic). PARTIAL:
        only the pairs routed to this rank's experts (expert_start .. + num_local) are summed; the
        rows of the others were never written."""
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < hidden
        acc = tl.zeros([BLOCK_H], tl.float32)
        for k in tl.static_range(TOP_K):
            row_mask = mask
            if PARTIAL:
                local = tl.load(topk_ids + token * TOP_K + k) - expert_start
                row_mask = tl.where((local >= 0) & (local < num_local), mask, False)
            acc += tl.load(y + (token * TOP_K + k) * hidden + offs, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out + token * hidden + offs, acc.to(out.dtype.element_ty), mask=mask)


def sum_topk(y: torch.Tensor, num_tokens: int, top_k: int, topk_ids: torch.Tensor | None = None,
             expert_start: int = 0, num_local: int = 0) -> torch.Tensor:
    """y: [num_tokens * top_k, hidden] -> [num_tokens, hidden]. With topk_ids ([num_tokens, top_k]
    global ids, contiguous), only the pairs of experts expert_start .. expert_start + num_local - 1
    are summed (expert parallelism: the other pairs' rows of y hold nothing)."""
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        partial = topk_ids is not None
        _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block))](
            y, out, topk_ids if partial else y, hidden, expert_start, num_local, TOP_K=top_k, BLOCK_H=block,
            PARTIAL=partial)
    return out


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n: int, rows_per_x: int, gated: bool,
            topk_weights: torch.Tensor | None, cfg: TileConfig, layout,
            fp8: tuple[torch.Tensor, torch.Tensor, int] | None = None, mxfp4_scale: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, activation: ExpertActivation = SILU, int4: bool = False) -> None:
    """One grouped GEMM: out[p, :n] for every pair p, from rows of x and the expert weights w
    [experts, (2 if gated else 1) * n, K], plus bias [experts, (2 if gated else 1) * n] if given;
    gated: the activation of the gate and up columns. fp8: (x_scale [rows of x, ceil(K / bk)],
    w_scale [experts, ceil(rows of w / bn), ceil(K / bk)], bn) for float8 x and w with block
    scales, cfg.block_k being bk. mxfp4_scale: w is packed MXFP4 [experts, rows, K / 2] uint8
    with these e8m0 scales [experts, rows, K / 32]; with int4, w holds unsigned int4 codes the
    same way and mxfp4_scale is (scale, zero) pairs [experts, rows, K / 32, 2] (`int4_experts`)."""
    num_local, K = w.shape[0], w.shape[2] * (2 if mxfp4_scale is not None else 1)
    a_scale, w_scale, scale_bn = x, w, 1  # pointers never read without scales
    a_strides, w_strides = (0, 0), (0, 0, 0)
    if fp8 is not None:
        a_scale, w_scale, scale_bn = fp8
        a_strides, w_strides = a_scale.stride(), w_scale.stride()
    elif mxfp4_scale is not None:  # int4's (scale, zero) pairs: the zero is the element after the scale
        if int4 and mxfp4_scale.stride(-1) != 1:
            raise ValueError("int4 experts' (scale, zero) pairs must be adjacent (stride 1 along the last dim)")
        w_scale, w_strides = mxfp4_scale, mxfp4_scale.stride()[:3]
    bias_arg = bias if bias is not None else out
    four_bit = 0 if mxfp4_scale is None else 2 if int4 else 1
    extra = dict(FP8=fp8 is not None, SCALE_BN=scale_bn, FOUR_BIT=four_bit, HAS_BIAS=bias is not None,
                 ACT=activation.code)
    common = dict(ROWS_PER_X=rows_per_x, GATED=gated, MUL_WEIGHT=topk_weights is not None,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
                  IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)
    weights = topk_weights if topk_weights is not None else out
    strides = (x.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), *a_strides, *w_strides,
               bias.stride(0) if bias is not None else 0, activation.alpha, activation.limit)
    if layout[0] == "pairs":
        _, topk_ids, expert_start = layout
        grid = (topk_ids.numel(), triton.cdiv(n, cfg.block_n))
        if mxfp4_scale is not None:  # the GEMV reads the packed rows as int32 words
            w = w.view(torch.int32)
            strides = (strides[0], w.stride(0), w.stride(1), w.stride(2), *strides[4:])
        _moe_pairs_kernel[grid](x, w, out, topk_ids, weights, a_scale, w_scale, bias_arg, n, K, expert_start,
                                num_local, *strides, ROWS_PER_X=rows_per_x, GATED=gated,
                                MUL_WEIGHT=topk_weights is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                EVEN_K=K % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                **extra)
    elif layout[0] == "scan":
        _, topk_ids, expert_start = layout
        grid = (num_local, triton.cdiv(n, cfg.block_n))
        _moe_scan_kernel[grid](x, w, out, topk_ids, weights, a_scale, w_scale, bias_arg, topk_ids.numel(), n, K,
                               expert_start, *strides, SCAN=cfg.scan, INTERPRETED=INTERPRETED, **common)
    else:
        _, sorted_pairs, block_experts, num_padded, num_pairs = layout
        blocks_m = block_experts.shape[0]
        grid = (blocks_m * triton.cdiv(n, cfg.block_n),)
        _moe_sorted_kernel[grid](x, w, out, sorted_pairs, block_experts, num_padded, weights, a_scale, w_scale,
                                 bias_arg, num_pairs, n, K, blocks_m, *strides, GROUP_M=cfg.group_m, **common)


def _grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, expert_start: int, num_experts: int | None, tiles: MoETiles,
                     dtype: torch.dtype, fp8: tuple | None = None, mxfp4: tuple | None = None,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     activation: ExpertActivation = SILU, int4: bool = False) -> torch.Tensor:
    """The gate/up and down GEMMs in tiles' layout, the intermediate and each pair's output in
    dtype, then the sum over k. fp8: (x_scale, w13_scale, w2_scale, (bn, bk), act_quant kernel)
    when x, w13 and w2 are float8 with block scales; the intermediate is quantized like x (per
    row, 1 x bk groups) before the down GEMM. mxfp4: (w13_scale, w2_scale) e8m0 scales when
    w13 and w2 are packed MXFP4, or with int4 their (scale, zero) pairs when they are packed
    int4 codes (the activations stay as they are)."""
    num_tokens = x.shape[0]
    hidden, top_k = w2.shape[1], topk_ids.shape[1]
    num_local, inter = w13.shape[0], w2.shape[2] * (2 if mxfp4 is not None else 1)
    num_pairs = num_tokens * top_k
    inter_out = torch.empty(num_pairs, inter, dtype=dtype, device=x.device)
    # Pairs routed to another rank's experts are never written (the sum leaves them out).
    partial = num_experts is not None and num_experts != num_local
    y = torch.empty(num_pairs, hidden, dtype=dtype, device=x.device)
    up_cfg, down_cfg = tiles.up, tiles.down
    if activation != SILU and not up_cfg.fuse_act:  # only SiLU has a separate kernel
        up_cfg = replace(up_cfg, fuse_act=True)
    if tiles.mode in ("pairs", "scan"):
        up_layout = down_layout = (tiles.mode, topk_ids, expert_start)
    else:
        up_layout = ("sorted", *align_pairs_triton(topk_ids, num_local, expert_start, up_cfg.block_m), num_pairs)
        down_layout = up_layout if down_cfg.block_m == up_cfg.block_m else \
            ("sorted", *align_pairs_triton(topk_ids, num_local, expert_start, down_cfg.block_m), num_pairs)
    up_fp8 = down_fp8 = None
    if fp8 is not None:
        x_scale, w13_scale, w2_scale, (block_n, block_k), quant = fp8
        up_fp8 = (x_scale, w13_scale, block_n)
    w13_mx, w2_mx = mxfp4 if mxfp4 is not None else (None, None)
    if up_cfg.fuse_act:
        _launch(x, w13, inter_out, inter, top_k, True, None, up_cfg, up_layout, up_fp8, w13_mx, w13_bias, activation,
                int4)
    else:  # gate/up product [pairs, 2 * inter] to memory, then SiLU-and-mul
        gate_up = torch.empty(num_pairs, 2 * inter, dtype=dtype, device=x.device)  # other ranks' pairs: never read
        _launch(x, w13, gate_up, 2 * inter, top_k, False, None, up_cfg, up_layout, up_fp8, w13_mx, w13_bias,
                int4=int4)
        inter_out = TritonSiluAndMul.forward(gate_up)
    if fp8 is not None:
        inter_out, inter_scale = quant.per_group(inter_out, block_k, w2.dtype)  # float8, or int8 codes
        down_fp8 = (inter_scale, w2_scale, block_n)
    _launch(inter_out, w2, y, hidden, 1, False, topk_weights, down_cfg, down_layout, down_fp8, w2_mx, w2_bias,
            int4=int4)
    if partial:
        return sum_topk(y, num_tokens, top_k, topk_ids, expert_start, num_local)
    return sum_topk(y, num_tokens, top_k)


class TritonFusedExperts(TritonKernel):
    family = "fused_moe"

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype = torch.bfloat16, **config) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype}"
        return None

    @staticmethod
    def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None,
                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                activation: ExpertActivation = SILU) -> torch.Tensor:
        """x: [num_tokens, hidden]; w13: [local experts, 2 * inter, hidden]; w2: [local experts,
        hidden, inter]; topk_weights / topk_ids: [num_tokens, top_k] (float32 / int32 global ids);
        num_experts: the global expert count; biases [local experts, 2 * inter] / [local experts,
        hidden] or None. Returns [num_tokens, hidden]."""
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        num_local, inter = w13.shape[0], w2.shape[2]
        if x.stride(1) != 1:
            x = x.contiguous()
        topk_ids = topk_ids.contiguous()
        topk_weights = topk_weights.contiguous()
        tiles = tile_configs(num_local, hidden, inter, num_tokens, top_k, x.dtype, x.device)
        plain = w13_bias is None and w2_bias is None and activation == SILU
        if tiles.mode == "grouped_mm":
            if plain:  # measured faster at this size (tile_configs)
                return GroupedMMFusedExperts.forward(x, w13, w2, topk_weights, topk_ids, expert_start, num_experts)
            tiles = default_tiles(num_local, num_tokens * top_k)  # no biases in torch's grouped GEMM
        return _grouped_experts(x, w13, w2, topk_weights, topk_ids, expert_start, num_experts, tiles, x.dtype,
                                w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)


@functools.lru_cache(maxsize=None)
def _act_quant(device: torch.device):
    """The activation-quantization kernel for `device`, chosen once (not per layer per step)."""
    return select("act_quant", device)


class TritonFp8FusedExperts(TritonKernel):
    """FP8 experts with 128 x 128 block weight scales (DeepSeek-V3, Qwen3-*-FP8), w8a8 like vLLM's
    and SGLang's block-FP8 MoE: the activations are quantized per token in 1 x bk groups
    (act_quant) before each GEMM, and each K tile (BLOCK_K = bk) of the float8 tensor-core dot is
    scaled by x_scale[row, kb] * w_scale[expert, n // bn, kb] before it is accumulated in float32.
    The layouts and tiles are those of the bf16 kernels (`fp8_block_tiles`: BLOCK_K = bk, and
    gated tiles that fit the registers).
    Reference: `experts_torch.fused_experts_fp8_reference`."""

    family = "fused_moe_fp8"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        reason = super().unsupported_reason(device)
        if reason is None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return "float8 tensor-core dots need compute capability 8.9 or newer"
        return reason

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype = torch.bfloat16, hidden: int | None = None,
                                inter: int | None = None, block: tuple[int, int] | None = None,
                                **config) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype}"
        if block is None:
            return "needs block weight scales (block=(bn, bk))"
        block_n, block_k = block
        if block_n < 1 or block_k < 32 or block_k & (block_k - 1):
            return f"block {tuple(block)}: bk must be a power of two of at least 32 (it is the GEMMs' BLOCK_K)"
        return None

    @staticmethod
    def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                w2_scale: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_start: int = 0, num_experts: int | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden] (float16 / bfloat16 / float32); w13: float8_e4m3fn [local
        experts, 2 * inter, hidden] with w13_scale float32 [local experts, ceil(2 * inter / bn),
        ceil(hidden / bk)]; w2: float8_e4m3fn [local experts, hidden, inter] with w2_scale
        [local experts, ceil(hidden / bn), ceil(inter / bk)]; block: (bn, bk); routing as in
        TritonFusedExperts. Returns [num_tokens, hidden] in x.dtype."""
        block_n, block_k = block
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        num_local, inter = w13.shape[0], w2.shape[2]
        quant = _act_quant(x.device)  # per_group(x, group_size, dtype) -> (q, scale)
        x_q, x_scale = quant.per_group(x.contiguous(), block_k, w13.dtype)
        topk_ids = topk_ids.contiguous()
        topk_weights = topk_weights.contiguous()
        tiles = fp8_block_tiles(tile_configs(num_local, hidden, inter, num_tokens, top_k, FP8, x.device),
                                num_local, num_tokens * top_k, block_k, block_n)
        return _grouped_experts(x_q, w13, w2, topk_weights, topk_ids, expert_start, num_experts, tiles, x.dtype,
                                (x_scale, w13_scale, w2_scale, (block_n, block_k), quant))


class TritonInt8FusedExperts(TritonFp8FusedExperts):
    """INT8 W8A8 experts (compressed-tensors `int-quantized` MoE checkpoints: int8 codes with
    per-channel scales, spread into (1 x 128) blocks at load): the FP8 kernels with int8 operands,
    the activations quantized to int8 per token in groups of 128, each K tile's int32 dot scaled
    into the float32 accumulator. Reference: `experts_torch.fused_experts_fp8_reference` on int8."""

    family = "fused_moe_int8"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return super(TritonFp8FusedExperts, cls).unsupported_reason(device)  # int8 dots: no float8 needed


if triton is not None:

    @triton.jit
    def _dequantize_mxfp4_kernel(blocks, scales, out, row_bytes, BLOCK: tl.constexpr):
        """Program (row, chunk of BLOCK bytes): out[row, 2j], out[row, 2j + 1] = the low and high
        codes of byte j times its group's scale (contiguous rows)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_bytes
        packed = tl.load(blocks + row * row_bytes + offs, mask=mask, other=0)
        scale = _e8m0_to_float(tl.load(scales + row * (row_bytes // 16) + offs // 16, mask=mask, other=0))
        out_row = out + row * (2 * row_bytes) + 2 * offs
        tl.store(out_row, (_e2m1_to_float(packed & 0xF) * scale).to(out.dtype.element_ty), mask=mask)
        tl.store(out_row + 1, (_e2m1_to_float(packed >> 4) * scale).to(out.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _dequantize_int4_kernel(blocks, pairs, out, row_bytes, BLOCK: tl.constexpr):
        """Program (row, chunk of BLOCK bytes): out[row, 2j], out[row, 2j + 1] = (the low and high
        codes of byte j - its group's zero) * its group's scale, in float32 (contiguous rows;
        pairs [.., K / 32, 2] (scale, zero))."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_bytes
        packed = tl.load(blocks + row * row_bytes + offs, mask=mask, other=0)
        pair = pairs + (row * (row_bytes // 16) + offs // 16) * 2
        scale = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(pair + 1, mask=mask, other=0.0).to(tl.float32)
        out_row = out + row * (2 * row_bytes) + 2 * offs
        tl.store(out_row, (((packed & 0xF).to(tl.float32) - zero) * scale).to(out.dtype.element_ty), mask=mask)
        tl.store(out_row + 1, (((packed >> 4).to(tl.float32) - zero) * scale).to(out.dtype.element_ty), mask=mask)


def dequantize_int4_triton(blocks: torch.Tensor, pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., K / 2] uint8 with (scale, zero) pairs [..., K / 32, 2] (contiguous) -> [..., K]
    in dtype (`kernels/quant/int4_experts.dequantize_int4_experts` on the GPU, without its float32
    temporaries: one pass, the output its only allocation)."""
    row_bytes = blocks.shape[-1]
    out = torch.empty(*blocks.shape[:-1], 2 * row_bytes, dtype=dtype, device=blocks.device)
    rows = blocks.numel() // row_bytes
    block = min(1024, triton.next_power_of_2(row_bytes))
    _dequantize_int4_kernel[(rows, triton.cdiv(row_bytes, block))](blocks.contiguous(), pairs.contiguous(), out,
                                                                   row_bytes, BLOCK=block)
    return out


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., K / 2] uint8 with scales [..., K / 32] (contiguous) -> [..., K] in dtype, exact
    (`kernels/quant/mxfp4.dequantize_mxfp4` on the GPU, without its temporaries)."""
    row_bytes = blocks.shape[-1]
    out = torch.empty(*blocks.shape[:-1], 2 * row_bytes, dtype=dtype, device=blocks.device)
    rows = blocks.numel() // row_bytes
    block = min(1024, triton.next_power_of_2(row_bytes))
    _dequantize_mxfp4_kernel[(rows, triton.cdiv(row_bytes, block))](blocks, scales, out, row_bytes, BLOCK=block)
    return out


# From this many tokens a step dequantizes the layer's experts to the activations' dtype (one pass
# over them, ~2 GB for GPT-OSS-20B's 32 experts in bf16, freed after the layer) and runs the float
# kernels: the in-register decode costs every row tile again, so large batches pay it many times.
MXFP4_DEQUANTIZE_MIN_TOKENS = 1024


# The MXFP4 GEMV's tile (pairs layout: decode steps of a few tokens), the best of BLOCK_N 16-64,
# BLOCK_K 256-512, 4-8 warps on an H100 (36 us for 23,040 x 2,880 packed: 0.98 TB/s).
MXFP4_GEMV_TILE = TileConfig(block_m=1, block_n=16, block_k=256, num_warps=4)


@functools.lru_cache(maxsize=4096)
def _four_bit_tiles(num_local: int, hidden: int, inter: int, num_tokens: int, top_k: int, device: torch.device,
                    weights: str) -> MoETiles:
    """The tiles of packed 4-bit experts, weights "mxfp4" or "int4": the entry of their own tuned
    table (`benchmarks/tune_moe.py --weights ...`), else the default layout with the 4-bit GEMV's
    tile for decode pairs."""
    tuned = tuned_tiles(num_local, hidden, inter, num_tokens, weights, device)
    if tuned is not None and tuned.mode != "grouped_mm":  # (torch's grouped GEMM reads no packed weights)
        return tuned
    tiles = default_tiles(num_local, num_tokens * top_k)
    return MoETiles("pairs", MXFP4_GEMV_TILE, MXFP4_GEMV_TILE) if tiles.mode == "pairs" else tiles


class TritonMxfp4FusedExperts(TritonKernel):
    """MXFP4 experts (GPT-OSS): the bf16 layouts and tiles with the weights read packed (4.25 bits
    a value) and dequantized in registers into the activations' dtype before each dot (Hopper has
    no FP4 tensor cores); activations stay unquantized. Reference:
    `experts_torch.fused_experts_mxfp4_reference`."""

    family = "fused_moe_mxfp4"

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype = torch.bfloat16, hidden: int = 32, inter: int = 32,
                                **config) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype}"
        if hidden % 32 or inter % 32:
            return f"hidden {hidden} / intermediate {inter} are not multiples of 32 (the MXFP4 scale groups)"
        return None

    @staticmethod
    def forward(x: torch.Tensor, w13_blocks: torch.Tensor, w2_blocks: torch.Tensor, w13_scales: torch.Tensor,
                w2_scales: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int = 0,
                num_experts: int | None = None, w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None, activation: ExpertActivation = SILU) -> torch.Tensor:
        """x: [num_tokens, hidden]; w13_blocks uint8 [local experts, 2 * inter, hidden / 2] with
        w13_scales uint8 [local experts, 2 * inter, hidden / 32]; w2_blocks [local experts,
        hidden, inter / 2] with w2_scales [local experts, hidden, inter / 32]; the rest as
        TritonFusedExperts.forward. Returns [num_tokens, hidden] in x.dtype."""
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        num_local, inter = w13_blocks.shape[0], 2 * w2_blocks.shape[2]
        if num_tokens >= MXFP4_DEQUANTIZE_MIN_TOKENS:
            w13 = dequantize_mxfp4_triton(w13_blocks, w13_scales, x.dtype)
            w2 = dequantize_mxfp4_triton(w2_blocks, w2_scales, x.dtype)
            return TritonFusedExperts.forward(x, w13, w2, topk_weights, topk_ids, expert_start, num_experts,
                                              w13_bias, w2_bias, activation)
        tiles = _four_bit_tiles(num_local, hidden, inter, num_tokens, top_k, x.device, "mxfp4")
        return _grouped_experts(x.contiguous(), w13_blocks, w2_blocks, topk_weights.contiguous(),
                                topk_ids.contiguous(), expert_start, num_experts, tiles, x.dtype,
                                mxfp4=(w13_scales, w2_scales), w13_bias=w13_bias, w2_bias=w2_bias,
                                activation=activation)


# From this many tokens a step dequantizes the layer's int4 experts (as MXFP4 does, same reason).
INT4_DEQUANTIZE_MIN_TOKENS = MXFP4_DEQUANTIZE_MIN_TOKENS


class TritonInt4FusedExperts(TritonKernel):
    """Packed int4 experts (GPTQ / AWQ / compressed-tensors W4A16 MoE checkpoints, the layout of
    `quant/int4_experts.py`): the MXFP4 kernels' loads and tiles with each 4-bit code decoded as
    (code - zero) * scale in registers; activations stay unquantized. Reference:
    `experts_torch.fused_experts_int4_reference`."""

    family = "fused_moe_int4"

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype = torch.bfloat16, hidden: int = 32, inter: int = 32,
                                **config) -> str | None:
        return TritonMxfp4FusedExperts.cannot_implement_reason(dtype, hidden, inter)

    @staticmethod
    def forward(x: torch.Tensor, w13_blocks: torch.Tensor, w2_blocks: torch.Tensor, w13_pairs: torch.Tensor,
                w2_pairs: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int = 0,
                num_experts: int | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden]; w13_blocks uint8 [local experts, 2 * inter, hidden / 2] with
        w13_pairs [local experts, 2 * inter, hidden / 32, 2]; w2_blocks [local experts, hidden,
        inter / 2] with w2_pairs [local experts, hidden, inter / 32, 2]; routing as in
        TritonFusedExperts.forward. Returns [num_tokens, hidden] in x.dtype."""
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        num_local, inter = w13_blocks.shape[0], 2 * w2_blocks.shape[2]
        if num_tokens >= INT4_DEQUANTIZE_MIN_TOKENS:
            w13 = dequantize_int4_triton(w13_blocks, w13_pairs, x.dtype)
            w2 = dequantize_int4_triton(w2_blocks, w2_pairs, x.dtype)
            return TritonFusedExperts.forward(x, w13, w2, topk_weights, topk_ids, expert_start, num_experts)
        tiles = _four_bit_tiles(num_local, hidden, inter, num_tokens, top_k, x.device, "int4")
        return _grouped_experts(x.contiguous(), w13_blocks, w2_blocks, topk_weights.contiguous(),
                                topk_ids.contiguous(), expert_start, num_experts, tiles, x.dtype,
                                mxfp4=(w13_pairs, w2_pairs), int4=True)
