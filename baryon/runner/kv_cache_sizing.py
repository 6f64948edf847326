"""How many KV-cache blocks the engine gets.

Every tensor-parallel rank sizes its own cache (its share of the KV heads) and all take the
smallest count. In order: an explicit `num_kv_blocks`; an explicit `kv_cache_memory_gib`; on CPU 4 GiB; on GPU
what `gpu_memory_utilization` of the device leaves after the weights, the peak activations of a
profiled forward pass at `max_num_batched_tokens` (and, with speculative decoding, of the largest
verification's sampling), the CUDA-graph memory pool (measured by
capturing the largest decode graph once on throwaway blocks) and memory outside torch. A cache that cannot
hold one request of `max_model_len` tokens is an error that says what would fit.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from baryon.config import EngineConfig
from baryon.distributed.parallel_state import min_over_ranks
from baryon.logger import get_logger
from baryon.request import Request
from baryon.sampling_params import SamplingParams

logger = get_logger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_GIB = 4.0


class SizedRunner(Protocol):
    """What the sizing needs of the model runner (runner/model_runner.py)."""

    device: torch.device
    block_size: int
    max_blocks_per_seq: int

    def kv_bytes_per_block(self) -> int: ...
    def bind_kv_cache(self, num_blocks: int | None) -> None: ...
    def cuda_graph_sizes(self) -> list[int]: ...
    def piecewise_graph_sizes(self) -> list[int]: ...
    def capture_cuda_graphs(self, decode_sizes: list[int], piecewise_sizes: list[int]) -> Any: ...
    def execute(self, scheduled: list[tuple[Request, int]]) -> Any: ...
    def profile_verify_sampling(self) -> Any: ...
    def profile_images(self) -> None: ...


def choose_num_blocks(config: EngineConfig, runner: SizedRunner) -> int:
    cache, max_model_len = config.cache, config.model.max_model_len
    per_block = runner.kv_bytes_per_block()
    blocks_per_seq = runner.max_blocks_per_seq
    if cache.num_kv_blocks is not None:
        num_blocks, source = cache.num_kv_blocks, "num_kv_blocks"
    elif cache.kv_cache_memory_gib is not None:
        num_blocks, source = int(cache.kv_cache_memory_gib * GiB) // per_block, "kv_cache_memory_gib"
    elif config.device.type == "cpu":
        num_blocks, source = int(DEFAULT_CPU_KV_CACHE_GIB * GiB) // per_block, "the CPU default"
        # More than every sequence at full length can never be used.
        num_blocks = min(num_blocks, config.scheduler.max_num_seqs * blocks_per_seq + 1)
    else:
        num_blocks, source = _blocks_from_gpu_memory(config, runner, per_block), "gpu_memory_utilization"
    num_blocks = min_over_ranks(num_blocks)  # tensor parallelism: every rank holds the same blocks
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache ({source}: {num_blocks} blocks of {config.cache.block_size} tokens, "
            f"{num_blocks * per_block / GiB:.2f} GiB) cannot hold one sequence of max_model_len="
            f"{max_model_len} tokens, which needs {blocks_per_seq} blocks "
            f"({blocks_per_seq * per_block / GiB:.2f} GiB). Give the cache more memory or use "
            f"max_model_len <= {num_blocks * config.cache.block_size}.")
    logger.info("KV cache: %d blocks x %d tokens (%.2f GiB, from %s); max concurrency at "
                "max_model_len=%d: %.1f requests", num_blocks, config.cache.block_size,
                num_blocks * per_block / GiB, source, max_model_len, num_blocks / blocks_per_seq)
    return num_blocks


def _blocks_from_gpu_memory(config: EngineConfig, runner: SizedRunner, per_block: int) -> int:
    device = config.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _profile_forward(config, runner)
    runner.profile_images()  # the vision tower's largest call (image-and-text models)
    if config.speculative is not None:
        runner.profile_verify_sampling()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    torch_peak = torch.cuda.max_memory_allocated(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    graph_pool = _cuda_graph_pool_bytes(runner)
    budget = total * config.cache.gpu_memory_utilization - torch_peak - non_torch - graph_pool
    logger.info("GPU memory: total %.1f GiB, peak in torch %.2f GiB (weights + activations), CUDA "
                "graphs %.2f GiB, outside torch %.2f GiB -> %.2f GiB for the KV cache", total / GiB,
                torch_peak / GiB, graph_pool / GiB, non_torch / GiB, max(budget, 0) / GiB)
    if budget <= 0:
        needed = (torch_peak + non_torch + graph_pool + runner.max_blocks_per_seq * per_block) / total
        raise ValueError(
            f"the model does not fit in gpu_memory_utilization={config.cache.gpu_memory_utilization}: "
            f"weights and activations take {torch_peak / GiB:.2f} GiB of {total / GiB:.1f} GiB; "
            f"use gpu_memory_utilization >= {min(needed, 1.0):.2f} or a smaller max_num_batched_tokens.")
    return int(budget) // per_block


def _cuda_graph_pool_bytes(runner: SizedRunner) -> int:
    """Memory the CUDA graphs will keep: their static buffers (inputs, logits) and the pools of
    the largest decode graph and the largest piecewise graphs, which the smaller ones reuse."""
    sizes, piecewise = runner.cuda_graph_sizes(), runner.piecewise_graph_sizes()
    if not sizes and not piecewise:
        return 0
    device = runner.device
    runner.bind_kv_cache(runner.max_blocks_per_seq)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    probe = runner.capture_cuda_graphs(sizes[-1:], piecewise[-1:])
    torch.cuda.empty_cache()
    pool = torch.cuda.memory_reserved(device) - before
    del probe
    runner.bind_kv_cache(None)
    torch.cuda.empty_cache()
    return max(pool, 0)


def _profile_forward(config: EngineConfig, runner: SizedRunner) -> None:
    """Run the largest step the scheduler can produce once, on throwaway cache blocks."""
    max_model_len, budget = config.model.max_model_len, config.scheduler.max_num_batched_tokens
    lengths = []
    while sum(lengths) < budget and len(lengths) < config.scheduler.max_num_seqs:
        lengths.append(min(max_model_len - 1, budget - sum(lengths)))
    blocks_needed = sum(-(-n // runner.block_size) for n in lengths)
    runner.bind_kv_cache(blocks_needed)
    scheduled, next_block = [], 0
    for i, n in enumerate(lengths):
        request = Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1), frozenset(), max_tokens=1)
        count = -(-n // runner.block_size)
        request.block_ids = list(range(next_block, next_block + count))
        next_block += count
        scheduled.append((request, n))
    runner.execute(scheduled)
    runner.bind_kv_cache(None)
    torch.cuda.empty_cache()
