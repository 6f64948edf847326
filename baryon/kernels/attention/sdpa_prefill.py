"""Long prefill queries through PyTorch's fused attention (cuDNN's kernel on Hopper).

On an H100 with Qwen3-8B's heads (32 query, 8 KV, 128 wide) `F.scaled_dot_product_attention` on
cuDNN ran 269 / 602 / 612 TFLOP/s at 2k / 16k / 32k causal tokens where the paged Triton kernel
ran 107 / 223 / 241 (`python benchmarks/kernels.py --only long_context`). So the paged backend
hands each sequence of a prefill step whose attention is large (a long whole prompt, or a chunk
of one over a long cached prefix: `long_queries`) to this module, and runs its own kernel on the rest of
the step (decodes, short chunks). The keys and values are read back from the paged cache (the
fused QKV prologue has already written them there): one gather per sequence and layer.

A whole prompt is one causal call. A chunk of q_len tokens after `prefix` cached ones is two:
the chunk against its own keys (causal, square) and against the prefix (no mask), each returning
its softmax's log-sum-exp per query row, merged as flash attention merges splits:

    out = (o_own * exp(lse_own - m) + o_prefix * exp(lse_prefix - m)) / (exp(lse_own - m) + exp(lse_prefix - m))

(SDPA's own causal mask for q_len < kv_len is aligned top-left, not the bottom-right a chunk
needs.) End to end (fresh prompts, before chunks were served here): a 16k prompt's TTFT fell
from 169 to 93 ms (0.6B) and 692 to 493 ms (8B); the 2k-prompt prefill workload lost 1-3% when
2k prompts came here too, hence the query-key pairs above 2k x 2k. Sliding windows, sinks and fp8
caches stay with the paged kernel.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from baryon.kernels.attention.backend import is_fp8_cache
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.logger import get_logger

logger = get_logger(__name__)

# A sequence comes here when its query has >= MIN_QUERY_TOKENS tokens and query x keys >=
# MIN_QUERY_KEY_PAIRS: a whole prompt from 4,096 tokens, a chunk of 2,032 (a 2,048-token budget
# beside 16 decodes) once its prefix passes ~6k tokens.
MIN_QUERY_TOKENS = 512
MIN_QUERY_KEY_PAIRS = 4096 * 4096
FUSED_DTYPES = (torch.bfloat16, torch.float16)
BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH]
_cudnn_failed = False  # set once cuDNN's attention raised here: the memory-efficient kernel from then on


def long_queries(metadata: AttentionMetadata) -> tuple[int, ...]:
    """The sequences of the step whose attention is large enough for a call of their own: >=
    MIN_QUERY_TOKENS query tokens and >= MIN_QUERY_KEY_PAIRS query-key pairs (decided once per
    step, on the host)."""
    decided = metadata.backend_scratch.get("sdpa_long_queries")
    if decided is None:
        decided = ()
        if metadata.max_query_len >= MIN_QUERY_TOKENS:
            query_lens = (metadata.query_start_loc_cpu[1:] - metadata.query_start_loc_cpu[:-1]).long()
            large = (query_lens >= MIN_QUERY_TOKENS) & (query_lens * metadata.seq_lens_cpu.long() >= MIN_QUERY_KEY_PAIRS)
            decided = tuple(torch.nonzero(large).flatten().tolist())
        metadata.backend_scratch["sdpa_long_queries"] = decided
    return decided


def takes(query: torch.Tensor, kv_cache: torch.Tensor, sliding_window: int | None,
          sinks: torch.Tensor | None, logit_softcap: float | None) -> bool:
    """Whether this layer's long queries may come here (the step decides which are long): SDPA
    has no windows, sinks, fp8 keys or soft-capped scores."""
    return (query.is_cuda and query.dtype in FUSED_DTYPES and sliding_window is None and sinks is None
            and logit_softcap is None and not is_fp8_cache(kv_cache))


def prefill(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
            output: torch.Tensor, seqs: tuple[int, ...] | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; the sequences' keys and values (prefix and new)
    already in kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]. Writes the rows of
    `seqs` (default: every sequence) into output (like query) and returns it."""
    page = kv_cache.shape[2]
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    chosen = sdpa_kernel(BACKENDS, set_priority=True) if query.is_cuda else contextlib.nullcontext()
    with chosen:
        for seq in range(len(seq_lens)) if seqs is None else seqs:
            start, end, length = starts[seq], starts[seq + 1], seq_lens[seq]
            prefix = length - (end - start)
            blocks = metadata.block_tables[seq, :-(-length // page)]
            keys = kv_cache[0][blocks].flatten(0, 1)[:length].transpose(0, 1)  # [num_kv_heads, length, head_dim]
            values = kv_cache[1][blocks].flatten(0, 1)[:length].transpose(0, 1)
            q = query[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
            if prefix == 0:
                attended = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                          is_causal=True, scale=scale, enable_gqa=True)[0]
            else:
                attended = attend_after_prefix(q, keys, values, prefix, scale)
            output[start:end] = attended.transpose(0, 1)
    return output


def attend_after_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int,
                        scale: float) -> torch.Tensor:
    """q: [num_heads, q_len, head_dim], the last q_len positions of keys/values [num_kv_heads,
    prefix + q_len, head_dim]. Causal attention of the chunk, as two calls merged by their
    log-sum-exps. Returns [num_heads, q_len, head_dim] in q's dtype."""
    own, lse_own = attention_with_lse(q, keys[:, prefix:], values[:, prefix:], True, scale)
    before, lse_before = attention_with_lse(q, keys[:, :prefix], values[:, :prefix], False, scale)
    top = torch.maximum(lse_own, lse_before)  # [num_heads, q_len] float32
    w_own, w_before = torch.exp(lse_own - top), torch.exp(lse_before - top)
    merged = (own.float() * w_own[..., None] + before.float() * w_before[..., None]) / (w_own + w_before)[..., None]
    return merged.to(q.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [H, L, D] over k, v [H_kv, S, D] (causal: L == S) and the natural
    log-sum-exp of each row's scaled scores. Returns ([H, L, D], [H, L] float32). CUDA: cuDNN's
    fused kernel (GQA native); elsewhere float32 math (the CPU tests' path)."""
    global _cudnn_failed
    heads, q_len, _ = q.shape
    group = heads // k.shape[0]
    if q.is_cuda and not _cudnn_failed:
        try:
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, True, 0.0, causal, False, scale=scale)[:2]
            return out[0], lse.reshape(heads, -1)[:, :q_len].float()
        except RuntimeError as e:  # no cuDNN attention for this GPU / build / shape
            logger.warning("cuDNN attention failed (%s); long prefill chunks use the memory-efficient kernel", e)
            _cudnn_failed = True
    if q.is_cuda:  # its log-sum-exp rows are padded to a multiple of 32
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.unsqueeze(0), k.repeat_interleave(group, 0).unsqueeze(0), v.repeat_interleave(group, 0).unsqueeze(0),
            None, True, 0.0, causal, scale=scale)[:2]
        return out[0], lse.reshape(heads, -1)[:, :q_len].float()
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    scores = torch.einsum("hld,hsd->hls", q.float(), k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, L]
    return torch.einsum("hls,hsd->hld", torch.exp(scores - lse[..., None]), v).to(q.dtype), lse
