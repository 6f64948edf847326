"""CUDA graphs for decode-only steps: the forward pass and the LM head of every row.

One graph per batch-size bucket (1, 2, 4, 8, then every 16 up to max_num_seqs, or the configured
list), captured largest first into one shared memory pool, over static input buffers. A decode
step of n requests copies its inputs into the buffers, pads to the next captured size (padding
rows: token 0, slot -1 so nothing is stored, sequence length 0 so nothing is attended nor any
recurrent state touched) and replays.
Every graph writes its logits (the LM head function's output: the whole vocabulary, or the target's
vocabulary slice of this rank) into one shared static buffer, so the pool holds no per-graph output;
with `features` (a draft that reads the target's hidden states) also what that function makes of
the hidden states, into a second static buffer.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable

import torch

from baryon.kernels.attention.metadata import AttentionMetadata, DraftRows, RecurrentMetadata
from baryon.layers.forward_context import forward_context
from baryon.logger import get_logger
from baryon.runner.compilation import ModelForward

logger = get_logger(__name__)


def capture_times(seconds: dict[int, float]) -> str:
    """'12.3 s (slowest: size 256, 1.2 s)' for the wall time each captured size took."""
    slowest = max(seconds, key=seconds.get)
    return f"{sum(seconds.values()):.1f} s (slowest: size {slowest}, {seconds[slowest]:.1f} s)"


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class CUDAGraphRunner:
    def __init__(self, forward: ModelForward, logits_into: Callable[[torch.Tensor, torch.Tensor], None],
                 logits_width: int, logits_dtype: torch.dtype, capture_sizes: list[int],
                 max_blocks_per_seq: int, device: torch.device,
                 features: Callable[[torch.Tensor], torch.Tensor] | None = None, features_dim: int = 0) -> None:
        self.forward = forward  # the model's forward, compiled or not
        self.logits_into = logits_into  # (hidden [n, hidden], out [n, logits_width]): the LM head
        self.features_of = features  # hidden [n, hidden] -> [n, features_dim], kept in self.features
        self.sizes = sorted(set(capture_sizes))
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Hybrid models: the sequences the linear-attention layers walk (one a request: a verification's
        # tokens are one sequence there, though attention runs them as decodes), their DraftRows.
        self.recurrent_query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.recurrent_seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.state_slots = torch.full((largest,), -1, dtype=torch.int32, device=device)
        self.drafts = torch.tensor([[0], [-1], [-1]], dtype=torch.int32, device=device).repeat(1, largest)  # [3, largest]
        self.has_recurrent = self.with_drafts = False  # (set_recurrent)
        self.recurrent_max_query_len = 1  # the most tokens a recurrent sequence has (a verification's)
        self.logits = torch.empty(largest, logits_width, dtype=logits_dtype, device=device)  # [largest, width]
        self.features = torch.empty(largest, features_dim, dtype=logits_dtype, device=device) if features else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def set_recurrent(self, max_query_len: int, with_drafts: bool) -> None:
        """Before capture, a hybrid model's: its graphs walk sequences of up to max_query_len
        tokens, with DraftRows (speculative decoding) or without."""
        self.has_recurrent = True
        self.recurrent_max_query_len, self.with_drafts = max_query_len, with_drafts

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs decodes runs at (None: too large for graphs)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=size, query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size], max_query_len=1,
            max_seq_len=self.block_tables.shape[1],  # not read by the graph-safe kernels
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(size, dtype=torch.int32),
            recurrent=RecurrentMetadata(self.recurrent_query_start[:size + 1], self.recurrent_seq_lens[:size],
                                        self.state_slots[:size], self.recurrent_max_query_len,
                                        DraftRows(*self.drafts[:, :size], active=False) if self.with_drafts else None))

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        seconds = {}  # size -> its warm-up and capture, wall time (start-up diagnosis)
        gc.collect()
        gc.disable()  # a collection during capture could free tensors the graph uses
        try:
            for size in reversed(self.sizes):
                start = time.perf_counter()
                with forward_context(self._metadata(size)):
                    self._step(size)  # warm-up (autotune, allocations)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._step(size)
                pool = graph.pool()
                self.graphs[size] = graph
                seconds[size] = time.perf_counter() - start
        finally:
            gc.enable()
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s in %s", self.sizes, capture_times(seconds))

    def release(self) -> None:
        """Free the captured graphs. NCCL's process-group teardown waits forever on a graph that
        captured its collectives and is still alive (pytorch#115388), so multi-GPU engines
        release theirs before leaving the group."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def _step(self, size: int) -> None:
        hidden = self.forward(self.input_ids[:size], self.positions[:size])
        self.logits_into(hidden, self.logits[:size])
        if self.features_of is not None:
            self.features[:size].copy_(self.features_of(hidden))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            size: int | None = None) -> torch.Tensor:
        """Replay the decode step of metadata.num_seqs sequences in the graph of `size` (default:
        the smallest that holds them); returns the LM head's output [num_seqs, logits_width] as it
        wrote it (the model's dtype; valid until the next replay)."""
        n = metadata.num_seqs
        size = self.padded_size(n) if size is None else size
        graph = self.graphs[size]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        if self.has_recurrent:
            self._copy_recurrent(metadata.recurrent, size)
        if size > n:  # padding rows store nothing and attend to nothing
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        graph.replay()
        return self.logits[:n]

    def _copy_recurrent(self, recurrent: RecurrentMetadata | None, size: int) -> None:
        """The step's recurrent sequences into the static buffers (None: none, DP attention's
        padding); the graph's other sequences (up to `size`) are padding: length 0, which every
        kernel of theirs reads first and returns on (their other entries stay as they were)."""
        s = recurrent.num_seqs if recurrent is not None else 0
        if recurrent is not None:
            self.recurrent_query_start[:s + 1].copy_(recurrent.query_start)
            self.recurrent_seq_lens[:s].copy_(recurrent.seq_lens)
            self.state_slots[:s].copy_(recurrent.slots)
            if recurrent.drafts is not None:
                drafts = recurrent.drafts
                for row, values in zip(self.drafts, (drafts.commit, drafts.source, drafts.target)):
                    row[:s].copy_(values)
        self.recurrent_seq_lens[s:size].zero_()
