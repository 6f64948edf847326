"""Paged attention in Triton: one kernel for a mixed batch of decodes and (chunked) prefills.

A program takes BLOCK_Q query tokens of one sequence and all the query heads that share one KV
head (GQA: the tile holds BLOCK_Q x group rows; attention sinks seed its softmax), then walks the sequence's block table in
TILE_N-token steps with an online softmax (scores soft-capped first where the layer caps them). Decode-only steps launch one program per (sequence,
KV head); steps with prefill chunks launch one per (non-empty query tile, KV head) from a tile
table built once per step, so one launch serves any mix. The loop bounds come from device
memory (seq_lens, query_start_loc), so decode launches can be captured in a CUDA graph.

The KV write is a separate small kernel (`store_kv`) that skips slots of -1 (padding).

FP8 caches (float8_e4m3fn, FP8_KV): the tiles are loaded as fp8 and converted in registers to the
query dtype (exact: e4m3 values are bf16/fp32 values); the layer's scales are not applied per
element but folded in: k_scale into the softmax scale, v_scale into the accumulator at the end.
The writes divide by the scale (IEEE division, as torch), clamp to +-448 and convert to fp8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from baryon.kernels.attention import sdpa_prefill
from baryon.kernels.attention.backend import AttentionBackend, check_fp8_scales, is_fp8_cache
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.soft_cap import soft_cap_tile
from baryon.kernels.triton_utils import (INTERPRETED, multiprocessor_count, next_power_of_2, pdl_launch, tl, triton,
                                         triton_unsupported_reason, wait_and_release)
from baryon.transfer import to_device


if triton is not None:

    @triton.jit
    def e4m3_round_to_nearest_even(y):
        """float32 y in [-448, 448] (or NaN) -> float8e4nv, rounded to nearest even with bit
        operations. For the interpreter only: its float->fp8 conversion rounds ties up and
        loses mantissa carries; compiled kernels use the hardware conversion (cvt.rn.satfinite)."""
        bits = y.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        exp = ((bits >> 23) & 0xFF).to(tl.int32) - 127
        significand = ((bits & 0x7FFFFF) | 0x800000).to(tl.int64)  # 1.m x 2^23
        # Keep 3 fraction bits of a normal e4m3 value (exp >= -6); fewer for its subnormals.
        shift = tl.minimum(20 + tl.maximum(-6 - exp, 0), 40).to(tl.int64)
        kept = significand >> shift
        rest = significand - (kept << shift)
        half = 1 << (shift - 1)
        kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int64)
        # Normal: biased exponent and fraction (a carry out of the fraction bumps the exponent);
        # subnormal: `kept` is the code itself (8 = the smallest normal, 2^-6).
        code = tl.where(exp >= -6, ((exp + 7) << 3).to(tl.int64) + kept - 8, kept)
        code = tl.where(y != y, 0x7F, code)  # NaN
        return (code.to(tl.uint32) | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def quantize_fp8_kv(x, scale_ptr, cache, INTERPRETED: tl.constexpr):
        """clamp(x / scale, +-448) in the fp8 element type of `cache` (float32 IEEE division and
        round-to-nearest-even, as torch's x.float() / scale ... .to(float8_e4m3fn))."""
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        y = tl.where(y != y, y, tl.clamp(y, -448.0, 448.0))  # NaN stays NaN, as with torch.clamp
        if INTERPRETED:
            quantized = e4m3_round_to_nearest_even(y)
        else:
            quantized = y.to(cache.dtype.element_ty)
        return quantized

    @triton.jit
    def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                         stride_kt, stride_vt, stride_cache_slot,
                         ROW: tl.constexpr, ROW_PADDED: tl.constexpr, FP8_KV: tl.constexpr,
                         INTERPRETED: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_mapping + token)
        if slot < 0:
            return
        offs = tl.arange(0, ROW_PADDED)
        mask = offs < ROW
        k = tl.load(key + token * stride_kt + offs, mask=mask)
        v = tl.load(value + token * stride_vt + offs, mask=mask)
        if FP8_KV:
            k = quantize_fp8_kv(k, k_scale, k_cache, INTERPRETED)
            v = quantize_fp8_kv(v, v_scale, v_cache, INTERPRETED)
        tl.store(k_cache + slot * stride_cache_slot + offs, k, mask=mask)
        tl.store(v_cache + slot * stride_cache_slot + offs, v, mask=mask)

    @triton.jit
    def _attend_tile(q, k_cache, v_cache, block_tables, seq, start, last_pos, q_pos, kv_head, m_i, l_i, acc,
                     dims, dim_valid, scale, stride_cache_block, stride_cache_slot, stride_cache_head, stride_bt,
                     PAGE: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr, IEEE_DOT: tl.constexpr,
                     FP8_KV: tl.constexpr, SOFTCAP: tl.constexpr):
        """One TILE_N-token step of the online softmax over keys [start, start + TILE_N).
        FP8_KV: `scale` already includes k_scale; `acc` is still to be multiplied by v_scale.
        SOFTCAP > 0: the scaled scores soft-capped (Gemma 2) before the softmax."""
        key_pos = start + tl.arange(0, TILE_N)
        key_valid = key_pos < last_pos
        page = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_valid, other=0)
        slot_offset = page.to(tl.int64) * stride_cache_block + (key_pos % PAGE) * stride_cache_slot
        kv_offset = slot_offset[:, None] + kv_head * stride_cache_head + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache + kv_offset, mask=kv_mask, other=0.0)  # [TILE_N, D]
        if FP8_KV:
            k = k.to(q.dtype)
        if IEEE_DOT:  # float32 models: full-precision products (Triton's default would be TF32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, TILE_N]
        else:
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        if SOFTCAP > 0:
            scores = soft_cap_tile(scores, SOFTCAP)
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if WINDOW > 0:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache + kv_offset, mask=kv_mask, other=0.0)
        if FP8_KV:
            v = v.to(q.dtype)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _paged_attention_kernel(
        query, k_cache, v_cache, output, block_tables, seq_lens, query_start_loc, tile_seq, tile_q, sinks,
        partial_acc, partial_m, partial_l, scale, k_scale, v_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cache_block, stride_cache_slot, stride_cache_head, stride_bt,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, PAGE: tl.constexpr,
        TILE_N: tl.constexpr, WINDOW: tl.constexpr, INTERPRETED: tl.constexpr, TILED: tl.constexpr,
        IEEE_DOT: tl.constexpr, HAS_SINKS: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
        NUM_HEADS: tl.constexpr, FP8_KV: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_and_release(PDL)
        if TILED:  # program -> (sequence, query tile) from the step's tile table: no idle programs
            seq = tl.load(tile_seq + tl.program_id(0))
            q_tile = tl.load(tile_q + tl.program_id(0))
            split = 0
        else:  # decode: one query token per sequence; program_id(1) is the KV split
            seq = tl.program_id(0)
            q_tile = 0
            split = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens + seq)
        context = seq_len - q_len  # tokens already in the cache before this step

        rows = tl.arange(0, BLOCK_M)
        q_token = q_tile * BLOCK_Q + rows // GROUP  # query token (within the sequence's new tokens)
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_token < q_len)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        q = tl.load(query + (q_start + q_token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, D]
        q_pos = context + q_token  # absolute position of each row's token
        if FP8_KV:  # q . (k8 * k_scale) = (q . k8) * k_scale
            scale = scale * tl.load(k_scale)

        if HAS_SINKS:  # the sink starts the online softmax (of split 0 only): max = sink, sum = 1
            seeded = row_valid & (tl.zeros([BLOCK_M], tl.int32) + split == 0)  # a [BLOCK_M] int1 mask
            m_i = tl.load(sinks + head, mask=seeded, other=float("-inf")).to(tl.float32)
            l_i = tl.where(seeded, 1.0, 0.0)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
        last_pos = tl.minimum(context + (q_tile + 1) * BLOCK_Q, seq_len)  # keys needed: [lo, last_pos)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(context + q_tile * BLOCK_Q - WINDOW + 1, 0)
            lo = (lo // TILE_N) * TILE_N
        hi = last_pos
        if SPLITS > 1:  # flash decoding: this program takes one TILE_N-aligned share of the keys,
            # at least MIN_CHUNK of them (a short sequence uses fewer splits; the rest stay empty)
            chunk = ((last_pos - lo + SPLITS - 1) // SPLITS + TILE_N - 1) // TILE_N * TILE_N
            chunk = tl.maximum(chunk, MIN_CHUNK)
            lo = lo + split * chunk
            hi = tl.minimum(lo + chunk, last_pos)
        if INTERPRETED:
            # The CPU interpreter cannot take loaded values as range() bounds: the same loop as a while.
            start = lo
            while start < hi:
                m_i, l_i, acc = _attend_tile(q, k_cache, v_cache, block_tables, seq, start, last_pos, q_pos,
                                             kv_head, m_i, l_i, acc, dims, dim_valid, scale, stride_cache_block,
                                             stride_cache_slot, stride_cache_head, stride_bt, PAGE, TILE_N, WINDOW,
                                             IEEE_DOT, FP8_KV, SOFTCAP)
                start += TILE_N
        else:
            for start in range(lo, hi, TILE_N):
                m_i, l_i, acc = _attend_tile(q, k_cache, v_cache, block_tables, seq, start, last_pos, q_pos,
                                             kv_head, m_i, l_i, acc, dims, dim_valid, scale, stride_cache_block,
                                             stride_cache_slot, stride_cache_head, stride_bt, PAGE, TILE_N, WINDOW,
                                             IEEE_DOT, FP8_KV, SOFTCAP)
        if FP8_KV:  # sum_j p_j (v8_j * v_scale) = v_scale * sum_j p_j v8_j
            acc = acc * tl.load(v_scale)
        if SPLITS > 1:  # unnormalised partial results; combine_splits_kernel merges them
            part = ((q_start + q_token) * NUM_HEADS + head) * SPLITS + split  # [BLOCK_M]
            # An empty split (no keys: l = 0, and not split 0, which a sink may have seeded) writes
            # only its m and l; the combine reads no accumulator where l = 0.
            no_rows = tl.zeros([BLOCK_M], tl.int32)
            has_keys = row_valid & ((no_rows + split == 0) | (no_rows + lo < hi))  # [BLOCK_M]
            tl.store(partial_acc + part[:, None] * HEAD_DIM_PADDED + dims[None, :], acc, mask=has_keys[:, None])
            tl.store(partial_m + part, m_i, mask=row_valid)
            tl.store(partial_l + part, l_i, mask=row_valid)
            return
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(output + (q_start + q_token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(output.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


if triton is not None:

    @triton.jit
    def combine_splits_kernel(partial_acc, partial_m, partial_l, output, stride_ot, stride_oh,
                               NUM_HEADS: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               HEAD_DIM_PADDED: tl.constexpr, PDL: tl.constexpr):
        """Merge one (token, head)'s per-split softmax partials into the output row."""
        wait_and_release(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        part = (token * NUM_HEADS + head) * SPLITS + tl.arange(0, SPLITS)  # [SPLITS]
        m = tl.load(partial_m + part)
        l = tl.load(partial_l + part)
        m_max = tl.max(m, axis=0)
        weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
        total = tl.sum(l * weight, axis=0)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        written = (l > 0.0) | (tl.arange(0, SPLITS) == 0)  # empty splits wrote no accumulator
        acc = tl.load(partial_acc + part[:, None] * HEAD_DIM_PADDED + dims[None, :],
                      mask=written[:, None], other=0.0)  # [SPLITS, D]
        out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(output + token * stride_ot + head * stride_oh + dims, out.to(output.dtype.element_ty),
                 mask=dims < HEAD_DIM)


def query_tiles(metadata: AttentionMetadata, block_q: int,
                skip: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, query tile) of every non-empty tile of the step but those of the sequences in
    `skip` (served elsewhere), built once per step on the host and shared by all layers. Returns
    two [num_tiles] int32 device tensors."""
    key = f"triton_tiles_{block_q}_{skip}"
    if key not in metadata.backend_scratch:
        q_lens = (metadata.query_start_loc_cpu[1:] - metadata.query_start_loc_cpu[:-1]).long()
        q_lens[list(skip)] = 0
        tiles_per_seq = (q_lens + block_q - 1) // block_q
        tile_seq = torch.repeat_interleave(torch.arange(len(q_lens)), tiles_per_seq)
        first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
        tile_q = torch.arange(len(tile_seq)) - first_tile[tile_seq]
        device = metadata.query_start_loc.device
        metadata.backend_scratch[key] = (to_device(tile_seq.to(torch.int32), device),
                                         to_device(tile_q.to(torch.int32), device))
    return metadata.backend_scratch[key]


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into kv_cache [2, num_blocks,
    block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens] (-1: skip). An fp8 cache
    stores clamp(key / k_scale, +-448) and clamp(value / v_scale, +-448)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    fp8 = is_fp8_cache(kv_cache)
    if fp8:
        check_fp8_scales(k_scale, v_scale)
    else:  # unused pointers
        k_scale = v_scale = slot_mapping
    row = key.shape[1] * key.shape[2]
    key, value = key.reshape(num_tokens, row), value.reshape(num_tokens, row)
    _store_kv_kernel[(num_tokens,)](key, value, kv_cache[0], kv_cache[1], slot_mapping, k_scale, v_scale,
                                    key.stride(0), value.stride(0), kv_cache.stride(2),
                                    ROW=row, ROW_PADDED=next_power_of_2(row), FP8_KV=fp8,
                                    INTERPRETED=INTERPRETED)


@dataclass(frozen=True)
class DecodeTiles:
    """How a decode step (one query token per sequence) is launched. The split count is fixed
    per batch size (CUDA graphs capture the grid), so how many splits a sequence actually uses
    comes from its length inside the kernel: chunks of at least `min_chunk` keys."""

    tile_n: int = 64  # keys per online-softmax step
    min_chunk: int = 64  # fewest keys a KV split takes (a multiple of tile_n)
    max_splits: int = 64  # most programs sharing one sequence's keys (a power of two)
    waves: int = 2  # when sequences x KV heads leave SMs idle, split until ~waves x SMs programs
    num_warps: int = 4
    num_stages: int = 3  # 1 was 3% faster with 64 splits but 23% slower with 4 (few programs)


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True
    # Decode KV splits (a power of two); None: chosen from the batch and the GPU's SM count.
    num_kv_splits: int | None = None
    decode_tiles = DecodeTiles()

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return triton_unsupported_reason(device, "attention")

    @classmethod
    def cannot_implement_reason(cls, head_dim: int = 128, **config: Any) -> str | None:
        if head_dim not in (64, 128, 256):
            return f"head_dim {head_dim} (supported: 64, 128, 256)"
        return None

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, output: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        fp8 = is_fp8_cache(kv_cache)
        if fp8:
            check_fp8_scales(k_scale, v_scale)
        else:  # unused pointers
            k_scale = v_scale = metadata.seq_lens
        if key is not None:
            store_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        if output is None:
            output = torch.empty_like(query)
        long_queries = ()
        if metadata.max_query_len > 1 and sdpa_prefill.takes(query, kv_cache, self.sliding_window, self.sinks,
                                                             self.logit_softcap):
            long_queries = sdpa_prefill.long_queries(metadata)
            sdpa_prefill.prefill(query, kv_cache, metadata, self.scale, output, long_queries)
        group = self.num_heads // self.num_kv_heads
        if metadata.max_query_len == 1:
            block_q = 1
            block_m = max(16, next_power_of_2(group))
        else:
            block_m = max(64, next_power_of_2(group))
            block_q = block_m // group
        page = kv_cache.shape[2]
        tiled = metadata.max_query_len > 1
        tiles = self.decode_tiles
        if tiled:
            tile_n, min_chunk, launch = max(16, min(64, page * 4)), 0, {}
        else:
            tile_n, min_chunk = tiles.tile_n, tiles.min_chunk
            launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
        if tiled:
            tile_seq, tile_q = query_tiles(metadata, block_q, skip=long_queries)
            if tile_seq.shape[0] == 0:  # every sequence went to SDPA
                return output
            grid = (tile_seq.shape[0], 1, self.num_kv_heads)
        else:
            tile_seq = tile_q = metadata.seq_lens  # unused
        splits = 1 if tiled else self._decode_splits(metadata.num_seqs, query.device)
        if not tiled:
            grid = (metadata.num_seqs, splits, self.num_kv_heads)
        head_dim_padded = next_power_of_2(self.head_dim)
        if splits > 1:
            num_tokens = query.shape[0]
            partial_acc = torch.empty(num_tokens, self.num_heads, splits, head_dim_padded,
                                      dtype=torch.float32, device=query.device)
            partial_m = torch.empty(num_tokens, self.num_heads, splits, dtype=torch.float32, device=query.device)
            partial_l = torch.empty_like(partial_m)
        else:
            partial_acc = partial_m = partial_l = output  # unused
        _paged_attention_kernel[grid](
            query, kv_cache[0], kv_cache[1], output, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, tile_seq, tile_q,
            self.sinks if self.sinks is not None else metadata.seq_lens, partial_acc, partial_m, partial_l,
            self.scale, k_scale, v_scale,
            query.stride(0), query.stride(1), output.stride(0), output.stride(1),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), metadata.block_tables.stride(0),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=self.head_dim,
            HEAD_DIM_PADDED=head_dim_padded, PAGE=page, TILE_N=tile_n,
            WINDOW=self.sliding_window or 0, INTERPRETED=INTERPRETED, TILED=tiled,
            IEEE_DOT=query.dtype == torch.float32, HAS_SINKS=self.sinks is not None,
            SPLITS=splits, MIN_CHUNK=min_chunk, NUM_HEADS=self.num_heads, FP8_KV=fp8,
            SOFTCAP=self.logit_softcap or 0.0, **launch, **pdl_launch(query.device),
        )
        if splits > 1:
            combine_splits_kernel[(query.shape[0], self.num_heads)](
                partial_acc, partial_m, partial_l, output, output.stride(0), output.stride(1),
                NUM_HEADS=self.num_heads, SPLITS=splits, HEAD_DIM=self.head_dim, HEAD_DIM_PADDED=head_dim_padded,
                **pdl_launch(query.device))
        return output

    def _decode_splits(self, num_seqs: int, device: torch.device) -> int:
        """How many programs share one sequence's keys in a decode step (flash decoding): enough
        for ~waves x SMs programs when sequences x KV heads alone leave SMs idle; 1 otherwise.
        Measured on an H100 (`benchmarks/tune_decode_attention.py`, 8 KV heads, batch 1): 64
        splits read a 16k-token cache at 2.3 TB/s where 16 read it at 1.6 (29.4 vs 41.1 us a
        layer), 128k at 2.9 TB/s; short sequences use fewer splits through min_chunk."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if device.type != "cuda":
            return 1
        programs = num_seqs * self.num_kv_heads
        sms = multiprocessor_count(device)
        if programs >= sms:
            return 1
        return min(self.decode_tiles.max_splits, next_power_of_2(-(-self.decode_tiles.waves * sms // programs)))
