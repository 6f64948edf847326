"""DeepSeek-V3.2's lightning indexer (family `mla_indexer`): which cached keys each new token's
sparse attention reads.

Each layer caches one index key per token (I values, after the latent in the cache row, see
mla_backend.py; with kv_cache_dtype="fp8" as float8_e4m3fn like the latent, read back in the
queries' dtype). A new token at position p scores every visible key t <= p of its sequence as

    index[t] = sum_h w[h] * relu(q_index[h] . k_index[t] / sqrt(I))       w = weights_proj(x) / sqrt(heads)

and attends to the `topk` best (all of them while p + 1 <= topk: then it is dense attention).

    scores   [T, S] float32, S = the step's longest sequence; -inf where a key is not visible
    indices  [T, K] int32, K = min(topk, S): positions in the token's sequence, best first; -1 pads
             the rows of tokens that see fewer than K keys

Kernels: `triton` (one program per (token, 16-key tile): one dot of all heads' queries with the
tile's keys; then torch.topk) and `torch`.
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.mla_backend import sequence_rows
from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, tl, triton
from baryon.transfer import to_device


def index_scores_reference(index_q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, offset: int,
                           metadata: AttentionMetadata) -> torch.Tensor:
    """index_q [T, heads, I] (rotated), weights [T, heads] float32 (divided by sqrt(heads)), cache
    [num_blocks, block_size, row] with index keys in columns [offset, offset + I) -> [T, S]."""
    index_dim = index_q.shape[-1]
    longest = int(metadata.seq_lens_cpu.max())
    scores = torch.full((index_q.shape[0], longest), float("-inf"), dtype=torch.float32, device=index_q.device)
    starts = metadata.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        keys = sequence_rows(cache, metadata, i, seq_len)[:, offset: offset + index_dim].float()  # [S, I]
        index = torch.cat([_token_scores(index_q[first:last].float(), weights[first:last].float(), keys)
                           for first, last in _row_chunks(start, end, seq_len * index_q.shape[1] * index_dim)])
        positions = torch.arange(seq_len - (end - start), seq_len, device=index.device)
        visible = torch.arange(seq_len, device=index.device)[None, :] <= positions[:, None]
        scores[start:end, :seq_len] = index.masked_fill(~visible, float("-inf"))
    return scores


# Elements of one chunk's products [rows, S, heads, I] (float32: 64 MiB).
_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(start: int, end: int, per_row: int) -> list[tuple[int, int]]:
    rows = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    return [(first, min(first + rows, end)) for first in range(start, end, rows)]


def _token_scores(index_q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """index_q [q, heads, I], weights [q, heads], keys [S, I] (float32) -> [q, S]. Each score is
    summed over I, then over the heads, as the innermost dimension of a product: the same order
    for a token whatever the step holds (a matmul's order changes with its shape, and a key whose
    score moved by an ulp can trade places with a near-equal one in the top-k: seen as a request
    decoding differently after a prefill over its cached prefix)."""
    per_head = torch.relu((index_q[:, None, :, :] * keys[None, :, None, :]).sum(-1) * keys.shape[1] ** -0.5)
    return (per_head * weights[:, None, :]).sum(-1)  # per_head [q, S, heads]


def topk_indices(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, S] -> [T, min(topk, S)] int32 positions of the best visible keys (-1: none).
    Equal scores (several keys whose every head's relu is 0 score exactly 0) go to the earlier
    position, whatever S is: a stable sort, so the choice does not depend on the batch."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(topk, scores.shape[1])
    return indices[:, :k].to(torch.int32).masked_fill(values[:, :k] == float("-inf"), -1)


class TorchIndexer(Kernel):
    name = "torch"

    @staticmethod
    def forward(index_q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, offset: int,
                metadata: AttentionMetadata, topk: int) -> torch.Tensor:
        return topk_indices(index_scores_reference(index_q, weights, cache, offset, metadata), topk)


def token_sequences(metadata: AttentionMetadata) -> torch.Tensor:
    """[T] int32 on the device: the sequence of each token of the step (built once per step)."""
    key = "token_sequences"
    if key not in metadata.backend_scratch:
        q_lens = (metadata.query_start_loc_cpu[1:] - metadata.query_start_loc_cpu[:-1]).long()
        seqs = torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32), q_lens)
        metadata.backend_scratch[key] = to_device(seqs, metadata.query_start_loc.device)
    return metadata.backend_scratch[key]


if triton is not None:

    @triton.jit
    def _index_scores_kernel(index_q, weights, cache, scores, token_seq, block_tables, seq_lens, query_start_loc,
                             stride_qt, stride_qh, stride_wt, stride_st, stride_cache_block, stride_cache_slot,
                             stride_bt, offset, scale, first_token, HEADS: tl.constexpr, HEADS_P: tl.constexpr,
                             DIM: tl.constexpr, DIM_P: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
                             IEEE_DOT: tl.constexpr):
        row = tl.program_id(0)  # of this chunk's scores
        token = first_token + row
        tile = tl.program_id(1)
        seq = tl.load(token_seq + token)
        seq_len = tl.load(seq_lens + seq)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        pos = seq_len - q_len + (token - q_start)  # this token's position
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)
        if tile * TILE_N < seq_len:
            heads = tl.arange(0, HEADS_P)
            dims = tl.arange(0, DIM_P)
            head_valid = heads < HEADS
            dim_valid = dims < DIM
            q = tl.load(index_q + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                        mask=head_valid[:, None] & dim_valid[None, :], other=0.0)  # [HEADS_P, DIM_P]
            w = tl.load(weights + token * stride_wt + heads, mask=head_valid, other=0.0).to(tl.float32)
            key_valid = key_pos < seq_len
            page = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_valid, other=0)
            slot = page.to(tl.int64) * stride_cache_block + (key_pos % PAGE) * stride_cache_slot
            # An FP8 cache's keys in the queries' dtype (a no-op for a cache in the model dtype).
            k = tl.load(cache + slot[:, None] + offset + dims[None, :], mask=key_valid[:, None] & dim_valid[None, :],
                        other=0.0).to(q.dtype)  # [TILE_N, DIM_P]
            if IEEE_DOT:
                dots = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                dots = tl.dot(q, tl.trans(k)).to(tl.float32)
            per_head = tl.maximum(dots * scale, 0.0)  # [HEADS_P, TILE_N]
            index = tl.sum(per_head * w[:, None], axis=0)  # [TILE_N]
            index = tl.where(key_pos <= pos, index, float("-inf"))
            tl.store(scores + row * stride_st + key_pos, index, mask=key_valid)


class TritonIndexer(TritonKernel):
    family = "mla_indexer"
    # Scores are held for at most this many (token, key) pairs at once (256 MB of float32): a long
    # prefill chunk over a long context is scored and reduced to its top-k a slice of tokens at a time.
    max_scores = 1 << 26

    @classmethod
    def forward(cls, index_q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, offset: int,
                metadata: AttentionMetadata, topk: int) -> torch.Tensor:
        tokens, heads, dim = index_q.shape
        longest = metadata.max_seq_len
        tile_n = 16
        rows = max(1, cls.max_scores // longest)  # tokens per slice
        chosen = []
        for first in range(0, tokens, rows):
            count = min(rows, tokens - first)
            scores = torch.full((count, longest), float("-inf"), dtype=torch.float32, device=index_q.device)
            _index_scores_kernel[(count, triton.cdiv(longest, tile_n))](
                index_q, weights, cache, scores, token_sequences(metadata), metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, index_q.stride(0), index_q.stride(1), weights.stride(0), scores.stride(0),
                cache.stride(0), cache.stride(1), metadata.block_tables.stride(0), offset, dim ** -0.5, first,
                HEADS=heads, HEADS_P=max(16, next_power_of_2(heads)), DIM=dim, DIM_P=max(16, next_power_of_2(dim)),
                PAGE=cache.shape[1], TILE_N=tile_n, IEEE_DOT=index_q.dtype == torch.float32)
            chosen.append(topk_indices(scores, topk))
        if not chosen:
            return torch.empty(0, min(topk, longest), dtype=torch.int32, device=index_q.device)
        return torch.cat(chosen)

    @classmethod
    def cannot_implement_reason(cls, **_: Any) -> str | None:
        return None
