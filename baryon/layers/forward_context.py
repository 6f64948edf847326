"""The per-step context the runner sets and attention layers read (without importing the runner)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from baryon.kernels.attention.metadata import AttentionMetadata

_attn_metadata: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _attn_metadata
    previous, _attn_metadata = _attn_metadata, metadata
    try:
        yield
    finally:
        _attn_metadata = previous


def current_attn_metadata() -> AttentionMetadata:
    if _attn_metadata is None:
        raise RuntimeError("attention called outside a forward context (the runner sets one per step)")
    return _attn_metadata
