"""Multi-head latent attention in plain torch (the `torch` kernel of family `mla_attention`): the
reference every faster MLA backend is tested against. The cache layout and the absorbed form are
described in mla_backend.py. Runs on CPU and GPU; not capturable in CUDA graphs (it loops over
sequences on the host)."""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.mla_backend import MLABackend, sequence_rows


def mla_attention_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                            metadata: AttentionMetadata, scale: float,
                            selected: list[torch.Tensor] | None = None) -> torch.Tensor:
    """q_latent [T, H, L], q_pe [T, H, R], cache [num_blocks, block_size, L + R (+ I)] -> [T, H, L]
    in q_latent's dtype: for each sequence, its new tokens attend causally over its cached prefix
    and themselves (float32 scores, softmax and sum). selected (sparse attention, DeepSeek-V3.2):
    per sequence a [q_len, seq_len] bool mask of the keys each new token may attend to."""
    kv_lora_rank, rope_dim = q_latent.shape[-1], q_pe.shape[-1]
    out = torch.empty_like(q_latent)
    starts = metadata.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        keys = sequence_rows(cache, metadata, i, seq_len).float()  # [S, row]
        c_kv, k_pe = keys[:, :kv_lora_rank], keys[:, kv_lora_rank: kv_lora_rank + rope_dim]
        scores = (torch.einsum("thl,sl->ths", q_latent[start:end].float(), c_kv)
                  + torch.einsum("thr,sr->ths", q_pe[start:end].float(), k_pe)) * scale  # [q, H, S]
        positions = torch.arange(seq_len - (end - start), seq_len, device=scores.device)  # of the queries
        visible = torch.arange(seq_len, device=scores.device)[None, :] <= positions[:, None]  # [q, S]
        if selected is not None:
            visible = visible & selected[i]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[start:end] = torch.einsum("ths,sl->thl", scores.softmax(dim=-1), c_kv).to(out.dtype)
    return out


def mla_sparse_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, indices: torch.Tensor) -> torch.Tensor:
    """Attention over the keys in indices [T, K] (positions in each token's sequence; -1: none)."""
    starts = metadata.query_start_loc_cpu.tolist()
    selected = []
    for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        chosen = indices[starts[i]: starts[i + 1]].long()
        chosen = torch.where(chosen < 0, seq_len, chosen)  # -1 -> a spare column, dropped below
        mask = torch.zeros(chosen.shape[0], seq_len + 1, dtype=torch.bool, device=indices.device)
        selected.append(mask.scatter_(1, chosen, True)[:, :seq_len])
    return mla_attention_reference(q_latent, q_pe, cache, metadata, scale, selected)


class TorchMLAAttention(MLABackend):
    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, **config: Any) -> str | None:
        return None

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return mla_attention_reference(q_latent, q_pe, cache, metadata, self.scale)

    def forward_sparse(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                       metadata: AttentionMetadata, indices: torch.Tensor) -> torch.Tensor:
        return mla_sparse_reference(q_latent, q_pe, cache, metadata, self.scale, indices)
