"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention
and DeepSeek's mixture of experts on the Llama decoder skeleton.

Attention (per layer; H heads, nope / rope / value head dims Dn, R, V, latent rank L):

    queries   q_proj (V2-Lite: `q_lora_rank` null), or q_a_proj -> q_a_layernorm -> q_b_proj:
              [T, H, Dn + R] = q_nope | q_pe
    latent    kv_a_proj_with_mqa: [T, L + R] = c_kv | k_pe; c_kv through kv_a_layernorm; k_pe one
              rope key shared by all heads
    rotary    on q_pe and k_pe only: DeepSeek pairs adjacent features (x0, x1), (x2, x3) ... (V2
              always, V3 when `rope_interleave`); each pair is rotated and written de-interleaved,
              the same for queries and keys, so the scores equal the pairwise rotation's
    scale     (Dn + R) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN
    cache     c_kv | k_pe: L + R values per token (layers/mla_attention.py)

MoE: layers from `first_k_dense_replace` on (every `moe_layer_freq`-th) hold routed experts plus
`n_shared_experts` shared ones; V2 routes by softmax, `greedy` or `group_limited_greedy` (group score
= its best expert); V3 by sigmoid with `e_score_correction_bias` and grouped top-k (group score =
its best two). Weights renormalised when `norm_topk_prob`, then times `routed_scaling_factor`.
The multi-token-prediction layers past `num_hidden_layers` are not loaded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from baryon.distributed.parallel_state import divide, tp_world_size
from baryon.kernels.moe.routing import RoutingConfig
from baryon.layers.fused_moe.block import SparseMoeBlock
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.fused_moe.router import Router
from baryon.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from baryon.layers.mla_attention import MLAAttention
from baryon.layers.mlp import GatedMLP
from baryon.layers.norm import RMSNorm
from baryon.layers.rotary import get_rope, rope_parameters
from baryon.models.llama import LlamaForCausalLM
from baryon.models.qwen3_moe import GATE_UP_DOWN

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (not rms_norm_eps), as DeepSeek builds them


def softmax_scale(config: Any) -> float:
    """(Dn + R) ** -0.5, corrected under YaRN by mscale(factor, mscale_all_dim) squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, config: Any, interleaved_rope: bool, index_head_dim: int = 0, index_topk: int = 0) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        bias = bool(getattr(config, "attention_bias", False))
        q_dim = heads * (self.nope_dim + self.rope_dim)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_dim, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = get_rope(config, self.rope_dim)
        self.num_heads = divide(heads, tp_world_size(), "num_attention_heads")  # this rank's
        self.attn = MLAAttention(self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank,
                                 softmax_scale(config), interleaved_rope, index_head_dim, index_topk)

    def after_weights_loaded(self) -> None:
        self.attn.absorb(self.kv_b_proj.method.dequantize(self.kv_b_proj))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden_states [T, hidden] -> [T, hidden]."""
        tokens = hidden_states.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, Dn + R]
        kv_a = self.kv_a_proj_with_mqa(hidden_states)  # [T, L + R] = c_kv | k_pe
        out = self.attn(q, kv_a, positions, self.rotary_emb.cos_sin_cache, self.kv_a_layernorm.weight,
                        self.kv_a_layernorm.eps)  # [T, H * V]
        return self.o_proj(out)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}  # q_proj is not fused
    expert_projections = GATE_UP_DOWN
    extra_layers_config_key = "num_nextn_predict_layers"

    @staticmethod
    def interleaved_rope(config: Any) -> bool:
        return True  # V2 rotates adjacent pairs (complex multiplication)

    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        return DeepseekV2Attention(config, cls.interleaved_rope(config))

    @staticmethod
    def routing(config: Any) -> tuple[RoutingConfig, bool]:
        """(routing, whether the router has a correction bias)."""
        method = getattr(config, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported; supported: "
                             f"'greedy', 'group_limited_greedy'")
        grouped = method == "group_limited_greedy"
        routing = RoutingConfig(config.n_routed_experts, config.num_experts_per_tok,
                                renormalize=bool(getattr(config, "norm_topk_prob", False)) and config.num_experts_per_tok > 1,
                                num_groups=(config.n_group or 1) if grouped else 1,
                                topk_group=(config.topk_group or 1) if grouped else 1,
                                routed_scaling_factor=float(config.routed_scaling_factor))
        return routing, False

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        freq = getattr(config, "moe_layer_freq", 1) or 1
        if layer_idx < (config.first_k_dense_replace or 0) or layer_idx % freq:
            return GatedMLP(config.hidden_size, config.intermediate_size)
        experts, top_k, inter = config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size
        routing, bias = cls.routing(config)
        router = Router(config.hidden_size, routing, correction_bias=bias, float32_logits=True)
        shared = None
        if getattr(config, "n_shared_experts", 0):
            shared = GatedMLP(config.hidden_size, inter * config.n_shared_experts, reduce_results=False)
        return SparseMoeBlock(router, FusedMoE(experts, top_k, config.hidden_size, inter), shared)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def interleaved_rope(config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))

    @staticmethod
    def routing(config: Any) -> tuple[RoutingConfig, bool]:
        method = getattr(config, "topk_method", "noaux_tc") or "noaux_tc"
        if method != "noaux_tc":
            raise ValueError(f"DeepSeek-V3 topk_method {method!r} is not supported; supported: 'noaux_tc'")
        routing = RoutingConfig(config.n_routed_experts, config.num_experts_per_tok,
                                renormalize=bool(config.norm_topk_prob), scoring="sigmoid",
                                num_groups=config.n_group or 1, topk_group=config.topk_group or 1,
                                routed_scaling_factor=float(config.routed_scaling_factor))
        return routing, True
