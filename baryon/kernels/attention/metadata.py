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
    # The step's sequences as linear-attention layers walk them; None in a model without such layers.
    recurrent: RecurrentMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens_cpu.shape[0]


@dataclass
class DraftRows:
    """Speculative decoding in linear-attention layers, per sequence of a step ([S] int32 each).

    A verification step's tokens may be rejected, and a recurrent state cannot drop tokens it has
    taken in. So a sequence whose tokens are drafts (`target` >= 0) keeps its slot's state as it
    stood before them and records the tokens' layer inputs in pending block `target`; the next
    step of that sequence first folds in the `commit` of them that were accepted (read from block
    `source`), then walks its own tokens. A slot has two pending blocks (2 slot, 2 slot + 1), used
    in turn, so that a step records into one while it commits from the other."""

    commit: torch.Tensor  # tokens of block `source` to fold in before the step's own
    source: torch.Tensor  # the pending block they are read from (-1: none)
    target: torch.Tensor  # the pending block the step's tokens are recorded in (-1: they are final)
    active: bool  # (host) whether any sequence commits or records: the token walk serves the step


@dataclass
class RecurrentMetadata:
    """A step's sequences as linear-attention layers see them: the scheduled requests, even where
    attention runs a verification as one decode per token (`per_token`)."""

    query_start: torch.Tensor  # [S + 1] int32 on device
    seq_lens: torch.Tensor  # [S] int32 on device: tokens after this step (0: padding)
    slots: torch.Tensor  # [S] int32 on device: recurrent-state slots (-1: no state kept)
    max_query_len: int
    drafts: DraftRows | None = None  # None: an engine without speculative decoding

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


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
    # Hybrid models: [1 or 3, S + 1] int32, each row padded with one more entry: per_token, the
    # requests' query starts and sequence lengths first (else attention's layout is theirs); last,
    # their state slots.
    recurrent32: np.ndarray | None = None
    drafts32: np.ndarray | None = None  # [3, S] int32: DraftRows' commit, source, target

    def arrays(self) -> list[np.ndarray]:
        """What goes to the device, in the order `on_device` takes it back."""
        arrays = [self.query_start32, self.seq_lens32, self.block_tables, self.slot_mapping]
        return arrays + [a for a in (self.seq_of_token, self.recurrent32, self.drafts32) if a is not None]

    def on_device(self, tensors: Sequence[torch.Tensor]) -> AttentionMetadata:
        """tensors: `arrays()` on the device."""
        query_start, seq_lens, tables, slot_mapping, *rest = tensors
        if self.seq_of_token is not None:
            # Each token's row of its sequence's table, gathered on the device (a row per token of
            # a long context would be megabytes to copy).
            tables = tables[rest.pop(0)]
        recurrent = self._recurrent(rest.pop(0), rest.pop(0) if self.drafts32 is not None else None, query_start,
                                    seq_lens) if self.recurrent32 is not None else None
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
            recurrent=recurrent,
        )

    def _recurrent(self, layout: torch.Tensor, drafts: torch.Tensor | None, query_start: torch.Tensor,
                   seq_lens: torch.Tensor) -> RecurrentMetadata:
        num_seqs = self.recurrent32.shape[1] - 1
        own_layout = self.recurrent32.shape[0] == 3  # per_token: the requests' own
        starts = self.recurrent32[0] if own_layout else self.query_start32
        num_new = np.diff(starts)
        draft_rows = None if drafts is None else DraftRows(
            drafts[0], drafts[1], drafts[2], active=bool(self.drafts32[0].any() or (self.drafts32[2] >= 0).any()))
        return RecurrentMetadata(query_start=layout[0] if own_layout else query_start,
                                 seq_lens=layout[1, :num_seqs] if own_layout else seq_lens,
                                 slots=layout[-1, :num_seqs], max_query_len=int(num_new.max()) if num_seqs else 0,
                                 drafts=draft_rows)


def host_metadata(layout: BatchLayout, block_tables: np.ndarray, per_token: bool = False,
                  state_slots: np.ndarray | None = None, drafts: np.ndarray | None = None) -> HostMetadata:
    """The attention metadata of a step laid out as `layout`, on the host. per_token: every token
    is a sequence of its own (its prefix up to and including itself, same block table), so a step
    of several query tokens per sequence (speculative verification) runs as decodes: the decode
    kernels and the decode CUDA graphs serve it, causality holding since every token's K/V is
    written before attention reads the cache. state_slots: [num_seqs] int32, each sequence's
    recurrent-state slot (a hybrid model's step: its linear-attention layers walk the sequences of
    `layout`, per_token or not); drafts: [3, num_seqs] int32, their `DraftRows`."""
    seq_lens = layout.positions[layout.query_start[1:] - 1] + 1 if len(layout.positions) else \
        np.zeros(0, dtype=np.int64)
    query_start = layout.query_start
    recurrent = None
    if state_slots is not None:
        recurrent = np.zeros((3 if per_token else 1, len(state_slots) + 1), dtype=np.int32)
        recurrent[-1, :-1] = state_slots
        if per_token:
            recurrent[0], recurrent[1, :-1] = query_start, seq_lens
    if per_token:
        query_start = np.arange(len(layout.positions) + 1, dtype=np.int64)
        seq_lens = layout.positions + 1
    return HostMetadata(num_tokens=len(layout.positions), query_start32=query_start.astype(np.int32),
                        seq_lens32=seq_lens.astype(np.int32), block_tables=np.ascontiguousarray(block_tables),
                        slot_mapping=layout.slot_mapping, seq_of_token=layout.seq_of_token if per_token else None,
                        recurrent32=recurrent, drafts32=None if drafts is None else drafts.astype(np.int32))


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
