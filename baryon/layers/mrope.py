"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each token has three positions, temporal /
height / width, and each rotary frequency reads one of them (in sections, t t .. h h .. w w ..,
or interleaved, t h w t h w ..: `mrope_section` says how many each). An image's tokens sit on a grid (the same temporal position,
their row and column offsets); text tokens have one position on all three axes, where the rotation
is plain RoPE. So decodes and text use the plain table as every other model does, and only a step
that computes prompt tokens of an image request needs rows of its own: `step_rows` makes them from
the [3, num_tokens] positions, and the attention layers read them in place of the table for that
step, each token at its own row (`positions = arange(num_tokens)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from baryon.layers.rotary import RotaryEmbedding


def interleaved_axes(mrope_section: list[int], num_freqs: int) -> torch.Tensor:
    """Which axis (0 t, 1 h, 2 w) each of num_freqs frequencies reads, interleaved as Qwen3-VL lays
    them out: t h w t h w ..., h and w until their sections' counts run out (or the frequencies do:
    transformers cuts a section too long for small heads the same way), t for the rest."""
    axes = torch.zeros(num_freqs, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis:min(mrope_section[axis] * 3, num_freqs):3] = axis
    return axes


def sectioned_axes(mrope_section: list[int], num_freqs: int) -> torch.Tensor:
    """Qwen2-VL's layout: the first mrope_section[0] frequencies read t, the next h, then w (a
    rest past the sections: t again, as transformers' split of the frequencies gives it)."""
    axes, start = torch.zeros(num_freqs, dtype=torch.int64), 0
    for axis, count in enumerate(mrope_section):
        axes[start:start + count] = axis % 3
        start += count
    return axes


class MRotaryEmbedding(RotaryEmbedding):
    """The plain cos/sin table [max_position, rotary_dim] (text and decodes), plus the inverse
    frequencies and each frequency's axis to build a step's rows from three positions."""

    def __init__(self, table: RotaryEmbedding, inv_freq: torch.Tensor, scaling: float,
                 mrope_section: list[int], interleaved: bool) -> None:
        """table: the plain RoPE's; inv_freq [rotary_dim // 2] and scaling: its frequencies and the
        factor on cos / sin (rotary.inverse_frequencies); interleaved: Qwen3-VL's layout of the
        sections, else Qwen2-VL's."""
        super().__init__(table.cos_sin_cache)
        self.register_buffer("inv_freq", inv_freq.to(self.cos_sin_cache.device, torch.float32), persistent=False)
        self.register_buffer("axes", (interleaved_axes if interleaved else sectioned_axes)(mrope_section, inv_freq.numel()).to(self.cos_sin_cache.device), persistent=False)
        self.scaling = scaling
        self._table = self.cos_sin_cache

    def step_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, num_tokens] int64 -> cos/sin rows [num_tokens, rotary_dim] float32 (cos | sin)."""
        chosen = positions.gather(0, self.axes[:, None].expand(-1, positions.shape[1]))  # [freqs, num_tokens]
        freqs = chosen.t().to(torch.float32) * self.inv_freq  # [num_tokens, rotary_dim // 2]
        return torch.cat((freqs.cos() * self.scaling, freqs.sin() * self.scaling), dim=-1)

    @contextmanager
    def rows_for_step(self, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """Within it, the attention layers rotate token i by row i of this step's rows; yields the
        positions they are to be called with (arange(num_tokens))."""
        self.cos_sin_cache = self.step_rows(positions)
        try:
            yield torch.arange(positions.shape[1], device=positions.device)
        finally:
            self.cos_sin_cache = self._table
