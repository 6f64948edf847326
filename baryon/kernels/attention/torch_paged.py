"""Paged attention in plain torch: the reference every faster backend is tested against.

Runs on CPU and GPU; reads any cache dtype (an fp8 cache is dequantized with the layer's scales
after the gather). Decode-only steps are batched (one gather of every block table); steps with
prefill chunks loop over sequences, each attending over its cached prefix plus its new tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from baryon.kernels.attention.backend import (FP8_KV_DTYPE, AttentionBackend, check_fp8_scales, dequantize_kv,
                                              is_fp8_cache, quantize_kv)
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.soft_cap import soft_cap


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache at slot_mapping
    (slot = block_id * block_size + offset); tokens with slot -1 are not stored. An fp8 cache
    stores clamp(key / k_scale, +-448) and clamp(value / v_scale, +-448)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, H, D]
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if is_fp8_cache(kv_cache):  # index_copy_ has no fp8 kernels: copy the bytes
        check_fp8_scales(k_scale, v_scale)
        k_flat.view(torch.uint8).index_copy_(0, slot_mapping, quantize_kv(key, k_scale).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slot_mapping, quantize_kv(value, v_scale).view(torch.uint8))
        return
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))


def _select_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, ...].index_select(0, blocks), also for fp8 (through the bytes)."""
    if cache.dtype == FP8_KV_DTYPE:
        return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)
    return cache.index_select(0, blocks)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, **config: Any) -> str | None:
        return None  # any head size, GQA ratio, window, sinks, soft-cap, dtype

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, output: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if is_fp8_cache(kv_cache):
            check_fp8_scales(k_scale, v_scale)
        if key is not None:
            store_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        if metadata.max_query_len == 1 and metadata.num_tokens == metadata.num_seqs:
            decoded = self._decode(query, kv_cache, metadata, k_scale, v_scale)
            return decoded if output is None else output.copy_(decoded)
        if output is None:
            output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end > start:
                output[start:end] = self._attend_one(query[start:end], kv_cache, metadata.block_tables[i],
                                                     seq_len, k_scale, v_scale)
        return output

    def _mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[..., q, k] boolean: key visible from query (causal, and inside the window if any)."""
        visible = key_pos.unsqueeze(-2) <= query_pos.unsqueeze(-1)
        if self.sliding_window is not None:
            visible &= key_pos.unsqueeze(-2) > query_pos.unsqueeze(-1) - self.sliding_window
        return visible

    def _attend_one(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: [q_len, H, D] -> [q_len, H, D] over the sequence's first seq_len cached tokens."""
        q_len, block_size = query.shape[0], kv_cache.shape[2]
        first = 0  # first key position any query can see
        if self.sliding_window is not None:
            first = max(0, seq_len - q_len - self.sliding_window + 1)
        first_block = first // block_size
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[first_block:num_blocks]
        offset = first_block * block_size
        blocks = blocks.long()
        keys = _select_blocks(kv_cache[0], blocks).flatten(0, 1)[: seq_len - offset]  # [k_len, H_kv, D]
        values = _select_blocks(kv_cache[1], blocks).flatten(0, 1)[: seq_len - offset]
        key_pos = torch.arange(offset, seq_len, device=query.device)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        out = self._attention(query.transpose(0, 1), dequantize_kv(keys.transpose(0, 1), k_scale, query.dtype),
                              dequantize_kv(values.transpose(0, 1), v_scale, query.dtype),
                              self._mask(query_pos, key_pos))
        return out.transpose(0, 1)

    def _attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """query: [..., H, q, D]; keys/values: [..., H_kv, k, D]; mask: broadcastable to [..., q, k]."""
        if self.sinks is None and self.logit_softcap is None:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=self.num_heads != self.num_kv_heads)
        group = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
        scores = soft_cap((query.float() @ keys.float().transpose(-1, -2)) * self.scale,
                          self.logit_softcap)  # [..., H, q, k]
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is not None:  # each head's softmax has one more logit that takes probability but no value
            sink = self.sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        return (probs @ values.float()).to(query.dtype)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One query token per sequence: gather every block table at once and mask by length."""
        block_size = kv_cache.shape[2]
        max_blocks = -(-metadata.max_seq_len // block_size)
        tables = metadata.block_tables[:, :max_blocks].flatten().long()
        shape = (metadata.num_seqs, max_blocks * block_size, *kv_cache.shape[3:])
        # index_select, not advanced indexing: the latter is orders of magnitude slower on CPU.
        keys = _select_blocks(kv_cache[0], tables).view(shape)  # [num_seqs, max_blocks * block_size, H_kv, D]
        values = _select_blocks(kv_cache[1], tables).view(shape)
        key_pos = torch.arange(keys.shape[1], device=query.device)
        query_pos = (metadata.seq_lens - 1).unsqueeze(-1)  # [num_seqs, 1]
        mask = self._mask(query_pos, key_pos.unsqueeze(0)).unsqueeze(1)  # [num_seqs, 1, 1, k]
        out = self._attention(query.unsqueeze(2), dequantize_kv(keys.transpose(1, 2), k_scale, query.dtype),
                              dequantize_kv(values.transpose(1, 2), v_scale, query.dtype), mask)  # [num_seqs, H, 1, D]
        return out.squeeze(2)
