"""Per-step attention metadata: how the flat token batch maps onto sequences and the paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from baryon.transfer import to_device


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


@dataclass
class BatchLayout:
    """Where a step's flat tokens sit: each token's sequence and position, and its cache slot."""

    query_start: np.ndarray  # [num_seqs + 1] int64
    seq_of_token: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64


def batch_layout(block_tables: np.ndarray, num_computed: np.ndarray, num_new: np.ndarray,
                 block_size: int) -> BatchLayout:
    """block_tables [num_seqs, width] int32; num_computed, num_new [num_seqs]: sequence i computes
    its tokens num_computed[i] .. num_computed[i] + num_new[i] - 1 this step."""
    query_start = np.zeros(len(num_new) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    seq_of_token = np.repeat(np.arange(len(num_new)), num_new)
    positions = np.arange(int(query_start[-1])) - query_start[seq_of_token] + num_computed[seq_of_token]
    slot_mapping = (block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    return BatchLayout(query_start, seq_of_token, positions, slot_mapping)


def build_metadata(layout: BatchLayout, block_tables: np.ndarray, device: torch.device,
                   per_token: bool = False) -> AttentionMetadata:
    """The attention metadata of a step laid out as `layout`. per_token: every token is a
    sequence of its own (its prefix up to and including itself, same block table), so a step of
    several query tokens per sequence (speculative verification) runs as decodes: the decode
    kernels and the decode CUDA graphs serve it, causality holding since every token's K/V is
    written before attention reads the cache."""
    tables = to_device(torch.from_numpy(np.ascontiguousarray(block_tables)), device)  # [num_seqs, width]
    if per_token:
        query_start = np.arange(len(layout.positions) + 1, dtype=np.int64)
        seq_lens = layout.positions + 1
        # Each token's row of its sequence's table, gathered on the device (a row per token of a
        # long context would be megabytes to copy).
        tables = tables[to_device(torch.from_numpy(layout.seq_of_token), device)]
    else:
        query_start = layout.query_start
        seq_lens = layout.positions[layout.query_start[1:] - 1] + 1 if len(layout.positions) else \
            np.zeros(0, dtype=np.int64)
    num_new = np.diff(query_start)
    query_start32, seq_lens32 = query_start.astype(np.int32), seq_lens.astype(np.int32)
    return AttentionMetadata(
        num_tokens=len(layout.positions),
        query_start_loc=to_device(torch.from_numpy(query_start32), device),
        seq_lens=to_device(torch.from_numpy(seq_lens32), device),
        block_tables=tables,
        slot_mapping=to_device(torch.from_numpy(layout.slot_mapping), device),
        max_query_len=int(num_new.max()) if len(num_new) else 0,
        max_seq_len=int(seq_lens32.max()) if len(seq_lens32) else 0,
        query_start_loc_cpu=torch.from_numpy(query_start32),
        seq_lens_cpu=torch.from_numpy(seq_lens32),
    )
