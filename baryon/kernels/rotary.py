"""Rotary position embedding, NeoX style (rotate halves), partial rotary ready: torch reference
and Triton kernel (in place)."""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, tl, triton


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, rotary_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2] float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class TorchRotary(Kernel):
    name = "torch"

    @staticmethod
    def forward(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens]; query: [num_tokens, num_heads * head_dim]; key likewise with
        the KV heads; cos_sin_cache: [max_position, rotary_dim] float32 (cos half | sin half).
        Rotates the first rotary_dim features of every head; returns new (query, key)."""
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        rotary_dim = cos_sin_cache.shape[-1]
        outputs = []
        for x in (query, key):
            x = x.view(x.shape[0], -1, head_dim)
            rotated = rotate_neox(x[..., :rotary_dim], cos, sin)
            if rotary_dim < head_dim:
                rotated = torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
            outputs.append(rotated.flatten(1))
        return outputs[0], outputs[1]


if triton is not None:

    @triton.jit
    def _rotary_kernel(positions, q, k, cos_sin, stride_q, stride_k, stride_cs,
                       NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, HEADS_PADDED: tl.constexpr, HALF_PADDED: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions + token)
        offs = tl.arange(0, HALF_PADDED)
        cos = tl.load(cos_sin + pos * stride_cs + offs, mask=offs < HALF, other=0.0)[None, :]
        sin = tl.load(cos_sin + pos * stride_cs + HALF + offs, mask=offs < HALF, other=0.0)[None, :]
        heads = tl.arange(0, HEADS_PADDED)[:, None]
        for which in tl.static_range(2):
            base = q + token * stride_q if which == 0 else k + token * stride_k
            num_heads = NUM_Q_HEADS if which == 0 else NUM_K_HEADS
            mask = (heads < num_heads) & (offs[None, :] < HALF)
            first = base + heads * HEAD_DIM + offs[None, :]
            x1 = tl.load(first, mask=mask, other=0.0)
            x2 = tl.load(first + HALF, mask=mask, other=0.0)
            y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
            y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
            tl.store(first, y1.to(x1.dtype), mask=mask)
            tl.store(first + HALF, y2.to(x1.dtype), mask=mask)


class TritonRotary(TritonKernel):
    """Rotates query and key in place, one program per token."""

    family = "rotary"

    @staticmethod
    def forward(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = query.shape[0]
        half = cos_sin_cache.shape[-1] // 2
        if num_tokens:
            q_heads, k_heads = query.shape[-1] // head_dim, key.shape[-1] // head_dim
            _rotary_kernel[(num_tokens,)](
                positions, query, key, cos_sin_cache, query.stride(0), key.stride(0), cos_sin_cache.stride(0),
                NUM_Q_HEADS=q_heads, NUM_K_HEADS=k_heads, HEAD_DIM=head_dim, HALF=half,
                HEADS_PADDED=next_power_of_2(max(q_heads, k_heads)), HALF_PADDED=next_power_of_2(half))
        return query, key
