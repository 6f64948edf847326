"""OLMo 2 and OLMo 3 (`Olmo2ForCausalLM`, `Olmo3ForCausalLM`: AI2's open models).

Against the Llama decoder: no norm before a block; each block's output is normalised and then
added to the residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`); queries
and keys are normalised over all of a token's heads at once (RMSNorm of width heads x head_dim,
before RoPE); every RMSNorm scales in float32 and rounds once, as transformers' Olmo2RMSNorm does
(so the weights are held in float32). OLMo 3 adds a sliding window on the layers `layer_types`
marks. Under tensor parallelism the q/k norms add each rank's sum of squares (an all-reduce of one
value a token), counting a replicated KV head once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.distributed.parallel_state import tp_all_reduce, tp_world_size
from baryon.layers.attention import Attention
from baryon.layers.embedding import VocabParallelEmbedding
from baryon.layers.linear import QKVParallelLinear, RowParallelLinear, copy_checked
from baryon.layers.mlp import GatedMLP
from baryon.layers.norm import RMSNorm
from baryon.layers.rotary import get_rope
from baryon.models.llama import LlamaForCausalLM, head_dim_of, layer_type_of, sliding_window_of


class HeadsRMSNorm(nn.Module):
    """RMSNorm over all of a token's query (or key) heads, this rank holding some of them: weight
    [local_width] float32, this rank's slice (`shard`: index and count of the checkpoint's equal
    slices); `replicas`: ranks holding each of these heads (KV heads replicated past their count)."""

    def __init__(self, local_width: int, total_width: int, eps: float, shard: tuple[int, int], replicas: int) -> None:
        super().__init__()
        self.total_width, self.eps, self.replicas = total_width, eps, replicas
        self.weight = nn.Parameter(torch.ones(local_width, dtype=torch.float32), requires_grad=False)
        index, slices = shard
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param.data, loaded.chunk(slices)[index].float())
        self.weight.expected_shards = frozenset([None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, local_width] -> normalised over the whole width, in x's dtype."""
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)  # [num_tokens, 1]
        if tp_world_size() > 1:
            squares = tp_all_reduce(squares) / self.replicas
        return (self.weight * (x32 * torch.rsqrt(squares / self.total_width + self.eps))).to(x.dtype)


class Olmo2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = get_rope(config, head_dim, layer_type_of(config, layer_idx))
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads, scale=head_dim ** -0.5,
                              sliding_window=sliding_window_of(config, layer_idx))
        qkv = self.qkv_proj
        self.q_norm = HeadsRMSNorm(qkv.q_size, heads * head_dim, config.rms_norm_eps, qkv.shard_span("q")[2:], 1)
        self.k_norm = HeadsRMSNorm(qkv.kv_size, kv_heads * head_dim, config.rms_norm_eps, qkv.shard_span("k")[2:],
                                   qkv.kv_replicas)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qkv[:, :q_size] = self.q_norm(qkv[:, :q_size])
        qkv[:, q_size:q_size + kv_size] = self.k_norm(qkv[:, q_size:q_size + kv_size])
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb))


def _post_norm(config: Any) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, weight_dtype=torch.float32)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act=config.hidden_act)
        self.post_attention_layernorm = _post_norm(config)  # on the attention's output
        self.post_feedforward_layernorm = _post_norm(config)  # on the MLP's output

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: the residual stream [num_tokens, hidden] -> the stream after this layer."""
        hidden_states = hidden_states + self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


class Olmo2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _post_norm(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        return Olmo2Model(config)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's layers, windowed where `layer_types` says `sliding_attention`."""
