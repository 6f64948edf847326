"""What happens between the QKV projection and attention, in one pass: the per-head RMSNorm of
queries and keys (Qwen3; optional), NeoX rotary embedding of both, and the write of this step's
keys and values into the paged KV cache. Torch reference and one Triton kernel.

Inputs, for every implementation:
  qkv:           [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection's
                 output (queries | keys | values per token); its query part is rewritten in place.
  positions:     [num_tokens] int64.
  cos_sin_cache: [max_position, rotary_dim] float32 (cos half | sin half).
  q_norm_weight, k_norm_weight: [head_dim] or None (no QK norm).
  kv_cache:      [2, num_blocks, block_size, num_kv_heads, head_dim].
  slot_mapping:  [num_tokens] int64 (block_id * block_size + offset; -1: do not store).
  k_scale, v_scale: the layer's float32 KV-cache scales (one element each, on the cache's
                 device); required when kv_cache is float8_e4m3fn, which then stores
                 clamp(key / k_scale, +-448) and clamp(value / v_scale, +-448); else ignored.
Returns the rotated queries [num_tokens, num_heads * head_dim] (a view into qkv).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.attention.backend import check_fp8_scales, is_fp8_cache
from baryon.kernels.attention.torch_paged import store_kv
from baryon.kernels.norm import rms_norm_reference
from baryon.kernels.rotary import apply_rotary
from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import (INTERPRETED, TritonKernel, next_power_of_2, pdl_launch, tl,
                                         triton, wait_and_release)

if triton is not None:
    from baryon.kernels.norm import scaled_by_weight
    from baryon.kernels.attention.triton_paged import quantize_fp8_kv


def _split(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


class TorchQKVPrologue(Kernel):
    name = "torch"

    @staticmethod
    def forward(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        query, key, value = _split(qkv, num_heads, num_kv_heads, head_dim)
        if q_norm_weight is not None:
            query = rms_norm_reference(query.reshape(-1, head_dim), q_norm_weight, eps).view(query.shape)
            key = rms_norm_reference(key.reshape(-1, head_dim), k_norm_weight, eps).view(key.shape)
        rotated_q, rotated_k = apply_rotary(positions, query, key, cos_sin_cache, head_dim)
        num_tokens = qkv.shape[0]
        store_kv(rotated_k.view(num_tokens, num_kv_heads, head_dim),
                 value.reshape(num_tokens, num_kv_heads, head_dim), kv_cache, slot_mapping, k_scale, v_scale)
        out = qkv[:, :num_heads * head_dim]
        out.copy_(rotated_q)
        return out


class CpuQKVPrologue(Kernel):
    """The C++ kernel (kernels/cpu/paged_attention.cpp): one pass per token, float32 only (the
    cache: float32, float16 or fp8)."""

    name = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        from baryon.kernels.cpu import unsupported_reason

        return unsupported_reason(device)

    @classmethod
    def cannot_implement_reason(cls, *, dtype: torch.dtype = torch.float32, **_: Any) -> str | None:
        return None if dtype == torch.float32 else f"{dtype} (the C++ CPU prologue is float32)"

    @staticmethod
    def forward(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if is_fp8_cache(kv_cache):
            check_fp8_scales(k_scale, v_scale)
        else:
            k_scale = v_scale = None
        torch.ops.baryon_cpu.qkv_prologue(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                                          kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                                          k_scale, v_scale)
        return qkv[:, :num_heads * head_dim]


if triton is not None:

    @triton.jit
    def _norm_and_rotate(row, num_heads: tl.constexpr, norm_weight, eps, cos, sin, dims, partner,
                         HEAD_DIM: tl.constexpr, HEADS_PADDED: tl.constexpr, HAS_NORM: tl.constexpr):
        """Loads num_heads heads starting at `row` and returns them normalised and rotated
        ([HEADS_PADDED, DIM_PADDED], in the input dtype)."""
        heads = tl.arange(0, HEADS_PADDED)[:, None]
        mask = (heads < num_heads) & (dims[None, :] < HEAD_DIM)
        x = tl.load(row + heads * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
        x_partner = tl.load(row + heads * HEAD_DIM + partner[None, :], mask=mask, other=0.0)
        if HAS_NORM:  # as HF: normalise in fp32, then scale as the weight's dtype says (scaled_by_weight)
            x32 = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps)[:, None]
            w = tl.load(norm_weight + dims, mask=dims < HEAD_DIM, other=0.0)[None, :]
            w_partner = tl.load(norm_weight + partner, mask=partner < HEAD_DIM, other=0.0)[None, :]
            x = scaled_by_weight(x32 * rstd, w, x)
            x_partner = scaled_by_weight(x_partner.to(tl.float32) * rstd, w_partner, x)
        y = x.to(tl.float32) * cos[None, :] + x_partner.to(tl.float32) * sin[None, :]
        return y.to(x.dtype), mask

    @triton.jit
    def _qkv_prologue_kernel(qkv, positions, cos_sin, q_norm_weight, k_norm_weight, k_cache, v_cache,
                             slot_mapping, k_scale, v_scale, stride_qkv, stride_cs, stride_cache_slot, eps,
                             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             ROTARY_DIM: tl.constexpr, DIM_PADDED: tl.constexpr, Q_HEADS_PADDED: tl.constexpr,
                             KV_HEADS_PADDED: tl.constexpr, HAS_NORM: tl.constexpr, FP8_KV: tl.constexpr,
                             INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        wait_and_release(PDL)
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions + token)
        dims = tl.arange(0, DIM_PADDED)
        half: tl.constexpr = ROTARY_DIM // 2
        first_half = dims < half
        rotated = dims < ROTARY_DIM
        # NeoX: feature d < half pairs with d + half; the partner of a feature past the rotary
        # part is itself (cos 1, sin 0 leave it unchanged).
        partner = tl.where(first_half, dims + half, tl.where(rotated, dims - half, dims))
        freq = tl.where(first_half, dims, dims - half)
        cos = tl.load(cos_sin + pos * stride_cs + freq, mask=rotated, other=1.0)
        sin = tl.load(cos_sin + pos * stride_cs + half + freq, mask=rotated, other=0.0)
        sin = tl.where(first_half, -sin, sin)
        row = qkv + token * stride_qkv

        q, q_mask = _norm_and_rotate(row, NUM_HEADS, q_norm_weight, eps, cos, sin, dims, partner,
                                     HEAD_DIM, Q_HEADS_PADDED, HAS_NORM)
        q_heads = tl.arange(0, Q_HEADS_PADDED)[:, None]
        tl.store(row + q_heads * HEAD_DIM + dims[None, :], q, mask=q_mask)

        slot = tl.load(slot_mapping + token)
        if slot >= 0:
            k_row = row + NUM_HEADS * HEAD_DIM
            k, kv_mask = _norm_and_rotate(k_row, NUM_KV_HEADS, k_norm_weight, eps, cos, sin, dims, partner,
                                          HEAD_DIM, KV_HEADS_PADDED, HAS_NORM)
            kv_heads = tl.arange(0, KV_HEADS_PADDED)[:, None]
            offsets = kv_heads * HEAD_DIM + dims[None, :]
            v = tl.load(k_row + NUM_KV_HEADS * HEAD_DIM + offsets, mask=kv_mask)
            if FP8_KV:  # k is already rounded to the model dtype, as the torch prologue's
                k = quantize_fp8_kv(k, k_scale, k_cache, INTERPRETED)
                v = quantize_fp8_kv(v, v_scale, v_cache, INTERPRETED)
            tl.store(k_cache + slot * stride_cache_slot + offsets, k, mask=kv_mask)
            tl.store(v_cache + slot * stride_cache_slot + offsets, v, mask=kv_mask)


class TritonQKVPrologue(TritonKernel):
    """One program per token: QK norm, rotary and the KV-cache write fused."""

    family = "qkv_prologue"

    @classmethod
    def cannot_implement_reason(cls, head_dim: int = 128, **config: Any) -> str | None:
        if head_dim not in (64, 128, 256):
            return f"head_dim {head_dim} (supported: 64, 128, 256)"
        return None

    @staticmethod
    def forward(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        has_norm = q_norm_weight is not None
        fp8 = is_fp8_cache(kv_cache)
        if fp8:
            check_fp8_scales(k_scale, v_scale)
        else:  # unused pointers
            k_scale = v_scale = slot_mapping
        if num_tokens:
            _qkv_prologue_kernel[(num_tokens,)](
                qkv, positions, cos_sin_cache, q_norm_weight if has_norm else cos_sin_cache,
                k_norm_weight if has_norm else cos_sin_cache, kv_cache[0], kv_cache[1], slot_mapping,
                k_scale, v_scale, qkv.stride(0), cos_sin_cache.stride(0), kv_cache.stride(2), eps,
                NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                ROTARY_DIM=cos_sin_cache.shape[-1], DIM_PADDED=next_power_of_2(head_dim),
                Q_HEADS_PADDED=next_power_of_2(num_heads), KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
                HAS_NORM=has_norm, FP8_KV=fp8, INTERPRETED=INTERPRETED, **pdl_launch(qkv.device))
        return qkv[:, :num_heads * head_dim]
