"""Qwen2-VL's and Qwen2.5-VL's vision towers: images (as the image processor cuts them into 14 x 14
patches) to the embeddings that replace the prompt's image placeholder tokens.

patches [num_patches, C * T * P * P] -> patch embedding (the checkpoint's bias-free Conv3d, as one
linear) -> ViT blocks with 2D rotary (no learned position grid) -> the merger (a norm, then merge x
merge patches -> one language-model token through a GELU MLP).
- Qwen2-VL: LayerNorm blocks, a QuickGELU MLP of `embed_dim * mlp_ratio`, attention over each image.
- Qwen2.5-VL: RMSNorm blocks, a SiLU-gated MLP, and window attention: the merged tokens are laid out
  window by window (`window_size` pixels a side, the last windows of a row or column cut short) and
  every block but those in `fullatt_block_indexes` attends within its window; the merger's tokens
  go back to the image's order at the end.
Module names follow the checkpoint (`visual.*` / `model.visual.*`). No DeepStack features.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from baryon.layers.linear import MergedReplicatedLinear, ReplicatedLinear
from baryon.layers.norm import LayerNorm, RMSNorm
from baryon.models.qwen3_vl_vision import PatchEmbed, VisionBlock, VisionRotary, cos_sin, segment_groups


class _QuickGeluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(hidden_size, intermediate_size, bias=True)
        self.fc2 = ReplicatedLinear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        return self.fc2(x * torch.sigmoid(1.702 * x))


class _GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedReplicatedLinear(hidden_size, [intermediate_size] * 2, bias=True)  # gate | up
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _Merger(nn.Module):
    def __init__(self, width: int, merge: int, out_hidden: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.merged = width * merge ** 2
        self.ln_q = norm(width, 1e-6)
        self.mlp = nn.Sequential(ReplicatedLinear(self.merged, self.merged, bias=True), nn.GELU(),
                                 ReplicatedLinear(self.merged, out_hidden, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


class Qwen2VLVisionModel(nn.Module):
    def __init__(self, config: Any, windowed: bool) -> None:
        """windowed: Qwen2.5-VL's tower (RMSNorm, gated MLP, window attention); else Qwen2-VL's."""
        super().__init__()
        self.merge = config.spatial_merge_size
        width = config.hidden_size if windowed else config.embed_dim
        out_hidden = config.out_hidden_size if windowed else config.hidden_size
        if not windowed and config.hidden_act != "quick_gelu":
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not supported; Qwen2-VL's is quick_gelu")
        if windowed and config.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not supported; Qwen2.5-VL's is silu")
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size, width,
                                      bias=False)
        norm = RMSNorm if windowed else LayerNorm
        self.blocks = nn.ModuleList(
            VisionBlock(width, config.num_heads, norm,
                   _GatedMLP(width, config.intermediate_size) if windowed else
                   _QuickGeluMLP(width, width * config.mlp_ratio))
            for _ in range(config.depth))
        self.merger = _Merger(width, self.merge, out_hidden, norm)
        # Qwen2.5-VL: the window's side in merged tokens; the blocks that attend over whole images
        self.window = config.window_size // self.merge // config.patch_size if windowed else None
        self.full_attention_blocks = set(config.fullatt_block_indexes) if windowed else set(range(config.depth))
        self.rotary = VisionRotary(config, width, self.merge)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """patches [num_patches, C * T * P * P] of the images whose (t, h, w) patch grids are `grids`
        -> (embeddings [num_tokens, out_hidden], no DeepStack features [0, num_tokens, out_hidden])."""
        device = self.rotary.inv_freq.device
        units = self.merge ** 2  # patches of one merged token, adjacent in the processor's order
        angles = self.rotary(grids)  # [num_patches, head_dim // 2]
        x = self.patch_embed(patches)  # [num_patches, width]
        images = windows = segment_groups([h * w for t, h, w in grids for _ in range(t)], device)
        if self.window is not None:  # lay the merged tokens out window by window
            token_order, window_lengths = _window_order(grids, self.merge, self.window)
            windows = segment_groups(window_lengths, device)
            token_order = torch.from_numpy(token_order).to(device)
            x = x.view(-1, units, x.shape[-1])[token_order].reshape(x.shape)
            angles = angles.view(-1, units, angles.shape[-1])[token_order].reshape(angles.shape)
        cos, sin = cos_sin(angles)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, images if i in self.full_attention_blocks else windows)
        embeddings = self.merger(x)  # [num_tokens, out_hidden]
        if self.window is not None:
            embeddings = embeddings[torch.argsort(token_order)]
        return embeddings, embeddings.new_zeros((0, *embeddings.shape))


def _window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows: the merged tokens (indices over all images, in the processor's order)
    window by window, and each window's patch count. Per image and frame the windows go row by row
    over its merged grid, `window` tokens a side (cut short at the bottom and right edges)."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        tokens = base + np.arange(t * rows * cols).reshape(t, rows, cols)
        for frame in range(t):
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    block = tokens[frame, top:top + window, left:left + window].reshape(-1)
                    order.append(block)
                    lengths.append(len(block) * merge ** 2)
        base += t * rows * cols
    return np.concatenate(order), lengths
