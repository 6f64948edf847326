"""The tensor-parallel all-reduce family on CPU: the selector's choice, and the fused all-reduce
+ residual add + RMSNorm kernel in Triton's interpreter, its peer simulated in the same process
(the peer's row and its signal written by hand before this rank's launch). Two GPUs run the real
thing in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels import selector
from baryon.kernels.triton_utils import triton
from tests.conftest import run_in_ranks

HIDDEN = 48  # not a power of two: masked columns


def test_cpu_reduces_with_torch_distributed():
    assert selector.select("all_reduce", torch.device("cpu"), world_size=2).name == "torch"
    from baryon.kernels.all_reduce import SymmMemOneShotAllReduce
    from baryon.kernels.all_reduce_rms_norm import SymmMemFusedAllReduce

    for cls in (SymmMemFusedAllReduce, SymmMemOneShotAllReduce):
        assert cls.unsupported_reason(torch.device("cpu")) is not None
        assert "one rank" in cls.cannot_implement_reason(world_size=1)


def _create_rank(rank: int, world: int, init_method: str, rendezvous_before: list[int]) -> tuple[str, int]:
    """A spawned gloo rank: SymmMemOneShotAllReduce.create where this rank's process has set up
    symmetric memory `rendezvous_before[rank]` times before; the buffer set-up is replaced by a recorder that fails
    as it would on a CPU. Returns (the reducer's name, set-ups attempted)."""
    import torch.distributed as dist

    from baryon.kernels import all_reduce

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        all_reduce._rendezvous_count = rendezvous_before[rank]
        attempts = []

        class Recorded(all_reduce.SymmMemOneShotAllReduce):
            def __init__(self, *args, **kwargs) -> None:
                attempts.append(args)
                raise RuntimeError("no symmetric memory on a CPU")

        reducer = Recorded.create(dist.group.WORLD, torch.device("cpu"), torch.float32)
        summed = reducer(torch.full((3,), float(rank + 1)))
        assert summed.tolist() == [sum(range(1, world + 1))] * 3
        return reducer.name, len(attempts)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rendezvous_before", [[0, 0], [2, 0], [0, 3], [2, 2], [3, 2]])
def test_one_shot_set_up_only_where_ranks_rendezvoused_alike(rendezvous_before):
    """torch counts symmetric-memory rendezvous per process, so a process that set up more of them
    (for an earlier engine) cannot meet fresh workers: then no rank of the group tries (each would
    wait for the others) and all take NCCL's all-reduce (gloo's here); where the counts agree
    (fresh processes, or the same processes building a second reducer) every rank tries and
    falls back together when the set-up fails."""
    results = run_in_ranks(_create_rank, 2, rendezvous_before)
    tried = rendezvous_before[0] == rendezvous_before[1]
    assert results == {0: ("torch", int(tried)), 1: ("torch", int(tried))}


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the simulated peer lives in host memory")
def test_fused_kernel_with_a_simulated_peer(seed):
    from baryon.kernels.all_reduce_rms_norm import (FENCE_THREADS, FUSED_MAX_HIDDEN, FUSED_MAX_ROWS,
                                                    all_reduce_add_rms_norm, all_reduce_add_rms_norm_reference)

    generator = torch.Generator().manual_seed(seed)
    world, rank, peer = 2, 1, 0  # this rank is 1: its own part is added second
    buffers = [torch.zeros(2, FUSED_MAX_ROWS, FUSED_MAX_HIDDEN) for _ in range(world)]
    flags = [torch.zeros(FUSED_MAX_ROWS, world, dtype=torch.int32) for _ in range(world)]
    counters = torch.zeros(FUSED_MAX_ROWS, dtype=torch.int32)
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    weight = torch.randn(HIDDEN, generator=generator)
    for rows in (3, 5, 2, 5, 300):  # rows 2-4 sit out some calls: their counts lag; 300 rows: programs loop
        epochs = counters[:rows] + 1  # each row's call count, as both ranks keep it
        mine = torch.randn(rows, HIDDEN, generator=generator)
        theirs = torch.randn(rows, HIDDEN, generator=generator)
        residual = torch.randn(rows, HIDDEN, generator=generator)
        # The peer's half of this call: each row in its buffer's slot for that row's epoch, its
        # signal in our flags.
        for row, epoch in enumerate(epochs.tolist()):
            buffers[peer][epoch & 1, row, :HIDDEN] = theirs[row]
        flags[rank][:rows, peer] = epochs
        out, residual_out = all_reduce_add_rms_norm(mine, residual, weight, 1e-6, buffer_ptrs, flag_ptrs, counters,
                                                    torch.zeros(FENCE_THREADS, dtype=torch.int32), rank, world)
        expected_out, expected_residual = all_reduce_add_rms_norm_reference([theirs, mine], residual, weight, 1e-6)
        torch.testing.assert_close(residual_out, expected_residual, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
        # This rank's half: each row in its own buffer's slot, its signal in the peer's flags.
        for row, epoch in enumerate(epochs.tolist()):
            torch.testing.assert_close(buffers[rank][epoch & 1, row, :HIDDEN], mine[row], rtol=0, atol=0)
        assert flags[peer][:rows, rank].tolist() == epochs.tolist()
        assert counters[:rows].tolist() == epochs.tolist()
    assert counters[:6].tolist() == [5, 5, 4, 3, 3, 1]
