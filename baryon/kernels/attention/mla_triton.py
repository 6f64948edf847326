"""Multi-head latent attention in Triton (the `triton` kernel of family `mla_attention`): one kernel
for a mixed batch of decodes and (chunked) prefills, in the absorbed form over the paged latent
cache (layout in mla_backend.py).

Every query head reads the same key row per token, cat(c_kv, k_pe) (L + R values), so heads are
the rows of a tile, as the heads of one KV group are in GQA: a program takes BLOCK_Q query tokens
of one sequence times BLOCK_H heads and walks the sequence's block table in TILE_N-token steps
with an online softmax. Per step it loads the [TILE_N, L] latents and [TILE_N, R] rope keys once
for all its rows; scores = q_latent . c_kv + q_pe . k_pe (two dots), and the latent tile is also the
value tile (acc += p . c_kv), so each cached byte is read once per program. Decode-only steps
launch one program per (sequence, KV split, head block) and split long sequences over programs
(flash decoding) when the batch alone cannot fill the GPU; steps with prefill chunks take one
program per (query tile, head block) from a tile table built once per step. Loop bounds come
from device memory, so decode launches can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.mla_backend import MLABackend
from baryon.kernels.attention.mla_indexer import token_sequences
from baryon.kernels.attention.triton_paged import combine_splits_kernel, query_tiles
from baryon.kernels.triton_utils import (INTERPRETED, multiprocessor_count, next_power_of_2, pdl_launch, tl, triton,
                                         triton_unsupported_reason)

MAX_KV_SPLITS = 32
# Decode-only launches, (TILE_N keys per step, num_warps, num_stages), by how many (sequence, head
# block) programs the batch has before KV splits: `python benchmarks/tune_mla.py` on an H200 at
# DeepSeek-V2-Lite's shape (us, scattered blocks): 256 x 640 keys 127.0 with (32, 8, 3) -> 73.4,
# 64 x 1k 45.1 -> 39.5, 64 x 8k 265.1 -> 223.3 with (32, 4, 2); one sequence of 32k 90.0 -> 56.3
# with (64, 8, 2) (75.0 with (32, 4, 2)).
DECODE_LAUNCH_FEW = (64, 8, 2)
DECODE_LAUNCH_MANY = (32, 4, 2)
FEW_PROGRAMS = 16
HEADS_PER_PROGRAM = 16  # BLOCK_H at most: a decode tile is 16 heads of one token
PREFILL_ROWS = 32  # BLOCK_Q x BLOCK_H rows of a prefill tile ([32, L] float32 accumulators)


if triton is not None:

    @triton.jit
    def _mla_tile(q_lat, q_pe, cache, block_tables, seq, key_pos, key_valid, visible, m_i, l_i, acc,
                  lat_dims, pe_dims, pe_valid, scale, stride_cache_block, stride_cache_slot, stride_bt,
                  L: tl.constexpr, PAGE: tl.constexpr, IEEE_DOT: tl.constexpr):
        """One step of the online softmax over the keys at positions key_pos [TILE_N] of sequence
        `seq` (key_valid: which exist; visible [BLOCK_M, TILE_N]: which each row may attend to)."""
        page = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_valid, other=0)
        slot = page.to(tl.int64) * stride_cache_block + (key_pos % PAGE) * stride_cache_slot  # [TILE_N]
        # An FP8 cache is converted to the queries' dtype here (a no-op for a cache in the model dtype).
        c_kv = tl.load(cache + slot[:, None] + lat_dims[None, :], mask=key_valid[:, None],
                       other=0.0).to(q_lat.dtype)  # [TILE_N, L]
        k_pe = tl.load(cache + slot[:, None] + L + pe_dims[None, :], mask=key_valid[:, None] & pe_valid[None, :],
                       other=0.0).to(q_pe.dtype)  # [TILE_N, R_PADDED]
        if IEEE_DOT:  # float32 models: full-precision products
            scores = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")
            scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision="ieee") * scale
        else:
            scores = tl.dot(q_lat, tl.trans(c_kv))
            scores = tl.dot(q_pe, tl.trans(k_pe), scores).to(tl.float32) * scale  # [BLOCK_M, TILE_N]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _mla_causal_step(q_lat, q_pe, cache, block_tables, seq, start, last_pos, q_pos, m_i, l_i, acc,
                         lat_dims, pe_dims, pe_valid, scale, stride_cache_block, stride_cache_slot, stride_bt,
                         L: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr, IEEE_DOT: tl.constexpr):
        """The keys [start, start + TILE_N) below last_pos, each row seeing those <= its position."""
        key_pos = start + tl.arange(0, TILE_N)
        key_valid = key_pos < last_pos
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        return _mla_tile(q_lat, q_pe, cache, block_tables, seq, key_pos, key_valid, visible, m_i, l_i, acc,
                         lat_dims, pe_dims, pe_valid, scale, stride_cache_block, stride_cache_slot, stride_bt,
                         L, PAGE, IEEE_DOT)

    @triton.jit
    def _mla_kernel(q_lat_ptr, q_pe_ptr, cache, output, block_tables, seq_lens, query_start_loc, tile_seq, tile_q,
                    partial_acc, partial_m, partial_l, scale,
                    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh,
                    stride_cache_block, stride_cache_slot, stride_bt,
                    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    L: tl.constexpr, R: tl.constexpr, R_PADDED: tl.constexpr, PAGE: tl.constexpr,
                    TILE_N: tl.constexpr, INTERPRETED: tl.constexpr, TILED: tl.constexpr, IEEE_DOT: tl.constexpr,
                    SPLITS: tl.constexpr):
        if TILED:
            seq = tl.load(tile_seq + tl.program_id(0))
            q_tile = tl.load(tile_q + tl.program_id(0))
            split = 0
        else:
            seq = tl.program_id(0)
            q_tile = 0
            split = tl.program_id(1)
        head_block = tl.program_id(2)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens + seq)
        context = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        q_token = q_tile * BLOCK_Q + rows // BLOCK_H
        head = head_block * BLOCK_H + rows % BLOCK_H
        row_valid = (rows < BLOCK_Q * BLOCK_H) & (q_token < q_len) & (head < NUM_HEADS)
        lat_dims = tl.arange(0, L)
        pe_dims = tl.arange(0, R_PADDED)
        pe_valid = pe_dims < R
        token = q_start + q_token
        q_lat = tl.load(q_lat_ptr + token[:, None] * stride_qlt + head[:, None] * stride_qlh + lat_dims[None, :],
                        mask=row_valid[:, None], other=0.0)  # [BLOCK_M, L]
        q_pe = tl.load(q_pe_ptr + token[:, None] * stride_qpt + head[:, None] * stride_qph + pe_dims[None, :],
                       mask=row_valid[:, None] & pe_valid[None, :], other=0.0)  # [BLOCK_M, R_PADDED]
        q_pos = context + q_token

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, L], tl.float32)
        last_pos = tl.minimum(context + (q_tile + 1) * BLOCK_Q, seq_len)
        lo = 0
        hi = last_pos
        if SPLITS > 1:
            chunk = ((last_pos + SPLITS - 1) // SPLITS + TILE_N - 1) // TILE_N * TILE_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, last_pos)
        if INTERPRETED:  # the interpreter cannot take loaded values as range() bounds
            start = lo
            while start < hi:
                m_i, l_i, acc = _mla_causal_step(q_lat, q_pe, cache, block_tables, seq, start, last_pos, q_pos, m_i,
                                                 l_i, acc, lat_dims, pe_dims, pe_valid, scale, stride_cache_block,
                                                 stride_cache_slot, stride_bt, L, PAGE, TILE_N, IEEE_DOT)
                start += TILE_N
        else:
            for start in range(lo, hi, TILE_N):
                m_i, l_i, acc = _mla_causal_step(q_lat, q_pe, cache, block_tables, seq, start, last_pos, q_pos, m_i,
                                                 l_i, acc, lat_dims, pe_dims, pe_valid, scale, stride_cache_block,
                                                 stride_cache_slot, stride_bt, L, PAGE, TILE_N, IEEE_DOT)
        if SPLITS > 1:  # unnormalised partials; combine_splits_kernel (triton_paged.py) merges them
            part = (token * NUM_HEADS + head) * SPLITS + split  # [BLOCK_M]
            tl.store(partial_acc + part[:, None].to(tl.int64) * L + lat_dims[None, :], acc, mask=row_valid[:, None])
            tl.store(partial_m + part, m_i, mask=row_valid)
            tl.store(partial_l + part, l_i, mask=row_valid)
            return
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(output + token[:, None] * stride_ot + head[:, None] * stride_oh + lat_dims[None, :],
                 out.to(output.dtype.element_ty), mask=row_valid[:, None])


if triton is not None:

    @triton.jit
    def _mla_sparse_kernel(q_lat_ptr, q_pe_ptr, cache, output, indices, token_seq, block_tables, scale,
                           stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_it,
                           stride_cache_block, stride_cache_slot, stride_bt, num_selected,
                           NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, L: tl.constexpr,
                           R: tl.constexpr, R_PADDED: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
                           IEEE_DOT: tl.constexpr):
        """Sparse attention (DeepSeek-V3.2): one token's BLOCK_H heads over the keys its indexer
        selected (indices [T, K]: positions in its sequence, -1 for none), TILE_N at a time."""
        token = tl.program_id(0)
        head_block = tl.program_id(1)
        seq = tl.load(token_seq + token)
        rows = tl.arange(0, BLOCK_M)
        head = head_block * BLOCK_H + rows
        row_valid = (rows < BLOCK_H) & (head < NUM_HEADS)
        lat_dims = tl.arange(0, L)
        pe_dims = tl.arange(0, R_PADDED)
        pe_valid = pe_dims < R
        q_lat = tl.load(q_lat_ptr + token * stride_qlt + head[:, None] * stride_qlh + lat_dims[None, :],
                        mask=row_valid[:, None], other=0.0)  # [BLOCK_M, L]
        q_pe = tl.load(q_pe_ptr + token * stride_qpt + head[:, None] * stride_qph + pe_dims[None, :],
                       mask=row_valid[:, None] & pe_valid[None, :], other=0.0)  # [BLOCK_M, R_PADDED]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, L], tl.float32)
        for j in range(0, num_selected, TILE_N):
            jj = j + tl.arange(0, TILE_N)
            key_pos = tl.load(indices + token.to(tl.int64) * stride_it + jj, mask=jj < num_selected, other=-1)
            key_valid = key_pos >= 0
            visible = key_valid[None, :] & (rows >= 0)[:, None]  # [BLOCK_M, TILE_N]
            m_i, l_i, acc = _mla_tile(q_lat, q_pe, cache, block_tables, seq, tl.maximum(key_pos, 0), key_valid,
                                      visible, m_i, l_i, acc, lat_dims, pe_dims, pe_valid, scale, stride_cache_block,
                                      stride_cache_slot, stride_bt, L, PAGE, IEEE_DOT)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(output + token * stride_ot + head[:, None] * stride_oh + lat_dims[None, :],
                 out.to(output.dtype.element_ty), mask=row_valid[:, None])



class TritonMLAAttention(MLABackend):
    name = "triton"
    cuda_graph_safe = True
    num_kv_splits: int | None = None  # decode splits (a power of two); None: from the batch and the GPU
    # Decode-only launches: (TILE_N keys per step, num_warps, num_stages); None: by the batch (above).
    decode_launch: tuple[int, int, int] | None = None

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return triton_unsupported_reason(device, "mla_attention")

    @classmethod
    def cannot_implement_reason(cls, kv_lora_rank: int = 512, rope_dim: int = 64, **config: Any) -> str | None:
        if kv_lora_rank < 16 or kv_lora_rank & (kv_lora_rank - 1):
            return f"kv_lora_rank {kv_lora_rank} (a power of two >= 16 is needed)"
        return None

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        tokens, heads, rank = q_latent.shape
        output = torch.empty_like(q_latent)
        block_h = min(next_power_of_2(heads), HEADS_PER_PROGRAM)
        head_blocks = triton.cdiv(heads, block_h)
        tiled = metadata.max_query_len > 1
        block_q = max(1, PREFILL_ROWS // block_h) if tiled else 1
        block_m = max(16, block_q * block_h)
        if tiled:
            tile_seq, tile_q = query_tiles(metadata, block_q)
            splits = 1
            grid = (tile_seq.shape[0], 1, head_blocks)
        else:
            tile_seq = tile_q = metadata.seq_lens  # unused
            splits = self._decode_splits(metadata.num_seqs * head_blocks, q_latent.device)
            grid = (metadata.num_seqs, splits, head_blocks)
        if splits > 1:
            partial_acc = torch.empty(tokens, heads, splits, rank, dtype=torch.float32, device=q_latent.device)
            partial_m = torch.empty(tokens, heads, splits, dtype=torch.float32, device=q_latent.device)
            partial_l = torch.empty_like(partial_m)
        else:
            partial_acc = partial_m = partial_l = output  # unused
        page = cache.shape[1]
        tile_n, num_warps = max(16, min(32, page * 4)), 8 if rank >= 256 else 4
        launch = {}
        if not tiled:
            few = metadata.num_seqs * head_blocks < FEW_PROGRAMS
            tile_n, num_warps, num_stages = self.decode_launch or (DECODE_LAUNCH_FEW if few else DECODE_LAUNCH_MANY)
            launch = {"num_stages": num_stages}
        _mla_kernel[grid](
            q_latent, q_pe, cache, output, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            tile_seq, tile_q, partial_acc, partial_m, partial_l, self.scale,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), output.stride(0),
            output.stride(1), cache.stride(0), cache.stride(1), metadata.block_tables.stride(0),
            NUM_HEADS=heads, BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_M=block_m, L=rank, R=self.rope_dim,
            R_PADDED=max(16, next_power_of_2(self.rope_dim)), PAGE=page, TILE_N=tile_n,
            INTERPRETED=INTERPRETED, TILED=tiled, IEEE_DOT=q_latent.dtype == torch.float32, SPLITS=splits,
            num_warps=num_warps, **launch)
        if splits > 1:
            combine_splits_kernel[(tokens, heads)](partial_acc, partial_m, partial_l, output, output.stride(0),
                                                   output.stride(1), NUM_HEADS=heads, SPLITS=splits, HEAD_DIM=rank,
                                                   HEAD_DIM_PADDED=rank, **pdl_launch(output.device))
        return output

    def forward_sparse(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                       metadata: AttentionMetadata, indices: torch.Tensor) -> torch.Tensor:
        tokens, heads, rank = q_latent.shape
        output = torch.empty_like(q_latent)
        if tokens == 0:
            return output
        block_h = min(next_power_of_2(heads), HEADS_PER_PROGRAM)
        _mla_sparse_kernel[(tokens, triton.cdiv(heads, block_h))](
            q_latent, q_pe, cache, output, indices, token_sequences(metadata), metadata.block_tables, self.scale,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), output.stride(0),
            output.stride(1), indices.stride(0), cache.stride(0), cache.stride(1), metadata.block_tables.stride(0),
            indices.shape[1], NUM_HEADS=heads, BLOCK_H=block_h, BLOCK_M=max(16, block_h), L=rank, R=self.rope_dim,
            R_PADDED=max(16, next_power_of_2(self.rope_dim)), PAGE=cache.shape[1], TILE_N=32,
            IEEE_DOT=q_latent.dtype == torch.float32, num_warps=8 if rank >= 256 else 4)
        return output

    def _decode_splits(self, programs: int, device: torch.device) -> int:
        """Programs per sequence in a decode step: enough to give every SM work when the batch's
        programs alone would not (flash decoding); 1 otherwise."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if device.type != "cuda":
            return 1
        sms = multiprocessor_count(device)
        if programs >= sms:
            return 1
        return min(MAX_KV_SPLITS, next_power_of_2(-(-sms // programs)))
