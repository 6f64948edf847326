"""MLA prologue (family `mla_prologue`): from the query and latent projections' outputs to what
latent attention reads, in one kernel on GPU:

    q     [T, H, Dn + R]   the rope part q[..., Dn:] rotated in place
    kv_a  [T, L + R]       c_kv | k_pe: c_kv through RMSNorm (kv_a_layernorm), k_pe rotated, and
                           cat(c_kv, k_pe) written to the latent cache at slot_mapping (-1: skipped)

Rotary: cos/sin from cos_sin_cache [max_position, R] (cos half | sin half, float32) at each token's
position. `interleaved` (DeepSeek's pairs (x0, x1), (x2, x3) ...): pair i is (x[2i], x[2i + 1]);
otherwise (x[i], x[i + R/2]) as NeoX. Either way the rotated pair i is written to features i and
i + R/2, for queries and keys alike, so their dot products are those of the pairwise rotation.
RMSNorm as HF rounds it: normalise in float32, round to the input dtype, multiply by the weight.

Kernels: `triton` (one program per token: the latent row, its rope key and all heads' rope
queries) and `torch` (the reference, runs anywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.attention.mla_backend import store_latent
from baryon.kernels.norm import rms_norm_reference
from baryon.kernels.rotary import rotate_neox
from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import INTERPRETED, TritonKernel, next_power_of_2, tl, triton


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class TorchMLAPrologue(Kernel):
    name = "torch"

    @staticmethod
    def forward(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor,
                nope_dim: int, interleaved: bool) -> None:
        rank = norm_weight.shape[0]
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R / 2]
        q_pe, k_pe = q[..., nope_dim:], kv_a[:, None, rank:]  # [T, H, R], [T, 1, R]
        if interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q[..., nope_dim:] = rotate_neox(q_pe, cos, sin)
        latent = torch.cat((rms_norm_reference(kv_a[:, :rank], norm_weight, eps),
                            rotate_neox(k_pe, cos, sin).squeeze(1)), dim=-1)  # [T, L + R]
        store_latent(latent, cache, slot_mapping)


if triton is not None:
    from baryon.kernels.attention.triton_paged import e4m3_round_to_nearest_even

    @triton.jit
    def _rotate(ptr, pair, pair_valid, cos, sin, INTERLEAVED: tl.constexpr, HALF: tl.constexpr):
        """Loads the pairs of the rope features at ptr ([.., 1] pointers, pair [HALF_P]) and returns
        them rotated (float32): (x1 cos - x2 sin, x2 cos + x1 sin)."""
        if INTERLEAVED:
            x1 = tl.load(ptr + 2 * pair, mask=pair_valid, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + 2 * pair + 1, mask=pair_valid, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(ptr + pair, mask=pair_valid, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + HALF + pair, mask=pair_valid, other=0.0).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @triton.jit
    def _cache_value(v, cache, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
        """v (the model dtype) as the cache stores it: the same, or for an FP8 cache clamped to
        +-448 and rounded to nearest even (as `mla_backend.store_latent` does in torch)."""
        if FP8:
            y = v.to(tl.float32)
            y = tl.where(y != y, y, tl.clamp(y, -448.0, 448.0))
            if INTERPRETED:
                return e4m3_round_to_nearest_even(y)
            return y.to(cache.dtype.element_ty)
        return v.to(cache.dtype.element_ty)

    @triton.jit
    def _mla_prologue_kernel(q, kv_a, positions, cos_sin_cache, norm_weight, cache, slot_mapping, eps,
                             stride_qt, stride_qh, stride_kt, stride_cache_slot,
                             NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, NOPE: tl.constexpr,
                             RANK: tl.constexpr, RANK_P: tl.constexpr, ROPE: tl.constexpr,
                             HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, FP8: tl.constexpr,
                             INTERPRETED: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = ROPE // 2
        pos = tl.load(positions + token).to(tl.int64)
        pair = tl.arange(0, HALF_P)
        pair_valid = pair < HALF
        cos = tl.load(cos_sin_cache + pos * ROPE + pair, mask=pair_valid, other=0.0)
        sin = tl.load(cos_sin_cache + pos * ROPE + HALF + pair, mask=pair_valid, other=0.0)

        # Queries: every head's rope features, rotated in place (all loads precede the stores).
        heads = tl.arange(0, HEADS_P)
        q_rope = q + token * stride_qt + heads[:, None] * stride_qh + NOPE  # [HEADS_P, 1]
        q_mask = (heads < NUM_HEADS)[:, None] & pair_valid[None, :]
        r1, r2 = _rotate(q_rope, pair[None, :], q_mask, cos[None, :], sin[None, :], INTERLEAVED, HALF)
        tl.store(q_rope + pair[None, :], r1.to(q.dtype.element_ty), mask=q_mask)
        tl.store(q_rope + HALF + pair[None, :], r2.to(q.dtype.element_ty), mask=q_mask)

        slot = tl.load(slot_mapping + token)
        if slot >= 0:
            cols = tl.arange(0, RANK_P)
            col_valid = cols < RANK
            row = kv_a + token * stride_kt
            c = tl.load(row + cols, mask=col_valid, other=0.0)
            c32 = c.to(tl.float32)
            variance = tl.sum(c32 * c32, axis=0) / RANK
            normed = (c32 * tl.rsqrt(variance + eps)).to(c.dtype)  # as HF: normalise in fp32, round
            w = tl.load(norm_weight + cols, mask=col_valid, other=0.0)
            dst = cache + slot * stride_cache_slot
            latent = (normed.to(tl.float32) * w.to(tl.float32)).to(kv_a.dtype.element_ty)
            tl.store(dst + cols, _cache_value(latent, cache, FP8, INTERPRETED), mask=col_valid)
            k1, k2 = _rotate(row + RANK, pair, pair_valid, cos, sin, INTERLEAVED, HALF)
            tl.store(dst + RANK + pair, _cache_value(k1.to(kv_a.dtype.element_ty), cache, FP8, INTERPRETED),
                     mask=pair_valid)
            tl.store(dst + RANK + HALF + pair, _cache_value(k2.to(kv_a.dtype.element_ty), cache, FP8, INTERPRETED),
                     mask=pair_valid)


class TritonMLAPrologue(TritonKernel):
    family = "mla_prologue"

    @classmethod
    def cannot_implement_reason(cls, rope_dim: int = 64, **_: Any) -> str | None:
        if rope_dim % 2:
            return f"qk_rope_head_dim {rope_dim} (an even size is needed)"
        return None

    @staticmethod
    def forward(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor,
                nope_dim: int, interleaved: bool) -> None:
        tokens, heads, width = q.shape
        if tokens == 0:
            return
        if kv_a.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("mla_prologue needs q and kv_a contiguous in their last dimension")
        rank, rope = norm_weight.shape[0], width - nope_dim
        _mla_prologue_kernel[(tokens,)](
            q, kv_a, positions, cos_sin_cache, norm_weight, cache, slot_mapping, eps,
            q.stride(0), q.stride(1), kv_a.stride(0), cache.stride(1),
            NUM_HEADS=heads, HEADS_P=next_power_of_2(heads), NOPE=nope_dim, RANK=rank,
            RANK_P=next_power_of_2(rank), ROPE=rope, HALF_P=max(next_power_of_2(rope // 2), 1),
            INTERLEAVED=interleaved, FP8=cache.dtype == torch.float8_e4m3fn, INTERPRETED=INTERPRETED)
