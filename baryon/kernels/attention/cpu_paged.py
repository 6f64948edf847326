"""Paged attention on CPU in the C++ kernel (kernels/cpu/paged_attention.cpp): decodes and prefill
chunks in one call, each query token reading its sequence's blocks in place (no gathered copy of
the cache, no mask tensor). The cache may be float32, float16 (kv_cache_dtype="float16": converted
in registers) or fp8 (converted row by row as it is read, the layer's scales folded in). Attention
sinks and non-float32 queries take the torch path."""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.attention.backend import FP8_KV_DTYPE, check_fp8_scales
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.torch_paged import TorchPagedAttention, store_kv


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        from baryon.kernels.cpu import unsupported_reason

        return unsupported_reason(device)

    @classmethod
    def cannot_implement_reason(cls, *, dtype: torch.dtype = torch.float32, **config: Any) -> str | None:
        return None if dtype == torch.float32 else f"{dtype} (the C++ CPU attention is float32)"

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, output: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: [num_tokens, H, D] -> [num_tokens, H, D]."""
        if (self.sinks is not None or query.dtype != torch.float32
                or kv_cache.dtype not in (torch.float32, torch.float16, FP8_KV_DTYPE)):
            return super().forward(query, key, value, kv_cache, metadata, output, k_scale, v_scale)
        if kv_cache.dtype == FP8_KV_DTYPE:
            check_fp8_scales(k_scale, v_scale)
        else:
            k_scale = v_scale = None
        if key is not None:
            store_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        result = torch.ops.baryon_cpu.paged_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                                      metadata.query_start_loc, self.scale, self.sliding_window or 0,
                                                      self.logit_softcap or 0.0, k_scale, v_scale)
        return result if output is None else output.copy_(result)
