"""DeepSeek-V3.2's lightning indexer: which cached keys each new token's sparse attention reads
(the torch reference).

Each layer caches one index key per token (I values, after the latent in the cache row, see
mla_backend.py). A new token at position p scores every visible key t <= p as

    index[t] = sum_h w[h] * relu(q_index[h] . k_index[t] / sqrt(I))       w = weights_proj(x) / sqrt(heads)

and attends to the `topk` best (all of them while p + 1 <= topk: then it is dense attention).
"""

from __future__ import annotations

import torch

from baryon.kernels.attention.metadata import AttentionMetadata


def select_keys_reference(index_q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, offset: int,
                          metadata: AttentionMetadata, topk: int) -> list[torch.Tensor]:
    """index_q [T, heads, I] (rotated), weights [T, heads] float32 (already divided by sqrt(heads)),
    cache [num_blocks, block_size, row] with index keys in columns [offset, offset + I) -> per
    sequence a [q_len, seq_len] bool mask of the selected keys."""
    index_dim = index_q.shape[-1]
    block_size = cache.shape[1]
    starts = metadata.query_start_loc_cpu.tolist()
    masks = []
    for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        start, end = starts[i], starts[i + 1]
        blocks = metadata.block_tables[i, : -(-seq_len // block_size)].long()
        keys = cache.index_select(0, blocks).view(-1, cache.shape[-1])[:seq_len, offset: offset + index_dim]
        scores = torch.relu(torch.einsum("qhd,sd->qhs", index_q[start:end].float(), keys.float()) * index_dim ** -0.5)
        index = torch.einsum("qh,qhs->qs", weights[start:end].float(), scores)  # [q, S]
        positions = torch.arange(seq_len - (end - start), seq_len, device=index.device)
        visible = torch.arange(seq_len, device=index.device)[None, :] <= positions[:, None]
        index = index.masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(topk, seq_len), dim=-1).indices  # [q, k]
        masks.append(torch.zeros_like(visible).scatter_(1, chosen, True) & visible)
    return masks
