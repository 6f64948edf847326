"""The per-step context the runner sets and the layers read (without importing the runner): the
attention metadata, with DP attention the token count every replica pads its MoE input to, and in
a step with image prompts their positions and vision embeddings."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from baryon.kernels.attention.metadata import AttentionMetadata


@dataclass
class DPStep:
    """DP attention: what the replicas agreed on for one forward pass (every replica runs it, with
    the same MoE collectives): the rows each pads its MoE input to, and the decode graph size all
    replay (None: every replica runs it eagerly)."""

    padded_tokens: int
    graph_size: int | None


_attn_metadata: AttentionMetadata | None = None
_dp_padded_tokens: int | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata, dp_padded_tokens: int | None = None) -> Iterator[None]:
    """dp_padded_tokens: DP attention's agreed MoE row count for this step (None: this replica's
    own token count, as when every replica runs the same profiling or capture step)."""
    global _attn_metadata, _dp_padded_tokens
    previous = _attn_metadata, _dp_padded_tokens
    _attn_metadata, _dp_padded_tokens = metadata, dp_padded_tokens
    try:
        yield
    finally:
        _attn_metadata, _dp_padded_tokens = previous


def current_attn_metadata() -> AttentionMetadata:
    if _attn_metadata is None:
        raise RuntimeError("attention called outside a forward context (the runner sets one per step)")
    return _attn_metadata


def current_dp_padded_tokens(num_tokens: int) -> int:
    """The rows every DP-attention replica's MoE input has this step (at least num_tokens, this
    replica's own)."""
    if _dp_padded_tokens is None:
        return num_tokens
    if _dp_padded_tokens < num_tokens:
        raise RuntimeError(f"the replicas agreed on {_dp_padded_tokens} MoE rows for a step of {num_tokens} tokens")
    return _dp_padded_tokens


@dataclass
class MultiModalStep:
    """A step that computes prompt tokens of image requests: their multimodal-RoPE
    positions and the vision tower's outputs for the image tokens among them."""

    positions: torch.Tensor  # [3, num_tokens] int64: every token's (t, h, w) position
    rows: torch.Tensor  # [n] int64: the step's image tokens (indices into its tokens)
    embeddings: torch.Tensor  # [n, hidden]: what replaces their token embeddings
    deepstack: torch.Tensor  # [k, n, hidden]: added at those rows after language-model layers 0 .. k-1


_multimodal_step: MultiModalStep | None = None


@contextmanager
def multimodal_context(step: MultiModalStep | None) -> Iterator[None]:
    global _multimodal_step
    previous, _multimodal_step = _multimodal_step, step
    try:
        yield
    finally:
        _multimodal_step = previous


def current_multimodal_step() -> MultiModalStep | None:
    return _multimodal_step
