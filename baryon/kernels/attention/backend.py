"""The attention backend interface: store this step's K/V in the paged cache, then attend."""

from __future__ import annotations

from typing import ClassVar

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.selector import Kernel


class AttentionBackend(Kernel):
    """One instance per attention layer. Implementations override `forward`.

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values) — the layer's
    slice of the engine's single cache buffer.
    """

    # True when forward() launches only work whose sizes and loop bounds live in device memory,
    # so a decode step can be captured in a CUDA graph and replayed with new inputs.
    cuda_graph_safe: ClassVar[bool] = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None, sinks: torch.Tensor | None = None) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # Query at position p sees keys at positions (p - sliding_window, p]; None: all of [0, p].
        self.sliding_window = sliding_window
        # [num_heads] float32 attention-sink logits (GPT-OSS): one extra softmax term per head
        # that takes probability mass but contributes no value. None: no sinks.
        self.sinks = sinks

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, output: torch.Tensor | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads,
        head_dim], stored into the cache first, or None when the caller already stored them.
        Returns [num_tokens, num_heads, head_dim], written into `output` when given (a static
        buffer of the piecewise CUDA graphs)."""
        raise NotImplementedError
