"""Sort a step's (token, expert) pairs by expert and pad each expert's run to the GEMM tile
height, so each tile of rows belongs to one expert (the layout of the sorted grouped GEMM).

`align_pairs` is the torch reference; `align_pairs_triton` computes exactly the same layout (pairs
in pair order within an expert) in three small kernels — count per chunk of pairs, offsets (one
program: the running sums over the chunks), scatter (whose programs also share out the blocks of
rows, naming each block's expert) — which matters from a few hundred tokens on, where the torch
version's dozen launches and sort cost more than the GEMMs. (Naming the blocks in the one-program
kernel took it ~12 us a layer at 256 tokens of top-8 on an H200, a third of the step's routing.) Only device tensors of sizes known before the step
runs are made (the padded length is bounded by the pair count): no host synchronisation, and the
step can be graph-captured."""

from __future__ import annotations

import torch

from baryon.kernels.triton_utils import next_power_of_2, tl, triton


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the sorted, padded layout can need."""
    return min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m)


def align_pairs(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [num_tokens, top_k] global expert ids. Pair p is token p // top_k's choice
    p % top_k. Returns

    - sorted_pairs [capacity] int32: pair indices grouped by local expert, in pair order within
      an expert, each expert's run padded to a multiple of block_m with num_pairs (no pair);
    - block_experts [capacity // block_m] int32: the local expert of each block of rows;
    - num_padded [1] int32: rows in use (blocks past it are empty).
    Pairs routed to experts outside this rank's range are left out."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long() - expert_start  # [num_pairs]
    num_pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_local_experts), flat, num_local_experts)  # others last
    order = torch.argsort(key, stable=True)  # pair indices by expert
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_local_experts] = 0
    padded_start = torch.cumsum(padded, 0) - padded  # [experts + 1]
    start = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_key]
    capacity = padded_capacity(num_pairs, num_local_experts, block_m)
    dest = torch.where(sorted_key < num_local_experts, padded_start[sorted_key] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)  # the extra last row takes the pairs left out
    padded_end = torch.cumsum(padded[:num_local_experts], 0)
    block_rows = torch.arange(capacity // block_m, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_rows, right=True).clamp_(max=num_local_experts - 1)
    return sorted_pairs[:capacity], block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


if triton is not None:

    @triton.jit
    def _local_ids(topk_ids, offs, num_pairs, expert_start, num_local):
        """Local expert of each pair (num_local for padding and for other ranks' experts)."""
        e = tl.load(topk_ids + offs, mask=offs < num_pairs, other=-1) - expert_start
        return tl.where((offs < num_pairs) & (e >= 0) & (e < num_local), e, num_local)

    @triton.jit
    def _count_kernel(topk_ids, counts, num_pairs, expert_start, num_local,
                      CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr):
        """counts[chunk, e]: pairs of this chunk routed to local expert e."""
        chunk = tl.program_id(0)
        experts = _local_ids(topk_ids, chunk * CHUNK + tl.arange(0, CHUNK), num_pairs, expert_start, num_local)
        tl.store(counts + chunk * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD), tl.histogram(experts, EXPERTS_PAD))

    @triton.jit
    def _offsets_kernel(counts, padded_start, padded_end, num_padded, num_chunks, num_local,
                        BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, ROWS: tl.constexpr):
        """One program: counts[chunk, e] becomes the pairs of expert e in earlier chunks; each
        expert's padded run start and end, and the rows in use."""
        e = tl.arange(0, EXPERTS_PAD)
        running = tl.zeros([EXPERTS_PAD], tl.int32)
        for first in range(0, num_chunks, ROWS):
            rows = first + tl.arange(0, ROWS)
            ptrs = counts + rows[:, None] * EXPERTS_PAD + e[None, :]
            tile = tl.load(ptrs, mask=rows[:, None] < num_chunks, other=0)
            tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=rows[:, None] < num_chunks)
            running += tl.sum(tile, axis=0)
        padded = tl.where(e < num_local, (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        end = tl.cumsum(padded, axis=0)
        tl.store(padded_start + e, end - padded)
        tl.store(padded_end + e, end)
        tl.store(num_padded, tl.sum(padded, axis=0))

    @triton.jit
    def _scatter_kernel(topk_ids, counts, padded_start, padded_end, sorted_pairs, block_experts, num_pairs,
                        expert_start, num_local, num_chunks, num_blocks,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                        BLOCKS: tl.constexpr):
        """Each pair to its row: its expert's run start + pairs of that expert before it. The
        programs also share out the blocks of rows: each block's expert (the first whose padded
        run ends past the block's first row)."""
        chunk = tl.program_id(0)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        experts = _local_ids(topk_ids, offs, num_pairs, expert_start, num_local)
        lane = tl.arange(0, CHUNK)
        before = (experts[:, None] == experts[None, :]) & (lane[None, :] < lane[:, None])  # [CHUNK, CHUNK]
        rank = tl.sum(before.to(tl.int32), axis=1)
        row = tl.load(padded_start + experts) + tl.load(counts + chunk * EXPERTS_PAD + experts) + rank
        tl.store(sorted_pairs + row, offs, mask=experts < num_local)
        e = tl.arange(0, EXPERTS_PAD)
        end = tl.load(padded_end + e)
        for first in range(chunk * BLOCKS, num_blocks, num_chunks * BLOCKS):
            blocks = first + tl.arange(0, BLOCKS)
            ended = (end[None, :] <= (blocks * BLOCK_M)[:, None]) & (e[None, :] < num_local)
            expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_local - 1)
            tl.store(block_experts + blocks, expert, mask=blocks < num_blocks)


def align_pairs_triton(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int,
                       block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exactly `align_pairs`, in three Triton kernels."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    chunk = 128
    num_chunks = triton.cdiv(num_pairs, chunk)
    experts_pad = next_power_of_2(num_local_experts + 1)
    capacity = padded_capacity(num_pairs, num_local_experts, block_m)
    num_blocks = capacity // block_m
    counts = torch.empty(num_chunks, experts_pad, dtype=torch.int32, device=device)
    padded_bounds = torch.empty(2, experts_pad, dtype=torch.int32, device=device)  # each run's start, end
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](topk_ids, counts, num_pairs, expert_start, num_local_experts,
                                 CHUNK=chunk, EXPERTS_PAD=experts_pad)
    # The chunks' running sums in one program, a tile of at most 16K counts at a time (a decode
    # step's few chunks in one tile, no rows of padding).
    rows = min(next_power_of_2(num_chunks), max(1, 16384 // experts_pad))
    _offsets_kernel[(1,)](counts, padded_bounds[0], padded_bounds[1], num_padded, num_chunks, num_local_experts,
                          BLOCK_M=block_m, EXPERTS_PAD=experts_pad, ROWS=rows,
                          num_warps=4 if rows * experts_pad <= 4096 else 16)
    _scatter_kernel[(num_chunks,)](topk_ids, counts, padded_bounds[0], padded_bounds[1], sorted_pairs, block_experts,
                                   num_pairs, expert_start, num_local_experts, num_chunks, num_blocks,
                                   BLOCK_M=block_m, CHUNK=chunk, EXPERTS_PAD=experts_pad,
                                   BLOCKS=max(1, 4096 // experts_pad), num_warps=8)
    return sorted_pairs, block_experts, num_padded
