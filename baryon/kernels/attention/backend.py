"""The attention backend interface: store this step's K/V in the paged cache, then attend.

FP8 KV cache: a cache of dtype float8_e4m3fn holds keys and values divided by the layer's
float32 scales (`k_scale`, `v_scale`: one each per layer, device tensors of one element) and
clamped to +-448; reading multiplies by the scale again. Every store path (the QKV prologues,
`store_kv`) and every read path (the backends) takes the scales as arguments; caches of any other
dtype ignore them.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.selector import Kernel


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448


def is_fp8_cache(kv_cache: torch.Tensor | None) -> bool:
    return kv_cache is not None and kv_cache.dtype == FP8_KV_DTYPE


def check_fp8_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV cache needs the layer's k_scale and v_scale tensors")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache stores for x: clamp(x / scale, +-448) in float8_e4m3fn (float32 math)."""
    return (x.to(torch.float32) / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries as `dtype`: fp8 entries times their scale (in float32), others just cast."""
    if x.dtype == FP8_KV_DTYPE:
        return (x.to(torch.float32) * scale).to(dtype)
    return x.to(dtype)


class AttentionBackend(Kernel):
    """One instance per attention layer. Implementations override `forward`.

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values) — the layer's
    slice of the engine's single cache buffer.
    """

    # True when forward() launches only work whose sizes and loop bounds live in device memory,
    # so a decode step can be captured in a CUDA graph and replayed with new inputs.
    cuda_graph_safe: ClassVar[bool] = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None, sinks: torch.Tensor | None = None,
                 logit_softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # Query at position p sees keys at positions (p - sliding_window, p]; None: all of [0, p].
        self.sliding_window = sliding_window
        # [num_heads] float32 attention-sink logits (GPT-OSS): one extra softmax term per head
        # that takes probability mass but contributes no value. None: no sinks.
        self.sinks = sinks
        # Gemma 2: each scaled score s becomes logit_softcap * tanh(s / logit_softcap) before the
        # softmax (attn_logit_softcapping, 50.0 in the published configs). None: scores as they are.
        self.logit_softcap = logit_softcap

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, output: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads,
        head_dim], stored into the cache first, or None when the caller already stored them.
        Returns [num_tokens, num_heads, head_dim], written into `output` when given (a static
        buffer of the piecewise CUDA graphs). k_scale/v_scale: the layer's float32 scales,
        required when kv_cache is fp8 (ignored otherwise)."""
        raise NotImplementedError
