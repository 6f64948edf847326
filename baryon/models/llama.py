"""Llama-family decoder (Llama 2/3, Mistral; Qwen2 and Qwen3 are variants in their own files).

Module names mirror the Hugging Face checkpoint so weights load by name; q/k/v and gate/up are
fused (`packed_modules_mapping` tells the loader how checkpoint tensors map onto them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from baryon.distributed.parallel_state import dp_world_size, tp_settle_pushes, tp_world_size
from baryon.layers.attention import Attention
from baryon.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baryon.layers.linear import QKVParallelLinear, RowParallelLinear
from baryon.layers.mlp import GatedMLP
from baryon.layers.norm import RMSNorm
from baryon.layers.rotary import get_rope


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_type_of(config: Any, layer_idx: int) -> str:
    """The layer's kind by `layer_types` (`sliding_attention` / `full_attention`; the RoPE settings of
    Gemma 3 and OLMo 3 are per kind); full_attention where the config has none."""
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_idx] if layer_types else "full_attention"


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The layer's attention window: none where the config switches windows off
    (`use_sliding_window: false`: Qwen2/3, SmolLM3), else per `layer_types` when the config has
    them, otherwise `sliding_window` for every layer (Mistral), else None (full attention)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 scale: float | None = None) -> None:
        """scale: the softmax scale (None: head_dim^-0.5)."""
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = get_rope(config, head_dim)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              scale=head_dim ** -0.5 if scale is None else scale,
                              sliding_window=sliding_window_of(config, layer_idx))
        self.qk_norm = qk_norm
        if qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        if self.qk_norm:
            return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb, self.q_norm, self.k_norm))
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, norm: type[RMSNorm] = RMSNorm) -> None:
        """norm: the RMSNorm kind (Qwen3-Next's multiplies by 1 + weight)."""
        super().__init__()
        self.self_attn = attention  # LlamaAttention, DeepSeek's latent attention, or a linear-attention layer
        self.mlp = mlp  # a GatedMLP, or an MoE block in sparse layers
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        # The whole layer as one call where a kernel covers it (CPU: layers/fused_decoder_layer.py).
        self.fused: Callable | None = None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and not torch.compiler.is_compiling():
            return self.fused(positions, hidden_states, residual)
        return self.forward_modules(positions, hidden_states, residual)

    def forward_modules(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                        residual: torch.Tensor | None, streams: list[torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams: also append the residual stream entering the layer (hidden + residual, summed
        over the ranks: what the input norm adds up) to it (EAGLE-3's auxiliary states)."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if streams is not None:
            streams.append(residual.clone())  # (the norms after this one may update it in place)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    # EAGLE-3 target: the layers whose incoming hidden state (hidden + residual; id num_layers: the
    # last layer's output before the final norm) each forward leaves in `aux_hidden_states`,
    # concatenated in layer order [num_tokens, len(ids) * hidden]. Empty: nothing is collected.
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, config: Any, build_attention: Callable[[Any, int], nn.Module],
                 build_mlp: Callable[[Any, int], nn.Module], norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, build_attention(config, i), build_mlp(config, i), norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        if tp_world_size() > 1 or dp_world_size() > 1:
            self._reduce_in_norms()

    def _reduce_in_norms(self) -> None:
        """Tensor parallelism: the all-reduce that ends an attention or MLP / MoE block is left to
        the RMSNorm that follows it, which adds the ranks' parts, the residual and normalises in
        one call (one kernel for decode rows on GPUs: kernels/all_reduce_rms_norm.py). DP
        attention: the same for the MoE blocks' reduce-scatter (attention and dense MLPs are whole
        on every replica and reduce nothing)."""
        following = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        tensor_parallel = tp_world_size() > 1
        for layer, next_norm in zip(self.layers, following):
            if not tensor_parallel:
                if getattr(layer.mlp, "reduce_results", None) is True and hasattr(layer.mlp, "experts"):
                    layer.mlp.reduce_results = False
                    next_norm.reduces_input = True
                continue
            if isinstance(layer.self_attn, LlamaAttention):
                layer.self_attn.o_proj.reduce_results = False
                layer.self_attn.o_proj.pushes_partial = True
                layer.post_attention_layernorm.reduces_input = True
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.down_proj.reduce_results = False
                layer.mlp.down_proj.pushes_partial = True
                next_norm.reduces_input = True
            elif getattr(layer.mlp, "reduce_results", None) is True:  # the MoE blocks
                layer.mlp.reduce_results = False
                next_norm.reduces_input = True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [num_tokens] -> the first layer's input [num_tokens, hidden] (Granite scales it)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, embeddings: torch.Tensor | None = None,
                additions: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """embeddings: the first layer's input [num_tokens, hidden] in place of embed(input_ids)
        (an image prompt's, with its images' embeddings); additions: (rows [n], features [k, n,
        hidden]) added at those rows to the residual stream after layers 0 .. k-1 (Qwen3-VL's
        DeepStack)."""
        hidden_states, residual = self.embed(input_ids) if embeddings is None else embeddings, None
        # EAGLE-3's auxiliary states: the residual stream entering the chosen layers, as their input
        # norms return it (under tensor parallelism already summed over the ranks: no extra collective)
        aux = [] if self.aux_hidden_state_layers else None
        for i, layer in enumerate(self.layers):
            if aux is not None and i in self.aux_hidden_state_layers:
                hidden_states, residual = layer.forward_modules(positions, hidden_states, residual, aux)
            else:
                hidden_states, residual = layer(positions, hidden_states, residual)
            if additions is not None and i < len(additions[1]):
                # into the residual, which every rank holds whole (under tensor parallelism
                # hidden_states may still be this rank's part of a sum the next layer completes)
                residual = residual.index_add(0, additions[0], additions[1][i].to(residual.dtype))
        hidden_states, stream = self.norm(hidden_states, residual)
        if aux is not None:
            if len(self.layers) in self.aux_hidden_state_layers:
                aux.append(stream)  # the last layer's output before the final norm
            self.aux_hidden_states = torch.cat(aux, dim=-1)  # [num_tokens, len(aux) * hidden]
        tp_settle_pushes()
        return hidden_states


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def build_model(cls, config: Any) -> nn.Module:
        """The decoder stack (embeddings, layers, final norm; Gemma overrides this)."""
        return LlamaModel(config, cls.build_attention, cls.build_mlp)

    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    @classmethod
    def build_attention(cls, config: Any, layer_idx: int) -> nn.Module:
        """The attention part of decoder layer `layer_idx` (DeepSeek overrides this)."""
        return LlamaAttention(config, layer_idx, **cls.attention_options(config))

    @staticmethod
    def mlp_bias(config: Any) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        """The feed-forward part of decoder layer `layer_idx` (MoE models override this)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=cls.mlp_bias(config),
                        hidden_act=getattr(config, "hidden_act", "silu"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_sampled, hidden] -> [num_sampled, vocab] float32."""
        return self.lm_head.compute_logits(hidden_states)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layers with a sliding window on every layer and no biases."""

    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}

    @staticmethod
    def mlp_bias(config: Any) -> bool:
        return False
