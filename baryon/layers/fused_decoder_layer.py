"""Llama-family decoder layers run as one C++ call on CPU (`kernels/cpu/decoder_layer.cpp`).

After loading, the runner calls `fuse_decoder_layers(model, device)`: every `LlamaDecoderLayer`
whose parts the C++ op covers gets a `FusedDecoderLayer` as its `fused` attribute, which its
forward then calls instead of its modules. Covered: float32 activations, one rank, the CPU
attention backend and prologue without attention sinks or soft-capping, a gated SiLU MLP without biases, and
linears that are dense float32 or in the packed GGUF blocks on either C++ kernel (GGUF matrices,
and W8A8 / W4A16 layers repacked into them). Anything else (MoE blocks, latent attention, other
quantization methods, GPTQ act order, an fp8 KV cache at run time) keeps the op-by-op path.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from baryon.kernels.quant.cpu_block_linear import PackedBlockWeights
from baryon.kernels.selector import select
from baryon.layers.activation import SiluAndMul
from baryon.layers.attention import Attention
from baryon.layers.forward_context import current_attn_metadata
from baryon.layers.linear import LinearBase
from baryon.logger import get_logger
from baryon.quantization.base import DENSE
from baryon.quantization.block_quant import BlockQuantLinearMethod

logger = get_logger(__name__)


def packed_blocks(linear: LinearBase) -> tuple[torch.Tensor, int, str] | None:
    """(packed rows, code width, block kernel name) of a linear held in the GGUF block layout:
    GGUF matrices, and W8A8 / W4A16 layers repacked for the CPU (`kernels/quant/cpu_block_linear`)
    unless their activations are permuted (GPTQ act order); None otherwise."""
    method = linear.method
    if isinstance(method, BlockQuantLinearMethod):
        return linear.weight, method.bits, method.kernel.name
    weights = getattr(method, "weights", None)
    if isinstance(weights, PackedBlockWeights) and getattr(method, "perm", None) is None:
        return weights.packed, weights.bits, weights.kernel.name
    return None


def _linear_reason(name: str, linear: LinearBase) -> str | None:
    if getattr(linear, "tp_size", 1) != 1:
        return f"{name} is split over tensor-parallel ranks"
    if linear.method is DENSE:
        # The op multiplies with torch's linear. A layer-by-layer timing that preferred another
        # kernel (zentorch) does not count the calls the op saves; a forced choice does win.
        kernel = linear.__dict__.get("dense_kernel")
        if kernel is not None and os.environ.get("BARYON_KERNEL_DENSE_LINEAR") == kernel.name:
            return f"{name} is forced onto {kernel.name}"
        return None if linear.weight.dtype == torch.float32 else f"{name} is {linear.weight.dtype}"
    blocks = packed_blocks(linear)
    if blocks is not None and blocks[2] in ("cpu_int8", "cpu_float32"):
        return None
    return f"{name} uses {type(linear.method).__name__}"


def why_not_fused(layer: nn.Module) -> str | None:
    """None if the C++ decoder layer covers `layer`, else what it lacks."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    attn = getattr(attention, "attn", None)
    if not isinstance(attn, Attention) or not hasattr(attention, "qkv_proj") or not hasattr(attention, "rotary_emb"):
        return "not multi-head attention with a fused QKV projection and rotary embedding"
    if getattr(attention, "output_gate", False):
        return "its attention output is gated (Qwen3-Next, Qwen3.5)"
    if not (hasattr(mlp, "gate_up_proj") and isinstance(getattr(mlp, "act_fn", None), SiluAndMul)):
        return "not a gated SiLU MLP"
    if (attn.backend.name != "cpu" or attn.prologue.name != "cpu" or attn.backend.sinks is not None
            or attn.backend.logit_softcap is not None):
        return "not the C++ attention without sinks or soft-capping"
    if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "the MLP has biases"
    if hasattr(attention, "output_multiplier") or hasattr(mlp, "output_multiplier"):
        return "its blocks scale their outputs (Granite's residual_multiplier)"
    if layer.input_layernorm.reduces_input or layer.post_attention_layernorm.reduces_input:
        return "a norm adds the ranks' parts (tensor parallelism or DP attention)"
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return "the two norms have different eps"
    linears = {"qkv_proj": attention.qkv_proj, "o_proj": attention.o_proj, "gate_up_proj": mlp.gate_up_proj,
               "down_proj": mlp.down_proj}
    kernels = {blocks[2] for blocks in map(packed_blocks, linears.values()) if blocks is not None}
    if len(kernels) > 1:
        return f"its packed linears use different kernels ({sorted(kernels)})"
    return next((r for r in (_linear_reason(n, l) for n, l in linears.items()) if r), None)


def _weight_and_bits(linear: LinearBase) -> tuple[torch.Tensor, int]:
    """What the op reads for a linear: (packed rows, code width) or (dense weight, 0)."""
    blocks = packed_blocks(linear)
    return (linear.weight, 0) if blocks is None else blocks[:2]


class FusedDecoderLayer:
    """Calls `baryon_cpu::decoder_layer` with one layer's weights and this step's metadata."""

    def __init__(self, layer: nn.Module) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.attn: Attention = attention.attn
        self.rotary = attention.rotary_emb
        self.q_norm = attention.q_norm if getattr(attention, "qk_norm", False) else None
        self.k_norm = attention.k_norm if self.q_norm is not None else None
        self.linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.integer_dots = any((blocks := packed_blocks(l)) is not None and blocks[2] == "cpu_int8" for l in self.linears)
        self.weights: tuple | None = None  # read at the first call, once the weights are loaded
        self.rotary_args: tuple = ()
        self.attention_args = (self.attn.num_heads, self.attn.num_kv_heads, self.attn.head_dim,
                               self.attn.backend.scale, self.attn.backend.sliding_window or 0)

    def _weights(self) -> tuple:
        """The layer's own arguments of the op (fixed once the weights are loaded)."""
        layer, (qkv, o, gate_up, down) = self.layer, self.linears
        return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
                *_weight_and_bits(qkv), qkv.bias, *_weight_and_bits(o), o.bias,
                *_weight_and_bits(gate_up), *_weight_and_bits(down), self.integer_dots)

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (and residual): [num_tokens, hidden] -> (MLP output, residual stream)."""
        attn, metadata = self.attn, current_attn_metadata()
        if attn.kv_cache.dtype not in (torch.float32, torch.float16):  # fp8: the modules handle its scales
            return self.layer.forward_modules(positions, hidden_states, residual)
        if self.weights is None:
            self.weights = self._weights()
            self.rotary_args = (None if self.q_norm is None else self.q_norm.weight,
                                None if self.k_norm is None else self.k_norm.weight,
                                0.0 if self.q_norm is None else self.q_norm.eps)
        return torch.ops.baryon_cpu.decoder_layer(
            # (the table read each call: a multimodal-RoPE step swaps in rows of its own, layers/mrope.py)
            hidden_states, residual, *self.weights, positions, self.rotary.cos_sin_cache, *self.rotary_args,
            attn.kv_cache, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            *self.attention_args)


def fuse_decoder_layers(model: nn.Module, device: torch.device) -> int:
    """Give every coverable decoder layer of `model` its fused call; returns how many got one."""
    fused, reasons = 0, set()
    for module in model.modules():
        if not hasattr(module, "fused"):
            continue
        reason = why_not_fused(module)
        kernel = select("decoder_layer", device, structure=reason, dtype=torch.get_default_dtype())
        if kernel.name == "cpu":
            module.fused = FusedDecoderLayer(module)
            fused += 1
        elif reason:
            reasons.add(reason)
    if fused or reasons:
        logger.info("decoder layers in one C++ call: %d%s", fused, f" (others: {'; '.join(sorted(reasons))})" if reasons else "")
    return fused
