"""Per-step attention metadata: how the flat token batch maps onto sequences and the paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the runner; read by every attention layer.

    A step's tokens are laid out flat, sequence after sequence. Sequence i owns query tokens
    query_start_loc[i]:query_start_loc[i+1]; they are the last tokens of its seq_lens[i] tokens
    in the cache (so a decode has one query token, a prefill chunk many, after a cached prefix).
    """

    num_tokens: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 on device
    seq_lens: torch.Tensor  # [num_seqs] int32 on device: cached + new tokens, after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32 on device (pad: 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64 on device: cache slot of each token; -1 = skip
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor  # [num_seqs + 1] int32 on host
    seq_lens_cpu: torch.Tensor  # [num_seqs] int32 on host
    # Per-step work a backend derives from this metadata once and reuses in every layer.
    backend_scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens_cpu.shape[0]
