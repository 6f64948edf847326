"""Qwen3-Next and Qwen3.5: hybrid decoders of Gated DeltaNet (linear attention) and gated full
attention layers, per `layer_types` (three linear layers to one full one in the published models).

- Linear-attention layers: layers/gated_delta_net.py. Qwen3-Next publishes their input
  projections interleaved per key head (`in_proj_qkvz`: each key head's q, k, its value heads' v
  and z; `in_proj_ba`: its value heads' b and a), de-interleaved here as they load; Qwen3.5
  publishes them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
- Full-attention layers: Qwen3's attention (per-head q/k norms, here of 1 + weight) whose query
  projection also gives an output gate (each head's rows: its queries, then its gate), applied as
  sigmoid(gate) * attention output before o_proj; partial RoPE (`partial_rotary_factor` 0.25).
- Every RMSNorm of the residual stream multiplies by 1 + weight (as Gemma's).
- Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's sparse block (softmax top-k, a shared expert scaled by
  sigmoid(shared_expert_gate)); Qwen3.5: dense gated MLPs.

The checkpoints' multi-token-prediction layers (`mtp.*`) are skipped here; they load as a draft
model of their own (models/qwen3_next_mtp.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baryon.kernels.moe.routing import RoutingConfig
from baryon.layers.attention import Attention
from baryon.layers.fused_moe.router import Router
from baryon.layers.gated_delta_net import GatedDeltaNet
from baryon.layers.linear import QKVParallelLinear, RowParallelLinear
from baryon.layers.mlp import GatedMLP
from baryon.layers.rotary import get_rope
from baryon.models.gemma2 import GemmaRMSNorm
from baryon.models.image_text import ReadsImages
from baryon.models.llama import LlamaForCausalLM, LlamaModel, head_dim_of, layer_type_of
from baryon.models.qwen2_moe import shared_expert_block
from baryon.models.qwen3_moe import GATE_UP_DOWN, is_sparse_layer, softmax_router

# The linear-attention layers' tensors load into the decoder layer's token mixer (`self_attn`).
_LINEAR_ATTENTION_NAMES = {".linear_attn.conv1d.weight": ".self_attn.conv_weight",
                           ".linear_attn.norm.weight": ".self_attn.norm_weight",
                           ".linear_attn.": ".self_attn."}


class GatedAttention(nn.Module):
    """Full attention with an output gate from the query projection."""

    output_gate = True  # (the C++ decoder layer, which has no gate, passes over it)

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        # The query projection holds 2 x num_heads "heads": each head's queries, then its gate.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, 2 * config.num_attention_heads,
                                          num_kv_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = get_rope(config, head_dim, layer_type_of(config, layer_idx))
        self.attn = Attention(self.num_heads, head_dim, self.qkv_proj.num_kv_heads, scale=head_dim ** -0.5)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [T, 2 heads hd + 2 kv_heads hd]
        q_size = self.num_heads * self.head_dim
        query_gate = qkv[:, :2 * q_size].view(tokens, self.num_heads, 2, self.head_dim)
        gate = query_gate[:, :, 1].reshape(tokens, q_size)  # [T, heads hd]
        packed = torch.cat((query_gate[:, :, 0].reshape(tokens, q_size), qkv[:, 2 * q_size:]), dim=1)  # [T, q | k | v]
        attended = self.attn.forward_qkv(packed, positions, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(attended * torch.sigmoid(gate))


def linear_attention(config: Any) -> GatedDeltaNet:
    return GatedDeltaNet(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                         config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                         config.rms_norm_eps)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    expert_projections = GATE_UP_DOWN
    weights_mapping = _LINEAR_ATTENTION_NAMES
    skipped_checkpoint_prefixes = ("mtp.",)

    @staticmethod
    def fused_checkpoint_parts(config: Any) -> dict:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        heads = config.linear_num_value_heads
        return {"in_proj_qkvz": [(0, key_dim), (1, key_dim), (2, value_dim), (3, value_dim)],
                "in_proj_ba": [(0, heads), (1, heads)]}

    @staticmethod
    def checkpoint_converters(config: Any) -> dict:
        """The interleaved projections -> q | k | v | z and b | a, each in head order."""
        groups = config.linear_num_key_heads
        group = config.linear_num_value_heads // groups  # value heads per key head
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim

        def qkvz(weight: torch.Tensor) -> torch.Tensor:  # [groups (2 dk + 2 group dv), hidden]
            parts = weight.reshape(groups, 2 * dk + 2 * group * dv, -1).split([dk, dk, group * dv, group * dv], dim=1)
            return torch.cat([p.reshape(-1, weight.shape[-1]) for p in parts])

        def ba(weight: torch.Tensor) -> torch.Tensor:  # [groups 2 group, hidden]
            parts = weight.reshape(groups, 2 * group, -1).split([group, group], dim=1)
            return torch.cat([p.reshape(-1, weight.shape[-1]) for p in parts])

        return {"in_proj_qkvz": qkvz, "in_proj_ba": ba}

    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        return LlamaModel(config, cls.build_attention, cls.build_mlp, norm=GemmaRMSNorm)

    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        if layer_type_of(config, layer_idx) == "linear_attention":
            return linear_attention(config)
        return GatedAttention(config, layer_idx)

    @staticmethod
    def router(config: Any) -> Router:
        return softmax_router(config)

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        if getattr(config, "num_experts", 0) and is_sparse_layer(config, layer_idx):  # (Qwen3.5 has no num_experts)
            return shared_expert_block(config, cls.router(config))
        return GatedMLP(config.hidden_size, config.intermediate_size)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):  # noqa: N801 (the checkpoint's name)
    """Qwen3.5's text decoder: the projections published apart (`in_proj_qkv` holds q | k | v,
    cut into its parts as it loads); dense MLPs (Qwen3.5-MoE: experts in every layer)."""

    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping,
                              "in_proj_qkvz": [("in_proj_z", 3)],
                              "in_proj_ba": [("in_proj_b", 0), ("in_proj_a", 1)]}
    weights_mapping = {".in_proj_qkv.": ".in_proj_qkvz.", **_LINEAR_ATTENTION_NAMES}

    @staticmethod
    def fused_checkpoint_parts(config: Any) -> dict:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        return {"in_proj_qkvz": [(0, key_dim), (1, key_dim), (2, value_dim)]}

    @staticmethod
    def checkpoint_converters(config: Any) -> dict:
        return {}


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):  # noqa: N801
    """Qwen3.5-MoE: its router always renormalises the top-k probabilities (no norm_topk_prob)."""

    @staticmethod
    def router(config: Any) -> Router:
        return Router(config.hidden_size, RoutingConfig(config.num_experts, config.num_experts_per_tok,
                                                        renormalize=True))


class Qwen3_5ForConditionalGeneration(ReadsImages, Qwen3_5ForCausalLM):  # noqa: N801
    """The image-and-text checkpoint: Qwen3-VL's vision tower (without DeepStack) and multimodal
    RoPE (on the gated attention layers' rotary part) beside the hybrid decoder."""

    weights_mapping = {"model.language_model.": "model.", "model.visual.": "visual.",
                       **Qwen3_5ForCausalLM.weights_mapping}
    default_mrope_section = (11, 11, 10)
    deepstack = False


class Qwen3_5MoeForConditionalGeneration(ReadsImages, Qwen3_5MoeForCausalLM):  # noqa: N801
    """The image-and-text MoE checkpoint."""

    weights_mapping = Qwen3_5ForConditionalGeneration.weights_mapping
    default_mrope_section = Qwen3_5ForConditionalGeneration.default_mrope_section
    deepstack = False
