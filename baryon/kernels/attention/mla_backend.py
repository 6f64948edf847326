"""Multi-head latent attention (DeepSeek V2 / V3) over a paged latent cache: the
backend interface and the cache write (family `mla_attention`).

The cache of one layer holds, per token, only the normalised latent c_kv (kv_lora_rank = L values)
and the rotated shared rope key k_pe (R values), in the model dtype or, with kv_cache_dtype="fp8",
as float8_e4m3fn: the values as they are (no scale: the normalised latent and the rotated key stay
far inside e4m3's range; so do DeepSeek-V3.2's LayerNorm-ed index keys), clamped to +-448, rounded
to nearest even; the kernels convert them back to the queries' dtype as they load them:

    cache [num_blocks, block_size, L + R (+ I)]   cache[b, o] = cat(c_kv, k_pe) of slot b * block_size + o
                                                  (DeepSeek-V3.2: then its I-value index key)

Attention runs in the weight-absorbed form. With W_UK [H, Dn, L] and W_UV [H, V, L] the key and
value halves of kv_b_proj, head h's score of key s is

    q_nope[h] . (W_UK[h] c_kv[s]) + q_pe[h] . k_pe[s] = (W_UK[h]^T q_nope[h]) . c_kv[s] + q_pe[h] . k_pe[s]

so a query enters as q_latent = W_UK^T q_nope [H, L] beside q_pe [H, R], every head reads the same
L + R values per key (one "KV head" shared by all query heads), and the output in latent space
sum_s p[h, s] c_kv[s] [H, L] is mapped to values by W_UV afterwards (by the caller).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.selector import Kernel

FP8_MAX = 448.0


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, offset: int = 0) -> None:
    """latent [num_tokens, W] into columns [offset, offset + W) of cache [num_blocks, block_size,
    row] at slot_mapping [num_tokens] (-1: not stored): c_kv | k_pe at 0, DeepSeek-V3.2's index
    keys after them."""
    flat = cache.view(-1, cache.shape[-1])[:, offset: offset + latent.shape[-1]]  # [num_blocks * block_size, W]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, latent = slot_mapping[keep], latent[keep]
    if flat.dtype == torch.float8_e4m3fn:  # saturated as the GPU's conversion does (torch's gives NaN);
        latent = latent.float().clamp(-FP8_MAX, FP8_MAX).to(flat.dtype)  # copied as bytes (no fp8 index_copy on CPU)
        flat.view(torch.uint8).index_copy_(0, slot_mapping, latent.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, latent.to(flat.dtype))


def sequence_rows(cache: torch.Tensor, metadata: AttentionMetadata, seq: int, seq_len: int) -> torch.Tensor:
    """The cache rows of sequence `seq`'s first seq_len tokens, in order: [seq_len, row] (a gather
    through its block table; for the torch references)."""
    blocks = metadata.block_tables[seq, : -(-seq_len // cache.shape[1])].long()
    return cache.index_select(0, blocks).view(-1, cache.shape[-1])[:seq_len]


class MLABackend(Kernel):
    """One instance per MLA layer. forward(q_latent, q_pe, cache, metadata) -> [T, H, L]; the
    caller has stored the step's latents first (the mla_prologue kernel, or `store_latent`)."""

    cuda_graph_safe: ClassVar[bool] = False

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.scale = num_heads, kv_lora_rank, rope_dim, scale

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def forward_sparse(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                       metadata: AttentionMetadata, indices: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3.2: each token attends only to the keys at indices [T, K] (positions in its
        sequence, -1 for none; mla_indexer.py chooses them) -> [T, H, L]."""
        raise NotImplementedError
