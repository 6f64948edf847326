"""Rotary position embedding, NeoX style (rotate halves), partial rotary ready: the torch
reference. On GPU rotary runs fused into the QKV prologue kernel (kernels/qkv_prologue.py)."""

from __future__ import annotations

import torch


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, rotary_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2] float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
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
