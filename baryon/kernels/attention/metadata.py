"""Per-step attention metadata: how the flat token batch maps onto sequences and the paged cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from baryon.transfer import to_device_many


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
    # [num_seqs] int32 on device: each sequence's recurrent-state slot in linear-attention layers
    # (-1: no state kept); None in a model without such layers.
    state_slots: torch.Tensor | None = None

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


@dataclass
class HostMetadata:
    """A step's attention metadata on the host, before its arrays go to the device (together with
    the step's other inputs: `to_device_many`)."""

    num_tokens: int
    query_start32: np.ndarray  # [num_seqs + 1] int32
    seq_lens32: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, width] int32
    slot_mapping: np.ndarray  # [num_tokens] int64
    seq_of_token: np.ndarray | None  # [num_tokens]: per-token sequences' table rows, else None
    state_slots32: np.ndarray | None = None  # [num_seqs] int32: recurrent-state slots (hybrid models)

    def arrays(self) -> list[np.ndarray]:
        """What goes to the device, in the order `on_device` takes it back."""
        arrays = [self.query_start32, self.seq_lens32, self.block_tables, self.slot_mapping]
        return arrays + [a for a in (self.seq_of_token, self.state_slots32) if a is not None]

    def on_device(self, tensors: Sequence[torch.Tensor]) -> AttentionMetadata:
        """tensors: `arrays()` on the device."""
        query_start, seq_lens, tables, slot_mapping, *rest = tensors
        if self.seq_of_token is not None:
            # Each token's row of its sequence's table, gathered on the device (a row per token of
            # a long context would be megabytes to copy).
            tables = tables[rest.pop(0)]
        state_slots = rest.pop(0) if self.state_slots32 is not None else None
        num_new = np.diff(self.query_start32)
        return AttentionMetadata(
            num_tokens=self.num_tokens,
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            max_query_len=int(num_new.max()) if len(num_new) else 0,
            max_seq_len=int(self.seq_lens32.max()) if len(self.seq_lens32) else 0,
            query_start_loc_cpu=torch.from_numpy(self.query_start32),
            seq_lens_cpu=torch.from_numpy(self.seq_lens32),
            state_slots=state_slots,
        )


def host_metadata(layout: BatchLayout, block_tables: np.ndarray, per_token: bool = False,
                  state_slots: np.ndarray | None = None) -> HostMetadata:
    """The attention metadata of a step laid out as `layout`, on the host. per_token: every token
    is a sequence of its own (its prefix up to and including itself, same block table), so a step
    of several query tokens per sequence (speculative verification) runs as decodes: the decode
    kernels and the decode CUDA graphs serve it, causality holding since every token's K/V is
    written before attention reads the cache. state_slots: [num_seqs] int32, each sequence's
    recurrent-state slot (a hybrid model's step; never per token: such models verify no drafts)."""
    if per_token:
        if state_slots is not None:
            raise ValueError("a step of per-token sequences cannot carry recurrent-state slots")
        query_start = np.arange(len(layout.positions) + 1, dtype=np.int64)
        seq_lens = layout.positions + 1
    else:
        query_start = layout.query_start
        seq_lens = layout.positions[layout.query_start[1:] - 1] + 1 if len(layout.positions) else \
            np.zeros(0, dtype=np.int64)
    return HostMetadata(num_tokens=len(layout.positions), query_start32=query_start.astype(np.int32),
                        seq_lens32=seq_lens.astype(np.int32), block_tables=np.ascontiguousarray(block_tables),
                        slot_mapping=layout.slot_mapping, seq_of_token=layout.seq_of_token if per_token else None,
                        state_slots32=None if state_slots is None else state_slots.astype(np.int32))


def build_metadata(layout: BatchLayout, block_tables: np.ndarray, device: torch.device,
                   per_token: bool = False) -> AttentionMetadata:
    """`host_metadata` on the device, in one copy."""
    host = host_metadata(layout, block_tables, per_token)
    return host.on_device(to_device_many(host.arrays(), device))


def padding_metadata(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """The metadata of a forward pass of padding only (DP attention: a replica with nothing to run
    still runs the other replicas' MoE rows): num_tokens 0 (a CUDA graph's replay pads every row)
    or 1 (one eager token at position 0 that attends to itself and is stored nowhere)."""
    tables = np.zeros((num_tokens, 1), dtype=np.int32)
    counts = np.full(num_tokens, 1, dtype=np.int64)
    layout = batch_layout(tables, counts - 1, counts, block_size)
    layout.slot_mapping[:] = -1
    return build_metadata(layout, tables, device)
