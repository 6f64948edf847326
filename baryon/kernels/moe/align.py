"""Sort a step's (token, expert) pairs by expert and pad each expert's run to the GEMM tile
height, so each tile of rows belongs to one expert (the layout of the sorted grouped GEMM).

Only device tensors of sizes known before the step runs are made (the padded length is bounded
by the pair count), so there is no host synchronisation and the step can be graph-captured."""

from __future__ import annotations

import torch


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
