"""GPT-OSS (`GptOssForCausalLM`): the Llama skeleton with

- attention with biases and a learned sink logit per head (a softmax term that takes probability
  but adds no value), sliding-window and full layers as `layer_types` says, YaRN RoPE;
- a mixture of experts in every layer: a router with a bias (softmax over the top-k logits),
  experts with biases and the clamped SwiGLU (`swiglu_limit`, alpha 1.702), published as one
  tensor per layer for all experts (`experts.gate_up_proj` [E, H, 2I] with gate and up columns
  interleaved, `experts.down_proj` [E, I, H], their biases) or, MXFP4-quantized, as
  `*_blocks` [E, N, K / 32, 16] / `*_scales` [E, N, K / 32] (rows = output features).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.distributed.parallel_state import tp_rank
from baryon.kernels.moe.expert_activation import ExpertActivation
from baryon.kernels.moe.routing import RoutingConfig
from baryon.layers.attention import Attention
from baryon.layers.fused_moe.block import SparseMoeBlock
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.layers.linear import QKVParallelLinear, RowParallelLinear, copy_checked
from baryon.layers.rotary import get_rope
from baryon.models.llama import LlamaForCausalLM, head_dim_of, sliding_window_of

# Not in every config (the published one has swiglu_limit only): the reference implementation's values.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


class GptOssAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.rotary_emb = get_rope(config, head_dim)
        heads = self.qkv_proj.num_heads  # this rank's
        # [heads] float32 sink logits, this rank's slice of the published [num_attention_heads]
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param.data, loaded.narrow(0, tp_rank() * heads, heads) if loaded.shape[0] != heads else loaded)
        self.sinks.expected_shards = frozenset([None])
        self.attn = Attention(heads, head_dim, self.qkv_proj.num_kv_heads, scale=head_dim ** -0.5,
                              sliding_window=sliding_window_of(config, layer_idx), sinks=self.sinks)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb))


def _gate_up_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up rows interleaved (gate first) -> gate rows, then up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOssForCausalLM(LlamaForCausalLM):
    weights_mapping = {".mlp.router.": ".mlp.gate."}
    stacked_expert_tensors = {
        "gate_up_proj": ("w13_weight", lambda t: _gate_up_rows(t.transpose(1, 2))),  # [E, H, 2I] -> [E, 2I, H]
        "gate_up_proj_bias": ("w13_bias", _gate_up_rows),
        "gate_up_proj_blocks": ("w13_blocks", lambda t: _gate_up_rows(t.flatten(-2))),  # -> [E, 2I, H / 2]
        "gate_up_proj_scales": ("w13_scales", _gate_up_rows),
        "down_proj": ("w2_weight", lambda t: t.transpose(1, 2)),  # [E, I, H] -> [E, H, I]
        "down_proj_bias": ("w2_bias", None),
        "down_proj_blocks": ("w2_blocks", lambda t: t.flatten(-2)),  # -> [E, H, I / 2]
        "down_proj_scales": ("w2_scales", None),
    }

    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        return GptOssAttention(config, layer_idx)

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        router = Router(config.hidden_size, RoutingConfig(experts, top_k, renormalize=True), bias=True)
        activation = ExpertActivation("clamped_swiglu", getattr(config, "swiglu_alpha", SWIGLU_ALPHA),
                                      getattr(config, "swiglu_limit", SWIGLU_LIMIT))
        return SparseMoeBlock(router, FusedMoE(experts, top_k, config.hidden_size, config.intermediate_size,
                                               bias=True, activation=activation))
