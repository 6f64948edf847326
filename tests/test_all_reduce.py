"""The tensor-parallel all-reduce family on one device: the selector's choice, and the fused
all-reduce + residual add + RMSNorm kernel with its peer simulated in the same process (the peer's
rows written by hand into this rank's buffer before the launch), in Triton's interpreter on CPU
and compiled on a GPU. Two GPUs run the real thing in tests/test_gpu.py."""

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


def _simulated_buffers(world: int, device: str = "cpu"):
    """Every rank's fused-kernel buffer (float32, [2 slots, world, rows, hidden], the sentinel
    throughout) in one process: (buffers, their addresses, this rank's row counters, the abort
    word, the sentinel's bits)."""
    from baryon.kernels.all_reduce_rms_norm import BUFFER_ROWS, FUSED_MAX_HIDDEN, sentinel_bits

    empty = sentinel_bits(torch.float32)
    buffers = [torch.empty(2, world, BUFFER_ROWS, FUSED_MAX_HIDDEN, device=device) for _ in range(world)]
    for b in buffers:
        b.view(torch.int32).fill_(empty)
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
    counters = torch.zeros(BUFFER_ROWS, dtype=torch.int32, device=device)
    return buffers, buffer_ptrs, counters, torch.zeros(1, dtype=torch.int32, device=device), empty


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.parametrize("world, rank", [(2, 1), (4, 2)])  # this rank's part is added in the middle of four
def test_fused_kernel_with_simulated_peers(seed, world, rank):
    from baryon.kernels.all_reduce import all_reduce_reference
    from baryon.kernels.all_reduce_rms_norm import all_reduce_add_rms_norm_reference, fused_all_reduce

    generator = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the peers' buffers are in its memory too
    peers = [p for p in range(world) if p != rank]
    buffers, buffer_ptrs, counters, abort, empty = _simulated_buffers(world, device)
    weight = torch.randn(HIDDEN, generator=generator).to(device)
    # (a row looked for in the wrong place gives up after 1,000 reads: NaN here, a trap on a GPU)
    # rows 2-4 sit out some calls: their counts lag; 200 rows: programs loop; the 5-row calls are
    # plain all-reduces (no residual, no norm), which count on the same rows
    for rows in (3, 5, 2, 5, 200):
        norm = rows != 5
        epochs = counters[:rows].cpu().clone()  # each row's call count, as every rank keeps it
        parts = [torch.randn(rows, HIDDEN, generator=generator) for _ in range(world)]  # each rank's
        mine = parts[rank]
        mine[0, 1] = -0.0  # sent as +0.0: the sentinel's bits never travel
        residual = torch.randn(rows, HIDDEN, generator=generator)
        # The peers' parts of this call: each row pushed into our buffer's slot for that row's epoch.
        for row, epoch in enumerate(epochs.tolist()):
            for p in peers:
                buffers[rank][epoch & 1, p, row, :HIDDEN] = parts[p][row].to(device)
        if norm:
            out, residual_out = fused_all_reduce(mine.to(device), residual.to(device), weight, 1e-6,
                                                 buffer_ptrs, counters, rank, world, abort, max_polls=1000)
            expected_out, expected_residual = all_reduce_add_rms_norm_reference(parts, residual, weight.cpu(), 1e-6)
            torch.testing.assert_close(residual_out.cpu(), expected_residual, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(out.cpu(), expected_out, rtol=1e-5, atol=1e-5)
        else:
            out, residual_out = fused_all_reduce(mine.to(device), None, None, 0.0, buffer_ptrs, counters,
                                                 rank, world, abort, max_polls=1000)
            assert residual_out is None
            torch.testing.assert_close(out.cpu(), all_reduce_reference(parts), rtol=0, atol=0)
        for row, epoch in enumerate(epochs.tolist()):
            for p in peers:
                # This rank's part, pushed into each peer's buffer; what it read, cleared behind it.
                sent = buffers[p][epoch & 1, rank, row].cpu()
                torch.testing.assert_close(sent[:HIDDEN], mine[row], rtol=0, atol=0)
                assert (sent[HIDDEN:].view(torch.int32) == empty).all()  # past the row: untouched
                assert (buffers[rank][epoch & 1, p, row].view(torch.int32) == empty).all().item()
        assert buffers[peers[0]][int(epochs[0]) & 1, rank, 0, 1].view(torch.int32).item() == 0  # +0.0
        assert counters[:rows].tolist() == (epochs + 1).tolist()
    assert counters[:6].tolist() == [5, 5, 4, 3, 3, 1]


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.parametrize("world, rank", [(2, 0), (4, 2)])
def test_exchanges_with_simulated_peers(seed, world, rank):
    """DP attention's gather and reduce-scatter through the fused kernel's buffers, the peers
    simulated as above: what this rank pushes where, what it reads back (cleared behind it), and
    the rows' call counts shared with the all-reduce's (calls of different sizes interleaved)."""
    from baryon.kernels.all_reduce import all_reduce_reference
    from baryon.kernels.all_reduce_rms_norm import (all_reduce_add_rms_norm_reference, exchange_rows,
                                                    fused_all_reduce, scatter_add_rms_norm)

    generator = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peers = [p for p in range(world) if p != rank]
    buffers, buffer_ptrs, counters, abort, empty = _simulated_buffers(world, device)
    weight = torch.randn(HIDDEN, generator=generator)
    # "scatter_norm": the reduce-scatter fused with the residual add and RMSNorm over this
    # replica's first `tokens` rows (the rest padding: exchanged, not stored)
    for call, (kind, rows) in enumerate([("gather", 3), ("scatter", 3), ("all_reduce", 5), ("gather", 6),
                                         ("scatter_norm", 4), ("scatter", 2), ("scatter_norm", 140),
                                         ("gather", 140)]):
        epochs = counters[:rows].cpu().clone()
        if kind == "gather":
            parts = [torch.randn(rows, HIDDEN, generator=generator) for _ in range(world)]  # each rank's rows
            parts[rank][0, 1] = -0.0
            incoming = {p: parts[p] for p in peers}  # what peer p pushes to this rank, row by row
            outgoing = {p: parts[rank] for p in peers}
            mine = parts[rank]
        elif kind.startswith("scatter"):
            wholes = [torch.randn(world * rows, HIDDEN, generator=generator) for _ in range(world)]
            incoming = {p: wholes[p][rank * rows:(rank + 1) * rows] for p in peers}  # peer p's share for us
            outgoing = {p: wholes[rank][p * rows:(p + 1) * rows] for p in peers}
            mine = wholes[rank]
        else:
            parts = [torch.randn(rows, HIDDEN, generator=generator) for _ in range(world)]
            incoming, outgoing, mine = {p: parts[p] for p in peers}, {p: parts[rank] for p in peers}, parts[rank]
        for row, epoch in enumerate(epochs.tolist()):
            for p in peers:
                buffers[rank][epoch & 1, p, row, :HIDDEN] = incoming[p][row].to(device)
        if kind == "all_reduce":
            got, _ = fused_all_reduce(mine.to(device), None, None, 0.0, buffer_ptrs, counters, rank, world, abort,
                                      max_polls=1000)
            torch.testing.assert_close(got.cpu(), all_reduce_reference(parts), rtol=0, atol=0)
        elif kind == "scatter_norm":
            tokens = rows - call % 3  # this replica's own tokens (all rows, or all but one): the rest pad
            residual = torch.randn(tokens, HIDDEN, generator=generator)
            out, residual_out = scatter_add_rms_norm(mine.to(device), residual.to(device), weight.to(device), 1e-6,
                                                     buffer_ptrs, counters, rank, world, abort, max_polls=1000)
            shares = [w[rank * rows:rank * rows + tokens] for w in wholes]
            expected, expected_residual = all_reduce_add_rms_norm_reference(shares, residual, weight, 1e-6)
            assert out.shape == residual_out.shape == (tokens, HIDDEN)
            torch.testing.assert_close(residual_out.cpu(), expected_residual, rtol=0, atol=0)
            torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
        else:
            got = exchange_rows(mine.to(device), kind == "gather", buffer_ptrs, counters, rank, world, abort,
                                max_polls=1000)
            if kind == "gather":
                assert torch.equal(got.cpu(), torch.cat(parts)), f"call {call}: gathered rows differ"
                # this rank's -0.0 as its peers receive it: +0.0's bits, in the peers' buffers and here
                assert buffers[peers[0]][int(epochs[0]) & 1, rank, 0, 1].view(torch.int32).item() == 0
                assert got[rank * rows, 1].view(torch.int32).item() == 0
            else:
                expected = all_reduce_reference([w[rank * rows:(rank + 1) * rows] for w in wholes])
                torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
        for row, epoch in enumerate(epochs.tolist()):
            for p in peers:
                sent = buffers[p][epoch & 1, rank, row].cpu()
                torch.testing.assert_close(sent[:HIDDEN], outgoing[p][row], rtol=0, atol=0)
                assert (sent[HIDDEN:].view(torch.int32) == empty).all()
                assert (buffers[rank][epoch & 1, p, row].view(torch.int32) == empty).all().item()
        assert counters[:rows].tolist() == (epochs + 1).tolist(), f"call {call}"
    assert counters[:7].tolist() == [8, 8, 7, 5, 4, 3, 2]


def _pushed_reducer(world: int, rank: int, device: str):
    """A SymmMemPushedAllReduce over simulated buffers (no symmetric memory, no process group):
    (the reducer, every rank's buffer)."""
    from baryon.kernels.all_reduce_rms_norm import SymmMemPushedAllReduce

    buffers, buffer_ptrs, counters, abort, _ = _simulated_buffers(world, device)
    reducer = object.__new__(SymmMemPushedAllReduce)
    reducer.buffers, reducer.counters, reducer.abort = buffer_ptrs, counters, abort
    reducer.rank, reducer.world, reducer.dtype, reducer._pushed = rank, world, torch.float32, None
    return reducer, buffers


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.parametrize("world, rank", [(2, 0), (4, 2)])
def test_gemv_pushes_and_the_next_all_reduce_only_waits(seed, world, rank):
    """symm_mem_pushed: a row-parallel GEMV writes its one-row output into every peer's buffer (at
    the pushed row, in the slot of that row's call count) from its epilogue; the all-reduce that
    takes that output claims the slot, waits for the peers' rows and sums them with the residual
    add and norm, sending nothing. A pushed output that the next call does not take (a plain
    all-reduce of other rows comes first, or another push) is read before that call or push, its
    sum discarded, so that no push meets an unread row. The other rows' calls count apart."""
    from baryon.kernels.all_reduce_rms_norm import PUSHED_ROW, all_reduce_add_rms_norm_reference, sentinel_bits
    from baryon.kernels.dense_gemv import TritonDenseGemv

    generator = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reducer, buffers = _pushed_reducer(world, rank, device)
    peers = [p for p in range(world) if p != rank]
    empty = sentinel_bits(torch.float32)
    weight_norm = torch.randn(HIDDEN, generator=generator).to(device)
    count = 0  # the pushed row's calls, as every rank counts them

    def push(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A GEMV's push (checked in every peer's buffer, which then reads it) and the peers'
        pushes of the same call into ours: (our output, every rank's part)."""
        out = TritonDenseGemv.forward(x.to(device), w.to(device), push=reducer.push_arguments())
        reducer.pushed(out)
        torch.testing.assert_close(out.cpu(), x @ w.t(), rtol=1e-5, atol=1e-5)
        slot = int(reducer.counters[PUSHED_ROW]) & 1
        for p in peers:  # our output in every peer's buffer, past it untouched; then the peer reads it
            sent = buffers[p][slot, rank, PUSHED_ROW].cpu()
            torch.testing.assert_close(sent[:HIDDEN], out[0].cpu(), rtol=0, atol=0)
            assert (sent[HIDDEN:].view(torch.int32) == empty).all()
            buffers[p][slot, rank, PUSHED_ROW].view(torch.int32).fill_(empty)
        parts = [torch.randn(1, HIDDEN, generator=generator) for _ in range(world)]
        parts[rank] = out.cpu()
        for p in peers:
            buffers[rank][slot, p, PUSHED_ROW, :HIDDEN] = parts[p][0].to(device)
        return out, parts

    def read_all(before: int) -> None:
        assert int(reducer.counters[PUSHED_ROW]) == before + 1
        for p in peers:  # what came was read and cleared; nothing else was sent
            assert (buffers[rank][before & 1, p, PUSHED_ROW].view(torch.int32) == empty).all()
            assert (buffers[p].view(torch.int32) == empty).all()

    for event in ("taken", "plain-between", "taken", "pushed-again", "taken"):
        x, w = torch.randn(1, 40, generator=generator), torch.randn(HIDDEN, 40, generator=generator)
        x[0, 0], w[5] = -1.0, 0.0  # an output of -0.0 travels as +0.0
        out, parts = push(x, w)
        if event == "plain-between":  # a plain all-reduce of other rows (their own count) comes first
            other = [torch.randn(1, HIDDEN, generator=generator) for _ in range(world)]
            epoch = int(reducer.counters[0])
            for p in peers:
                buffers[rank][epoch & 1, p, 0, :HIDDEN] = other[p][0].to(device)
            summed = reducer(other[rank].to(device))
            torch.testing.assert_close(summed.cpu(), sum(other[1:], other[0]), rtol=1e-6, atol=1e-6)
            for p in peers:  # the peers read what the plain call sent them
                buffers[p][epoch & 1, rank, 0].view(torch.int32).fill_(empty)
            read_all(count)
            count += 1
            continue
        if event == "pushed-again":  # another push first: the pending one is read before it
            out, parts = push(torch.randn(1, 40, generator=generator), torch.randn(HIDDEN, 40, generator=generator))
            count += 1
        residual = torch.randn(1, HIDDEN, generator=generator)
        normed, residual_out = reducer.add_rms_norm(out, residual.to(device), weight_norm, 1e-6)
        expected = all_reduce_add_rms_norm_reference(parts, residual, weight_norm.cpu(), 1e-6)
        torch.testing.assert_close(residual_out.cpu(), expected[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(normed.cpu(), expected[0], rtol=1e-5, atol=1e-5)
        read_all(count)
        count += 1
    push(torch.randn(1, 40, generator=generator), torch.randn(HIDDEN, 40, generator=generator))
    reducer.settle_pushes()  # the end of a forward pass: what no call took is read there
    read_all(count)
    assert reducer._pushed is None and count == 6


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
def test_row_parallel_gemv_pushes_only_where_the_model_says(seed, monkeypatch):
    """A row-parallel layer pushes its one-row output (and marks it) only where the model set
    pushes_partial and the reducer takes it; else the GEMV writes its output alone."""
    from baryon.distributed import parallel_state
    from baryon.kernels.dense_gemv import TritonDenseGemv
    from baryon.layers.linear import RowParallelLinear

    generator = torch.Generator().manual_seed(seed)
    reducer, buffers = _pushed_reducer(2, 0, "cpu")
    monkeypatch.setattr(parallel_state, "_TP_ALL_REDUCE", reducer)  # what tp_push_target asks
    layer = RowParallelLinear(40, HIDDEN, bias=False, reduce_results=False)
    layer.weight.data.copy_(torch.randn(HIDDEN, 40, generator=generator))
    layer.dense_gemv = TritonDenseGemv
    x = torch.randn(1, 40, generator=generator)
    empty = buffers[1].view(torch.int32)[0, 0, 0, 0].item()  # the sentinel, everywhere at first
    layer(x)
    assert reducer._pushed is None and (buffers[1].view(torch.int32) == empty).all()
    layer.pushes_partial = True
    out = layer(x)
    assert reducer._pushed is out
    torch.testing.assert_close(buffers[1][0, 0, -1, :HIDDEN], out[0], rtol=0, atol=0)
    reducer._pushed = None
    layer(torch.randn(2, 40, generator=generator))  # two rows: the GEMV serves one
    assert reducer._pushed is None


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU giving up traps, which ends the process's CUDA context")
def test_fused_kernel_gives_up_on_a_row_that_never_comes(seed):
    """A peer that died (or hangs) never writes its row: after max_polls reads the kernel gives up
    on it instead of spinning forever (on a GPU it traps, failing the launch; the interpreter has
    no trap, so the row comes out NaN) and the rows that came are summed as usual."""
    from baryon.kernels.all_reduce_rms_norm import (BUFFER_ROWS, FUSED_MAX_HIDDEN, fused_all_reduce,
                                                    all_reduce_add_rms_norm_reference, sentinel_bits)

    generator = torch.Generator().manual_seed(seed)
    buffers = [torch.empty(2, 2, BUFFER_ROWS, FUSED_MAX_HIDDEN) for _ in range(2)]
    for b in buffers:
        b.view(torch.int32).fill_(sentinel_bits(torch.float32))
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    x, residual = torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN, generator=generator)
    weight = torch.randn(HIDDEN, generator=generator)
    theirs = torch.randn(HIDDEN, generator=generator)
    buffers[0][0, 1, 0, :HIDDEN] = theirs  # row 0 arrived from rank 1, row 1 never does
    out, residual_out = fused_all_reduce(x, residual, weight, 1e-6, buffer_ptrs,
                                         torch.zeros(BUFFER_ROWS, dtype=torch.int32), 0, 2,
                                         torch.zeros(1, dtype=torch.int32), max_polls=3)
    expected_out, expected_residual = all_reduce_add_rms_norm_reference([x[:1], theirs[None]], residual[:1], weight,
                                                                        1e-6)
    torch.testing.assert_close(out[:1], expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual_out[:1], expected_residual, rtol=1e-6, atol=1e-6)
    assert out[1].isnan().all() and residual_out[1].isnan().all()


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU giving up traps, which ends the process's CUDA context")
def test_fused_kernel_gives_up_when_told_a_rank_died(seed):
    """The worker monitor's release_waits: a wait that would last MAX_POLLS reads gives up at its
    next look at the abort word instead (the plain all-reduce's path here)."""
    from baryon.kernels.all_reduce_rms_norm import (BUFFER_ROWS, FUSED_MAX_HIDDEN, fused_all_reduce,
                                                    sentinel_bits)

    generator = torch.Generator().manual_seed(seed)
    buffers = [torch.empty(2, 2, BUFFER_ROWS, FUSED_MAX_HIDDEN) for _ in range(2)]
    for b in buffers:
        b.view(torch.int32).fill_(sentinel_bits(torch.float32))
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    x = torch.randn(1, HIDDEN, generator=generator)
    abort = torch.ones(1, dtype=torch.int32)  # set by release_waits
    out, _ = fused_all_reduce(x, None, None, 0.0, buffer_ptrs, torch.zeros(BUFFER_ROWS, dtype=torch.int32),
                              1, 2, abort, max_polls=1 << 30)
    assert out.isnan().all()


@pytest.mark.skipif(triton is None, reason="needs triton (its interpreter on CPU)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU giving up traps, which ends the process's CUDA context")
@pytest.mark.parametrize("gather", [True, False])
def test_exchange_gives_up_on_a_row_that_never_comes(seed, gather):
    """An exchange whose peer never writes a row gives up on it after max_polls reads (NaN in the
    interpreter, a trap on a GPU); the rows that came are exchanged as usual."""
    from baryon.kernels.all_reduce_rms_norm import exchange_rows

    generator = torch.Generator().manual_seed(seed)
    buffers, buffer_ptrs, counters, abort, _ = _simulated_buffers(2)
    x = torch.randn(2 if gather else 4, HIDDEN, generator=generator)
    theirs = torch.randn(HIDDEN, generator=generator)
    buffers[0][0, 1, 0, :HIDDEN] = theirs  # row 0 arrived from rank 1, row 1 never does
    out = exchange_rows(x, gather, buffer_ptrs, counters, 0, 2, abort, max_polls=3)
    if gather:
        torch.testing.assert_close(out[:2], x, rtol=0, atol=0)
        torch.testing.assert_close(out[2], theirs, rtol=0, atol=0)
        assert out[3].isnan().all()
    else:
        torch.testing.assert_close(out[0], x[0] + theirs, rtol=0, atol=0)
        assert out[1].isnan().all()
    with pytest.raises(ValueError, match="max_polls"):
        exchange_rows(x, gather, buffer_ptrs, counters, 0, 2, abort, max_polls=1 << 31)


_GIVE_UP_CHILD = r"""
import sys, time, torch
from baryon.kernels.all_reduce_rms_norm import BUFFER_ROWS, FUSED_MAX_HIDDEN, fused_all_reduce, sentinel_bits
how = sys.argv[1]
buffers = [torch.empty(2, 2, BUFFER_ROWS, FUSED_MAX_HIDDEN, device="cuda") for _ in range(2)]
for b in buffers:
    b.view(torch.int32).fill_(sentinel_bits(torch.float32))
ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
x = torch.randn(1, 48, device="cuda")
polls = 1 << 20 if how == "polls" else (1 << 31) - 1  # 2**31 reads: over an hour, unless the abort word is set
start = time.monotonic()
fused_all_reduce(x, None, None, 0.0, ptrs, torch.zeros(BUFFER_ROWS, dtype=torch.int32, device="cuda"),
                 0, 2, abort, max_polls=polls)
if how == "abort":
    time.sleep(0.5)
    abort.fill_(1)  # what the worker monitor's release_waits does
try:
    torch.cuda.synchronize()
except Exception as error:  # the trap fails the launch
    print("GAVE UP after %.1f s: %s" % (time.monotonic() - start, str(error).splitlines()[0]), flush=True)
    sys.exit(0)
print("FINISHED", flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel's trap needs a GPU")
@pytest.mark.parametrize("how", ["polls", "abort"])
def test_compiled_wait_for_a_missing_peer_ends_in_an_error(how):
    """On a GPU the kernel waiting for a peer that never writes (a dead rank) ends the launch with
    an error: after max_polls reads, or as soon as the host sets the abort word in pinned memory
    while the kernel spins (release_waits). Run in a child process: a trap ends its CUDA context."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _GIVE_UP_CHILD, how], capture_output=True, text=True, timeout=120)
    assert "GAVE UP" in child.stdout, child.stdout + child.stderr


_COMPILE_FOR_SM90 = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from baryon.kernels import all_reduce_rms_norm as module

kernel = getattr(module, sys.argv[1])
hidden, warps = int(sys.argv[2]), int(sys.argv[3])
constexprs = dict(HIDDEN=hidden, BLOCK=module.next_power_of_2(hidden), SLOT_ROWS=module.BUFFER_ROWS,
                  ROW_STRIDE=module.FUSED_MAX_HIDDEN, RANK=0, WORLD=2, SENTINEL=-32768, BITS=16, ASM=True,
                  PDL=True, NORM=sys.argv[4] == "norm")
if "GATHER" in kernel.arg_names:
    constexprs["GATHER"] = True
if "ROW0" in kernel.arg_names:
    constexprs["ROW0"] = int(sys.argv[5])
pointers = {"x", "out", "residual", "weight", "residual_out"}
types = {"buffers": "*i64", "counters": "*i32", "abort_addr": "i64", "eps": "fp32"}
signature = {name: "constexpr" if name in constexprs else "*bf16" if name in pointers else types.get(name, "i32")
             for name in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})
sys.stdout.write(compiled.asm["ptx"])
"""


def _compiled_ptx(kernel: str, hidden: int, warps: int, norm: bool, row0: int = 0) -> str:
    """The kernel compiled for an H100 (sm_90) without a GPU, in a process of its own (the tests
    run Triton's interpreter): its PTX."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, kernel, str(hidden), str(warps),
                           "norm" if norm else "plain", str(row0)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _sentinel_stores_without_barrier(ptx: str) -> int:
    """Stores of the sentinel into a polled row that no `bar.sync` separates from the poll (the
    last volatile load before them)."""
    lines = ptx.splitlines()
    sentinel_registers = {line.split()[1].rstrip(",") for line in lines
                          if line.strip().startswith("mov.b16") and line.strip().endswith("-32768;")}
    unguarded, barrier_since_poll = 0, True
    for line in lines:
        text = line.strip()
        if text.startswith("@") and "ld.volatile.global.b16" in text or text.startswith("ld.volatile.global.b16"):
            barrier_since_poll = False
        elif text.startswith("bar.sync"):
            barrier_since_poll = True
        elif "st.global.b16" in text and any(f"{{ {r} }}" in text for r in sentinel_registers):
            unguarded += not barrier_since_poll
    return unguarded


@pytest.mark.skipif(triton is None, reason="triton is not installed")
@pytest.mark.parametrize("hidden, warps", [(4, 4), (4096, 8)])
def test_compiled_waits_claim_one_slot_and_clear_after_every_warp(hidden, warps):
    """The compiled kernels (sm_90 PTX, no GPU needed) claim a row's slot with one atomic whose
    value every thread shares, and put the sentinel back only after a barrier: a 4-wide row (the
    argmax exchange's) is held whole by every warp and each warp ends its wait on its own, so
    without the barrier a slower warp read the sentinel a faster one had restored and never
    finished (session 32's TP=2 hangs)."""
    from baryon.kernels.all_reduce_rms_norm import PUSHED_ROW

    for ptx in (_compiled_ptx("_exchange_kernel", hidden, warps, norm=False),
                _compiled_ptx("_all_reduce_add_rms_norm_kernel", hidden, warps, norm=True),
                _compiled_ptx("_all_reduce_add_rms_norm_kernel", hidden, warps, norm=True, row0=PUSHED_ROW)):
        assert "atom.global.gpu.relaxed.add.u32" in ptx
        assert "ld.volatile.global.b16" in ptx  # the polls this test reads around
        assert _sentinel_stores_without_barrier(ptx) == 0


_COMPILE_PUSHING_GEMV = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from baryon.kernels import dense_gemv

kernel = dense_gemv._dense_gemv_kernel
constexprs = dict(HAS_BIAS=False, EVEN_N=True, EVEN_K=True, ROWS=1, BLOCK_N=8, BLOCK_K=1024, PDL=True, PUSH=True,
                  RANK=1, WORLD=2, SLOT_ROWS=257, ROW_STRIDE=8192, ROW=256, SENTINEL=-32768, BITS=16)
types = {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "out": "*bf16", "buffers": "*i64", "counters": "*i32"}
signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})
sys.stdout.write(compiled.asm["ptx"])
"""


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_pushing_gemv_compiles_for_hopper():
    """The dense GEMV with its epilogue's push (symm_mem_pushed) compiles for an H100 (sm_90, no
    GPU needed): it reads the pushed row's call count and stores its block to the peer's buffer
    besides its own output, after waiting for the kernel before (PDL)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_PUSHING_GEMV], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ptx = done.stdout
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.volatile.global.b32")  # the count, after the wait
    stores = [line for line in ptx.splitlines() if line.strip().startswith(("st.global", "@%p")) and "st.global" in line]
    assert len(stores) >= 2  # its output, and the peer's copy
