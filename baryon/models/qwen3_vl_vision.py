"""Qwen3-VL's vision tower: images (as the image processor cuts them into patches) to the embeddings
that replace the prompt's image placeholder tokens, plus the DeepStack features that the first
language-model layers add at those tokens.

patches [num_patches, C * T * P * P] (each image's patches in the processor's order: blocks of
merge x merge neighbours) -> patch embedding (the checkpoint's Conv3d with stride = kernel, as one
linear) + the learned position grid resampled to the image's grid -> ViT blocks (LayerNorm,
attention over each image alone with 2D rotary, GELU MLP) -> the merger (merge x merge patches ->
one language-model token). DeepStack: after the blocks in `deepstack_visual_indexes`, a merger of
their own makes [num_tokens, out_hidden] features for language-model layers 0, 1, ...
Module names follow the checkpoint (`model.visual.*`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from baryon.kernels.rotary import rotate_neox
from baryon.layers.linear import ReplicatedLinear, copy_checked
from baryon.layers.norm import LayerNorm


def _loaded_param(shape: tuple[int, ...]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = lambda p, loaded, shard_id=None: copy_checked(p.data, loaded)
    param.expected_shards = frozenset([None])
    return param


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, hidden_size: int,
                 bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = _loaded_param((hidden_size, in_channels, temporal_patch_size, patch_size, patch_size))
        self.proj.bias = _loaded_param((hidden_size,)) if bias else None

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [num_patches, C * T * P * P] -> [num_patches, hidden]."""
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = ReplicatedLinear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = ReplicatedLinear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """x [num_patches, hidden]; cos / sin [num_patches, 1, head_dim // 2] float32
        (`VisionRotary`); segments: the spans that attend alone (images, frames or windows) grouped
        by length (`segment_groups`)."""
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
        out = torch.empty_like(q)
        for index, length in segments:
            # [spans, heads, length, head_dim] each: four dimensions, contiguous, what the flash kernels
            # take (a 3-D strided view ran the float32 math path on an H200, 4x slower)
            shaped = [t.index_select(0, index).view(-1, length, *t.shape[1:]).transpose(1, 2).contiguous()
                      for t in (q, k, v)]
            attended = F.scaled_dot_product_attention(*shaped)  # [spans, heads, length, head_dim]
            out.index_copy_(0, index, attended.transpose(1, 2).reshape(-1, *q.shape[1:]))
        return self.proj(out.reshape(num_patches, -1))


def segment_groups(lengths: list[int], device: torch.device) -> list[tuple[torch.Tensor, int]]:
    """Consecutive spans of these lengths, grouped by length: (the patch indices of every span of
    that length, span after span [spans * length], the length). Spans of one length attend in one
    batched call (64 images of a size, or a Qwen2.5-VL image's windows)."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for length in lengths:
        starts.setdefault(length, []).append(offset)
        offset += length
    return [((torch.tensor(spans)[:, None] + torch.arange(length)).reshape(-1).to(device), length)
            for length, spans in starts.items()]


class VisionRotary(nn.Module):
    """The towers' 2D rotary: a quarter of each head's frequencies turned by the patch's row,
    the next quarter by its column (the pairs of the NeoX rotation over the whole head)."""

    def __init__(self, config: Any, width: int, merge: int) -> None:
        super().__init__()
        head_dim = width // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta ** exponents, persistent=False)  # [head_dim // 4]
        self.merge = merge

    def forward(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Every patch's angles [num_patches, head_dim // 2] (row | column), in the processor's order."""
        rows, cols = [], []
        for t, h, w in grids:
            order = merge_order(h, w, self.merge, self.inv_freq.device)
            rows.append((order // w).repeat(t))
            cols.append((order % w).repeat(t))
        rows, cols = torch.cat(rows).float(), torch.cat(cols).float()
        return torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """angles [num_patches, head_dim // 2] -> cos, sin [num_patches, 1, head_dim // 2] (rotate_neox's)."""
    return angles.cos()[:, None], angles.sin()[:, None]


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision_config.hidden_act {hidden_act!r} is not supported; supported: "
                             f"gelu_pytorch_tanh, gelu")
        self.approximate = "tanh" if hidden_act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = ReplicatedLinear(hidden_size, intermediate_size, bias=True)
        self.linear_fc2 = ReplicatedLinear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """A pre-norm ViT block: x + attention(norm1(x)), then + mlp(norm2(x)); the norm kind and
    the MLP are the tower's (Qwen3-VL: LayerNorm, GELU-tanh; Qwen2.5-VL: RMSNorm, gated SiLU)."""

    def __init__(self, width: int, num_heads: int, norm: type[nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(width, 1e-6)
        self.norm2 = norm(width, 1e-6)
        self.attn = VisionAttention(width, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one token of out_hidden features; the norm before the
    merge (the final merger) or after it (DeepStack's)."""

    def __init__(self, config: Any, norm_after_merge: bool) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size ** 2
        self.merged = merged
        self.norm_after_merge = norm_after_merge
        self.norm = LayerNorm(merged if norm_after_merge else config.hidden_size, 1e-6)
        self.linear_fc1 = ReplicatedLinear(merged, merged, bias=True)
        self.linear_fc2 = ReplicatedLinear(merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_patches, hidden] -> [num_patches / merge^2, out_hidden]."""
        x = self.norm(x.reshape(-1, self.merged)) if self.norm_after_merge else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, config: Any, deepstack: bool = True) -> None:
        """deepstack: build the DeepStack mergers of config.deepstack_visual_indexes (Qwen3.5's tower
        has none, whatever its config says)."""
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = _loaded_param((config.num_position_embeddings, config.hidden_size))
        self.grid_side = int(config.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(
            VisionBlock(config.hidden_size, config.num_heads, LayerNorm,
                        VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
            for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes) if deepstack else []
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, norm_after_merge=True)
                                                   for _ in self.deepstack_visual_indexes)
        self.rotary = VisionRotary(config, config.hidden_size, self.merge)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """patches [num_patches, C * T * P * P] of the images whose (t, h, w) patch grids are `grids`
        -> (embeddings [num_tokens, out_hidden], DeepStack features [len(indexes), num_tokens,
        out_hidden]); num_tokens = num_patches / merge^2, the images' tokens in order."""
        x = self.patch_embed(patches)  # [num_patches, hidden]
        x = x + self._grid_embeddings(grids).to(x.dtype)
        cos, sin = cos_sin(self.rotary(grids))
        segments = segment_groups([h * w for t, h, w in grids for _ in range(t)], x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        embeddings = self.merger(x)
        features = torch.stack(deepstack) if deepstack else embeddings.new_zeros((0, *embeddings.shape))
        return embeddings, features

    def _grid_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned side x side position grid resampled bilinearly (corners aligned) to each
        image's h x w patches, in the processor's patch order: [num_patches, hidden]."""
        side, table = self.grid_side, self.pos_embed.weight.float().view(self.grid_side, self.grid_side, -1)
        out = []
        for t, h, w in grids:
            (r0, r1, rw), (c0, c1, cw) = _taps(h, side, table.device), _taps(w, side, table.device)
            top = table[r0][:, c0] * (1 - cw)[None, :, None] + table[r0][:, c1] * cw[None, :, None]
            bottom = table[r1][:, c0] * (1 - cw)[None, :, None] + table[r1][:, c1] * cw[None, :, None]
            grid = top * (1 - rw)[:, None, None] + bottom * rw[:, None, None]  # [h, w, hidden]
            out.append(grid.reshape(h * w, -1)[merge_order(h, w, self.merge, table.device)].repeat(t, 1))
        return torch.cat(out)


def merge_order(h: int, w: int, merge: int, device: torch.device) -> torch.Tensor:
    """Raster indices of an h x w patch grid in the processor's patch order (merge x merge blocks)."""
    raster = torch.arange(h * w, device=device).view(h // merge, merge, w // merge, merge)
    return raster.transpose(1, 2).reshape(-1)


def _taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps with aligned corners from `side` table entries to `size` samples: (lower index,
    upper index, upper weight), each [size]."""
    source = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lower = source.floor().long().clamp(0, side - 1)
    return lower, (lower + 1).clamp(max=side - 1), source - lower
