"""The multi-head latent attention layer (DeepSeek V2 / V3): the prologue (kernels/mla_prologue.py:
kv_a_layernorm, RoPE on the rope parts, the latent-cache write; one kernel on GPU), then attention
over the paged latent cache in the weight-absorbed form (kernels/attention/mla_backend.py).
DeepSeek-V3.2's sparse attention: the indexer kernel picks each token's keys
(kernels/attention/mla_indexer.py), the backend's forward_sparse attends to them.

Its cache is [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim (+ index_head_dim)]: one
latent of L values and one shared rope key of R values per token, for all heads, where standard
attention would keep 2 x heads x head_dim (V3.2: then the token's index key). The up-projection kv_b_proj (L -> heads x (Dn + V)) is split after loading
into W_UK [H, Dn, L], folded into the queries, and W_UV [H, V, L], applied to the latent output.
"""

from __future__ import annotations

import torch

from baryon.kernels.attention.mla_backend import store_latent
from baryon.kernels.selector import select
from baryon.layers.attention import PagedKVLayer
from baryon.layers.forward_context import current_attn_metadata


class MLAAttention(PagedKVLayer):
    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, interleaved_rope: bool, index_head_dim: int = 0,
                 index_topk: int = 0) -> None:
        """index_head_dim / index_topk (DeepSeek-V3.2): each token's index key is cached after its
        latent, and every new token attends only to the index_topk keys its indexer scores best."""
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.interleaved_rope = interleaved_rope
        self.index_head_dim, self.index_topk = index_head_dim, index_topk
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        backend = select("mla_attention", device, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                         rope_dim=qk_rope_head_dim, dtype=dtype)
        self.backend = backend(num_heads, kv_lora_rank, qk_rope_head_dim, scale)
        self.indexer = select("mla_indexer", device, dtype=dtype) if index_head_dim else None
        self.prologue = select("mla_prologue", device, rope_dim=qk_rope_head_dim, dtype=dtype)
        self.kv_cache: torch.Tensor | None = None  # bound by the runner
        # Set by absorb() once kv_b_proj has loaded (not checkpoint tensors: derived from it).
        self.register_buffer("w_uk", torch.empty(num_heads, qk_nope_head_dim, kv_lora_rank), persistent=False)
        self.register_buffer("w_uv", torch.empty(num_heads, v_head_dim, kv_lora_rank), persistent=False)

    @property
    def cuda_graph_safe(self) -> bool:
        # The sparse path sizes its selection by the step's longest sequence: not capturable yet.
        return self.backend.cuda_graph_safe and self.indexer is None

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.rope_dim + self.index_head_dim)

    @torch.no_grad()
    def absorb(self, kv_b_weight: torch.Tensor) -> None:
        """kv_b_weight: kv_b_proj's weight as floats, [H * (Dn + V), L] (this rank's heads)."""
        expected = (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        if tuple(kv_b_weight.shape) != expected:
            raise ValueError(f"kv_b_proj weight must be {expected}, got {tuple(kv_b_weight.shape)}")
        per_head = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk = per_head[:, : self.qk_nope_head_dim].to(self.w_uk.dtype).contiguous()  # [H, Dn, L]
        self.w_uv = per_head[:, self.qk_nope_head_dim:].to(self.w_uv.dtype).contiguous()  # [H, V, L]

    def forward(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                norm_weight: torch.Tensor, eps: float,
                index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, Dn + R] (its rope part rotated in place), kv_a [T, L + R] (c_kv | k_pe as
        projected: normalised, rotated and cached here), positions [T] -> [T, H * V]. index
        (DeepSeek-V3.2): the indexer's rotated queries [T, heads, I], its rotated, normalised keys
        [T, I] (cached here) and its head weights [T, heads] float32."""
        metadata = current_attn_metadata()
        self.prologue.forward(q, kv_a, positions, cos_sin_cache, norm_weight, eps, self.kv_cache,
                              metadata.slot_mapping, self.qk_nope_head_dim, self.interleaved_rope)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.rope_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, L]
        if index is None:
            out_latent = self.backend.forward(q_latent, q_pe, self.kv_cache, metadata)  # [T, H, L]
        else:
            index_q, index_k, weights = index
            offset = self.kv_lora_rank + self.rope_dim
            store_latent(index_k, self.kv_cache, metadata.slot_mapping, offset)
            indices = self.indexer.forward(index_q, weights, self.kv_cache, offset, metadata, self.index_topk)
            out_latent = self.backend.forward_sparse(q_latent, q_pe, self.kv_cache, metadata, indices)
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv.transpose(1, 2))  # [H, T, V]
        return out.transpose(0, 1).reshape(q.shape[0], self.num_heads * self.v_head_dim)
