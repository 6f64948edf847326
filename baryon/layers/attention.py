"""The attention layer: stores this step's keys/values in the paged cache and attends over it.

`forward_qkv` is the path the models take: from the fused QKV projection's output it runs the
QKV prologue (QK norm, rotary, KV-cache write; one kernel on GPU) and then attention. Under
torch.compile (compilation levels 1-3) that pair is the opaque custom op `baryon::attention`,
so dynamo neither traces into the kernels nor sees the per-step metadata and the KV cache.

FP8 KV cache (engine argument kv_cache_dtype="fp8"): the runner binds a float8_e4m3fn cache and
every write / read goes through the layer's `k_scale` / `v_scale` (float32 parameters of one
element, loaded from the checkpoint's `self_attn.k_scale` / `k_proj.output_scale` when present,
else 1.0). They stay on the device and are passed to the kernels as tensors, so CUDA graphs
capture them by address. Other cache dtypes never read them."""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from baryon.kernels.selector import select
from baryon.layers.forward_context import current_attn_metadata
from baryon.layers.norm import RMSNorm
from baryon.layers.rotary import RotaryEmbedding


# Layer id -> layer, for the custom op (which takes tensors and plain values, not modules).
_layers: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_next_layer_id = itertools.count()

# Called instead of the QKV prologue + attention while set: the piecewise CUDA-graph capture
# (runner/piecewise_graph.py) cuts the forward pass there. (layer, qkv, positions,
# cos_sin_cache, q_norm_weight, k_norm_weight, eps) -> the attention output to continue with.
AttentionInterceptor = Callable[..., torch.Tensor]
_interceptor: AttentionInterceptor | None = None


@contextmanager
def intercept_attention(interceptor: AttentionInterceptor) -> Iterator[None]:
    global _interceptor
    previous, _interceptor = _interceptor, interceptor
    try:
        yield
    finally:
        _interceptor = previous


def _load_kv_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A checkpoint's KV-cache scale: a scalar or a one-element tensor, positive and finite."""
    if loaded.numel() != 1:
        raise ValueError(f"a KV-cache scale must be a scalar or have one element, got shape {list(loaded.shape)}")
    value = float(loaded.reshape(()).to(torch.float32))  # at load time only
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a KV-cache scale must be positive and finite, got {value}")
    param.data.copy_(loaded.reshape(param.shape).to(torch.float32))


def _kv_scale_parameter() -> nn.Parameter:
    param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
    param.weight_loader = _load_kv_scale
    param.expected_shards = frozenset()  # optional: a checkpoint without scales keeps 1.0
    return param


class PagedKVLayer(nn.Module):
    """A layer that owns a slice of the paged KV cache: the runner sizes and binds `kv_cache`
    from `cache_shape`, and reads `cuda_graph_safe` to decide on CUDA graphs."""

    kv_cache: torch.Tensor | None
    backend: object

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a decode step through this layer can be captured in a CUDA graph."""
        return self.backend.cuda_graph_safe


class Attention(PagedKVLayer):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                 logit_softcap: float | None = None) -> None:
        """sinks: [num_heads] attention-sink logits (GPT-OSS: the layer's parameter, read as it is
        at every step), or None. logit_softcap: scores capped to cap * tanh(s / cap) before the
        softmax (Gemma 2), or None."""
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.sliding_window = sliding_window
        backend = select("attention", torch.get_default_device(), head_dim=head_dim,
                         num_heads=num_heads, num_kv_heads=num_kv_heads,
                         dtype=torch.get_default_dtype(), sliding_window=sliding_window)
        self.backend = backend(num_heads, head_dim, num_kv_heads, scale, sliding_window, sinks, logit_softcap)
        self.prologue = select("qkv_prologue", torch.get_default_device(), head_dim=head_dim,
                               dtype=torch.get_default_dtype())
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the runner once the
        # cache is allocated (a plain attribute, not part of the state dict).
        self.kv_cache: torch.Tensor | None = None
        # FP8 KV cache: cache = clamp(k / k_scale, +-448) as float8_e4m3fn, read back as cache * k_scale.
        self.k_scale = _kv_scale_parameter()
        self.v_scale = _kv_scale_parameter()
        self.layer_id = next(_next_layer_id)
        _layers[self.layer_id] = self

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)  # keys, values

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (rewritten in place);
        positions: [num_tokens]; q_norm/k_norm: per-head RMSNorm of queries/keys before rotary
        (Qwen3) or None. Returns [num_tokens, num_heads * head_dim]."""
        norm_args = (None, None, 0.0) if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        if _interceptor is not None:
            return _interceptor(self, qkv, positions, rotary.cos_sin_cache, *norm_args)
        if torch.compiler.is_compiling():
            return torch.ops.baryon.attention(qkv, positions, rotary.cos_sin_cache, *norm_args, self.layer_id)
        return self._prologue_and_attend(qkv, positions, rotary.cos_sin_cache, *norm_args)

    def _prologue_and_attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                             q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                             eps: float, output: torch.Tensor | None = None) -> torch.Tensor:
        """Returns [num_tokens, num_heads * head_dim], written into `output` when given."""
        metadata = current_attn_metadata()
        num_tokens = qkv.shape[0]
        query = self.prologue.forward(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                                      self.kv_cache, metadata.slot_mapping,
                                      self.num_heads, self.num_kv_heads, self.head_dim, self.k_scale, self.v_scale)
        shape = (num_tokens, self.num_heads, self.head_dim)
        result = self.backend.forward(query.view(shape), None, None, self.kv_cache, metadata,
                                      None if output is None else output.view(shape), self.k_scale, self.v_scale)
        return result.reshape(num_tokens, self.num_heads * self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query: [num_tokens, num_heads * head_dim]; key/value: [num_tokens, num_kv_heads *
        head_dim]. Returns [num_tokens, num_heads * head_dim]."""
        num_tokens = query.shape[0]
        output = self.backend.forward(
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
            value.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache, current_attn_metadata(), k_scale=self.k_scale, v_scale=self.v_scale)
        return output.reshape(num_tokens, self.num_heads * self.head_dim)


@torch.library.custom_op("baryon::attention", mutates_args=("qkv",))
def _attention_op(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                  layer_id: int) -> torch.Tensor:
    return _layers[layer_id]._prologue_and_attend(qkv, positions, cos_sin_cache, q_norm_weight,
                                                  k_norm_weight, eps)


@_attention_op.register_fake
def _(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, layer_id):
    layer = _layers[layer_id]
    return qkv.new_empty(qkv.shape[0], layer.num_heads * layer.head_dim)
