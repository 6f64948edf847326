"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 with sparse attention. Each layer's lightning
indexer scores the cached tokens for every new token and attention reads only the `index_topk`
best (kernels/attention/mla_indexer.py); up to `index_topk` visible tokens that is dense attention.

Indexer (per layer; `index_n_heads` heads of `index_head_dim` I):
    queries   wq_b on the query LoRA activations (q_a_layernorm(q_a_proj(x))): [T, heads, I]
    keys      k_norm (LayerNorm) of wk(x): [T, I], cached after the latent in the layer's cache row
    rotary    NeoX-style on the first qk_rope_head_dim features of both (the main attention's
              pairs are interleaved; the indexer's are not)
    weights   weights_proj(x) / sqrt(heads): [T, heads]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.kernels.rotary import rotate_neox
from baryon.layers.linear import ReplicatedLinear
from baryon.layers.norm import LayerNorm
from baryon.models.deepseek_v2 import DeepseekV2Attention, DeepseekV3ForCausalLM

INDEX_NORM_EPS = 1e-6


class Indexer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, INDEX_NORM_EPS)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads, bias=False)
        self.weights_proj.quantizable = False  # float in the published FP8 checkpoint (wq_b and wk are FP8)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, I]: the first rope_dim features rotated (NeoX), the rest as they are."""
        return torch.cat((rotate_neox(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim:]), dim=-1)

    def forward(self, hidden_states: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (queries [T, heads, I], keys [T, I], head weights [T, heads] float32)."""
        tokens = hidden_states.shape[0]
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R / 2]
        q = self._rotate(self.wq_b(q_lora).view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = self._rotate(self.k_norm(self.wk(hidden_states)).unsqueeze(1), cos, sin).squeeze(1)
        weights = self.weights_proj(hidden_states).float() * self.num_heads ** -0.5
        return q, k, weights


class DeepseekV32Attention(DeepseekV2Attention):
    def __init__(self, config: Any) -> None:
        if config.q_lora_rank is None:
            raise ValueError("DeepSeek-V3.2 needs q_lora_rank (its indexer reads the query LoRA activations)")
        super().__init__(config, interleaved_rope=True, index_head_dim=config.index_head_dim,
                         index_topk=config.index_topk)
        self.indexer = Indexer(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden_states [T, hidden] -> [T, hidden]."""
        tokens = hidden_states.shape[0]
        q_lora = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [T, q_lora_rank]
        q = self.q_b_proj(q_lora).view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        kv_a = self.kv_a_proj_with_mqa(hidden_states)  # [T, L + R]
        cos_sin = self.rotary_emb.cos_sin_cache
        index = self.indexer(hidden_states, q_lora, positions, cos_sin)
        out = self.attn(q, kv_a, positions, cos_sin, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, index)
        return self.o_proj(out)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        return DeepseekV32Attention(config)
