"""CUDA graphs for steps with prefill chunks: the forward pass cut at every attention layer.

Attention over a mixed batch reads per-step host data (query tiles, sequence lengths), so it runs
eagerly; everything between two attention layers (norms, projections, the MLP or the experts) is
one CUDA graph per token-count bucket. A step of n tokens is padded to the next bucket (padding
rows: token 0 at position 0; attention sees only the n real tokens, and every other op treats
rows independently, so padding never reaches a real row) and runs piece 0, attention 0, piece 1,
... attention L-1, piece L. Each attention reads the query/key/value the graph before it left in
the pool and writes into a static buffer the graph after it reads.

Capture: per bucket (largest first, one memory pool), one eager warm-up forward (kernels compile
and pick their tiles outside any capture), then the forward again with the attention layers
intercepted: each interception ends the current graph, records what attention will read and
write, and begins the next graph.
"""

from __future__ import annotations

import bisect
import gc
import time
from dataclasses import dataclass

import torch
from torch import nn

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.layers.attention import Attention, intercept_attention
from baryon.layers.forward_context import forward_context
from baryon.logger import get_logger
from baryon.runner.cuda_graph import capture_times

logger = get_logger(__name__)


PIECEWISE_MAX_TOKENS = 2048


def default_piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token-count buckets for steps with prefill chunks: fine steps while launch overhead is a
    large share of a step, coarser up to 2048 tokens (larger steps are dominated by GPU work);
    a step budget below that is a bucket of its own (the size of every full prefill chunk)."""
    sizes = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, PIECEWISE_MAX_TOKENS]
    budget = [max_num_batched_tokens] if max_num_batched_tokens <= PIECEWISE_MAX_TOKENS else []
    return [s for s in sizes if s < max_num_batched_tokens] + budget


@dataclass
class _AttentionCall:
    """One attention layer of a captured forward: what it reads and where it writes."""

    layer: Attention
    qkv: torch.Tensor  # [bucket, (heads + 2 * kv_heads) * head_dim], in the graph pool
    extra: tuple  # cos_sin_cache, q_norm_weight, k_norm_weight, eps
    output: torch.Tensor  # [bucket, heads * head_dim], static


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # num_attention_layers + 1 pieces
    calls: list[_AttentionCall]
    hidden: torch.Tensor  # [bucket, hidden], the last piece's output


class PiecewiseGraphRunner:
    def __init__(self, model: nn.Module, sizes: list[int], max_model_len: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = sorted(set(sizes))
        largest = self.sizes[-1]
        self.max_model_len, self.max_blocks_per_seq, self.device = max_model_len, max_blocks_per_seq, device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.attn_outputs: dict[int, torch.Tensor] = {}  # output width -> [largest, width], static
        self.captured: dict[int, _Captured] = {}

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def _warmup_metadata(self, size: int) -> AttentionMetadata:
        """`size` prompt tokens in sequences of at most max_model_len, storing nothing."""
        lengths = [min(self.max_model_len, size - start) for start in range(0, size, self.max_model_len)]
        starts = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        tables = torch.arange(self.max_blocks_per_seq, dtype=torch.int32).repeat(len(lengths), 1)
        device = self.device
        return AttentionMetadata(
            num_tokens=size, query_start_loc=starts.to(device), seq_lens=seq_lens.to(device),
            block_tables=tables.to(device), slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
            max_query_len=max(lengths), max_seq_len=max(lengths), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        seconds = {}  # size -> its warm-up and capture, wall time (start-up diagnosis)
        gc.collect()
        gc.disable()  # a collection during capture could free tensors the graphs use
        try:
            for size in reversed(self.sizes):
                start = time.perf_counter()
                with forward_context(self._warmup_metadata(size)):
                    self.model(self.input_ids[:size], self.positions[:size])  # warm-up
                torch.cuda.synchronize(self.device)
                with torch.cuda.stream(stream):
                    self.captured[size] = self._capture_size(size, pool)
                torch.cuda.synchronize(self.device)
                seconds[size] = time.perf_counter() - start
        finally:
            gc.enable()
        logger.info("captured piecewise CUDA graphs for steps of up to %s tokens (%d pieces each) in %s",
                    self.sizes, len(next(iter(self.captured.values())).graphs), capture_times(seconds))

    def _capture_size(self, size: int, pool) -> _Captured:
        graphs, calls = [torch.cuda.CUDAGraph()], []

        def cut(layer: Attention, qkv: torch.Tensor, positions: torch.Tensor, *extra) -> torch.Tensor:
            graphs[-1].capture_end()
            width = layer.num_heads * layer.head_dim
            if width not in self.attn_outputs:
                self.attn_outputs[width] = torch.zeros(self.sizes[-1], width, dtype=qkv.dtype, device=qkv.device)
            output = self.attn_outputs[width][:size]
            calls.append(_AttentionCall(layer, qkv, extra, output))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return output

        graphs[0].capture_begin(pool=pool)
        with intercept_attention(cut):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        graphs[-1].capture_end()
        return _Captured(graphs, calls, hidden)

    def release(self) -> None:
        """Free the captured graphs (see CUDAGraphRunner.release)."""
        for captured in self.captured.values():
            for graph in captured.graphs:
                graph.reset()
        self.captured.clear()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The forward pass of a step of metadata.num_tokens tokens -> hidden [num_tokens, hidden]."""
        n = metadata.num_tokens
        size = self.padded_size(n)
        captured = self.captured[size]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
        with forward_context(metadata):
            for graph, call in zip(captured.graphs, captured.calls):
                graph.replay()
                call.layer._prologue_and_attend(call.qkv[:n], self.positions[:n], *call.extra, output=call.output[:n])
            captured.graphs[-1].replay()
        return captured.hidden[:n]
