"""Prefill of whole prompts through PyTorch's fused attention (cuDNN's kernel on Hopper).

A step whose every sequence is a whole prompt (no cached prefix, no decode token) is plain causal
attention over each prompt's own keys. On an H100 with Qwen3-8B's heads (32 query, 8 KV, 128
wide) `F.scaled_dot_product_attention` on cuDNN ran 269 / 602 / 612 TFLOP/s at 2k / 16k / 32k
tokens where the paged Triton kernel ran 107 / 223 / 241 (`python benchmarks/kernels.py --only
long_context`), so the paged backend hands such steps here once a prompt is long enough for a
call per sequence to pay: end to end, a fresh 16k prompt's TTFT fell from 169 to 93 ms (0.6B)
and 692 to 493 ms (8B), while the 2k-prompt prefill workload (eight prompts a step) lost 1-3%,
hence MIN_PROMPT_TOKENS above 2k. The keys and values are read back from the paged cache (the
fused QKV prologue has already written them there): one gather, tens of microseconds at 16k.
Chunks over a cached prefix, sliding windows, sinks and fp8 caches stay with the paged kernel.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from baryon.kernels.attention.backend import is_fp8_cache
from baryon.kernels.attention.metadata import AttentionMetadata

MIN_PROMPT_TOKENS = 4096  # the longest prompt of the step, below which the one paged launch stays
FUSED_DTYPES = (torch.bfloat16, torch.float16)


def whole_prompts(metadata: AttentionMetadata) -> bool:
    """Every sequence of the step computes all of its tokens, and one has >= MIN_PROMPT_TOKENS
    (decided once per step, on the host)."""
    decided = metadata.backend_scratch.get("sdpa_whole_prompts")
    if decided is None:
        query_lens = metadata.query_start_loc_cpu[1:] - metadata.query_start_loc_cpu[:-1]
        decided = metadata.max_query_len >= MIN_PROMPT_TOKENS and torch.equal(query_lens, metadata.seq_lens_cpu)
        metadata.backend_scratch["sdpa_whole_prompts"] = decided
    return decided


def takes(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, sliding_window: int | None,
          sinks: torch.Tensor | None) -> bool:
    """Whether `prefill` serves this layer's step."""
    return (query.is_cuda and query.dtype in FUSED_DTYPES and sliding_window is None and sinks is None
            and not is_fp8_cache(kv_cache) and whole_prompts(metadata))


def prefill(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
            output: torch.Tensor) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; the prompts' keys and values already in kv_cache
    [2, num_blocks, block_size, num_kv_heads, head_dim]. Writes and returns output (like query)."""
    page = kv_cache.shape[2]
    starts = metadata.query_start_loc_cpu.tolist()
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]
    chosen = sdpa_kernel(backends, set_priority=True) if query.is_cuda else contextlib.nullcontext()
    with chosen:
        for seq, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            length = end - start
            blocks = metadata.block_tables[seq, :-(-length // page)]
            keys = kv_cache[0][blocks].flatten(0, 1)[:length]  # [length, num_kv_heads, head_dim]
            values = kv_cache[1][blocks].flatten(0, 1)[:length]
            attended = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)  # [1, H, L, D]
            output[start:end] = attended[0].transpose(0, 1)
    return output
