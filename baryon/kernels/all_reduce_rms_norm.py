"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

In a Llama-family layer under tensor parallelism the o and down projections end in an all-reduce
whose result goes straight into `post_attention_layernorm` / the next `input_layernorm` with the
residual. A decode step pays, twice per layer, one all-reduce kernel (two cross-GPU barriers)
and one norm kernel; this is one kernel and no barrier at all. Each rank *pushes* its rows into
every peer's buffer and each rank polls its own buffer until the peers' values are there: the
buffers hold a sentinel value (-0.0's bits) wherever no value has arrived, so each element says
itself whether it is ready ("Lamport" all-reduce, as TensorRT-LLM's low-latency one):

    for each row r (a persistent grid of at most one program per multiprocessor walks the rows):
    e = the row's call count (a counter per row in device memory, so CUDA-graph replays count
    on); store x[r] (with -0.0 sent as +0.0) into every peer's buffer at [slot e & 1, this rank, r];
    read this rank's buffer at [e & 1, peer, r] for every peer until no element holds the
    sentinel, and put the sentinel back (the slot is free again); sum the row over the ranks in
    rank order (float32, rounded to the model dtype as the all-reduce would), add the residual,
    store it, normalise, scale.

Two slots suffice: a peer writes a row's slot again two calls later, and it can only start that
call after it has read this rank's values of the call in between, which this rank sends after it
has finished (and cleared) this one. No fence is needed either: a value is never read before it
is there, whatever order a peer's stores arrive in. A row that never arrives (a peer that died or
hangs) fails the launch after MAX_POLLS reads, so the engine stops with an error instead of
waiting forever; the worker monitor also makes every wait give up at once when it sees a rank
die (`release_waits`: an abort word in pinned host memory the kernel looks at every 256 reads).
The same kernel without the residual add and norm serves the plain all-reduces of those sizes
(the vocabulary-parallel embedding's). Rows past FUSED_MAX_ROWS, hidden sizes past
FUSED_MAX_HIDDEN or another dtype take the one-shot all-reduce (and then the norm kernel), with
the same numerics.

DP attention's MoE exchanges use the same buffers and row counters (`exchange_rows`): for the
gather each rank pushes its own rows i to every peer and reads each peer's rows i; for the
reduce-scatter it pushes to each peer that peer's share of its rows (rows p * rows + i) and sums
its own share with what the peers pushed. Either way every call on a row i writes once to each
peer and reads once from each, as an all-reduce call does, so the two-slot argument above holds
for any sequence of the three that every rank makes alike (the replicas agree on each step's row
count). Replicas run different attention between exchanges (and may compile different kernels
there), so their waits are bounded by EXCHANGE_MAX_POLLS, about as long as NCCL's collective
timeout, not MAX_POLLS. The reduce-scatter can end as the all-reduce does, with the residual add
and RMSNorm of the next layer (`scatter_add_rms_norm`) over the replica's own tokens.

A row-parallel GEMV can do the push itself (`SymmMemPushedAllReduce`, the `symm_mem_pushed`
all_reduce kernel): each of its programs stores its block of the one-row output into every peer's
buffer as it finishes, and the all-reduce that follows only claims the slot, polls and sums. The
peers' rows then arrive as their GEMVs end instead of after the all-reduce kernel has started and
read the GEMV's output. Those rows go to a row of the buffers of their own (PUSHED_ROW, with its own
call count). Every pushed row must be read before the next push to its slot (a peer still to read
it could otherwise read the stale row), so a call that does not take the pushed output (another
all-reduce in between, or a fallback) first reads it, discarding the sum.

    reducer.add_rms_norm(partial, residual, weight, eps) -> (rms_norm(sum + residual), sum + residual)
    reducer.gather(rows) / reducer.reduce_scatter(rows_of_every_rank)  # None where not served
    reducer.reduce_scatter_add_rms_norm(rows_of_every_rank, residual, weight, eps)  # DP: the scatter + norm
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from baryon.kernels.all_reduce import (ONE_SHOT_MAX_BYTES, SymmMemOneShotAllReduce, all_reduce_reference,
                                      rendezvous)
from baryon.kernels.norm import rms_norm_reference
from baryon.kernels.triton_utils import (INTERPRETED, multiprocessor_count, next_power_of_2, pdl_launch, tl, triton,
                                        wait_and_release)

# Rows (decode batches) the fused kernel's buffers hold, and so the most it takes. Two H100s,
# `benchmarks/all_reduce.py` (hidden 4096 bf16, graph-replayed, all-reduce + add + norm), fused /
# one-shot then the norm kernel: 4.09 / 10.85 us at 1 row, 4.81 / 11.95 at 16, 6.06 / 15.39 at 64,
# 9.12 / 19.64 at 128, 14.16 / 25.94 at 256.
FUSED_MAX_ROWS = 256
FUSED_MAX_HIDDEN = 8192
# The buffers' rows and counters: FUSED_MAX_ROWS for the calls' rows, one more for pushed rows.
PUSHED_ROW = FUSED_MAX_ROWS
BUFFER_ROWS = FUSED_MAX_ROWS + 1
# Reads of a peer's row before the kernel stops waiting for it and fails the launch (a read and
# the program's reduction take ~1-2 us on an H100: about a minute). A peer that died never
# writes, and torch cannot interrupt a running kernel; a slow one (compiling a kernel) is on
# its way well within this.
MAX_POLLS = 1 << 25
# The same for DP attention's exchanges (~35-70 minutes): a replica's peer may be a first kernel
# compilation late, as NCCL's collectives (30-minute timeout) allowed; no monitor releases them.
EXCHANGE_MAX_POLLS = (1 << 31) - 1


@functools.cache
def sentinel_bits(dtype: torch.dtype) -> int:
    """The bits of -0.0 in dtype, as a signed integer of its width: what marks an element of a
    buffer that no peer has written."""
    return int(torch.tensor(-0.0, dtype=dtype).view(bits_dtype(dtype)).item())


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def all_reduce_add_rms_norm_reference(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What every rank's fused call returns for the ranks' partial sums `parts` ([rows, hidden]
    each): the all-reduce rounded to their dtype, plus the residual, normalised (HF's rounding)."""
    summed = all_reduce_reference(parts) + residual
    return rms_norm_reference(summed, weight, eps), summed


if triton is not None:
    from baryon.kernels.norm import scaled_by_weight
    _ABORT_CHECK_POLLS = tl.constexpr(256)  # reads of a row between two looks at the abort word (over PCIe)

    @triton.jit
    def _give_up(total, ASM: tl.constexpr):
        """Abandon a row that never came: on the GPU a trap (the launch fails, so the engine stops
        with an error instead of waiting forever or using a made-up sum); in the interpreter,
        which has no trap, the row's sum becomes NaN."""
        if ASM:
            tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        return total + tl.full(total.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _claim_slot(counters, row):
        """This call's slot of row `row` (its call count, moved on, & 1). One atomic whose old value
        every thread of the program gets: as a load by every thread and a store by one, a warp
        that loaded after another's store took the other slot (and waited where no peer writes)."""
        epoch = tl.atomic_add(counters + row, 1, sem="relaxed")
        return epoch & 1

    @triton.jit
    def _offset(slot, sender, row, WORLD: tl.constexpr, SLOT_ROWS: tl.constexpr, ROW_STRIDE: tl.constexpr):
        """Element offset of [slot, sender, row] in a rank's buffer."""
        return ((slot * WORLD + sender) * SLOT_ROWS + row).to(tl.int64) * ROW_STRIDE

    @triton.jit
    def _push_to_peers(buffers, offset, bits, cols, mask, itype: tl.constexpr, RANK: tl.constexpr,
                       WORLD: tl.constexpr):
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                _push(buffers, peer, offset, bits, cols, mask, itype)

    @triton.jit
    def _push(buffers, peer, offset, bits, cols, mask, itype: tl.constexpr):
        """Store a row's bits into `peer`'s buffer at element `offset` (its slot, sender and row)."""
        theirs = tl.load(buffers + peer).to(tl.pointer_type(itype))
        tl.store(theirs + offset + cols, bits, mask=mask)

    @triton.jit
    def _outgoing(part, itype: tl.constexpr, SENTINEL: tl.constexpr):
        """A row's values as the bits sent: -0.0 goes as +0.0, so the sentinel never travels."""
        bits = part.to(itype, bitcast=True)
        return tl.where(bits == SENTINEL, 0, bits)

    @triton.jit
    def _receive(at, mask, empty, abort, max_polls, SENTINEL: tl.constexpr):
        """Wait until the row at `at` (this rank's buffer) holds no sentinel, put the sentinel back
        (the slot is free for the call after next) and return (its bits, whether the wait gave up:
        the peer never wrote the row within max_polls reads, or the abort word was set)."""
        got = tl.load(at, mask=mask, other=0, volatile=True)
        polls = 0
        while (tl.max((got == SENTINEL).to(tl.int32), axis=0) > 0) & (polls < max_polls):
            got = tl.load(at, mask=mask, other=0, volatile=True)
            polls += 1
            if polls % _ABORT_CHECK_POLLS == 0:
                if tl.load(abort, volatile=True) != 0:  # the engine saw a rank die
                    polls = max_polls
        # Every warp has its row before any puts the sentinel back: each warp decides its wait on
        # its own (a row narrower than the program's threads is held whole by every warp, and
        # the reduction above stays inside the warp), so a warp still polling would otherwise
        # read the sentinel a faster warp restored and wait for a write that never comes (the
        # TP=2 hangs of session 32's 4-wide argmax exchange).
        tl.debug_barrier()
        tl.store(at, empty, mask=mask)
        return got, polls >= max_polls

    @triton.jit
    def push_pushed_row(values, cols, mask, buffers, counters, RANK: tl.constexpr, WORLD: tl.constexpr,
                        SLOT_ROWS: tl.constexpr, ROW_STRIDE: tl.constexpr, ROW: tl.constexpr,
                        SENTINEL: tl.constexpr, BITS: tl.constexpr):
        """A row-parallel GEMV's epilogue (`SymmMemPushedAllReduce`): `values`, its block `cols` of
        a one-row output in the model dtype, into every peer's buffer at row ROW (PUSHED_ROW) of the
        slot its call count names, as the all-reduce kernel pushes a row; the count moves on when
        the all-reduce (PUSHED) claims the slot, after this kernel has ended."""
        itype = tl.int16 if BITS == 16 else tl.int32
        slot = tl.load(counters + ROW, volatile=True) & 1  # moved on by the last all-reduce kernel
        _push_to_peers(buffers, _offset(slot, RANK, ROW, WORLD, SLOT_ROWS, ROW_STRIDE),
                       _outgoing(values, itype, SENTINEL), cols, mask, itype, RANK, WORLD)

    @triton.jit
    def _sum_over_ranks(own, mine, slot, row, cols, mask, empty, abort, max_polls, SLOT_ROWS: tl.constexpr,
                        ROW_STRIDE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                        SENTINEL: tl.constexpr, ASM: tl.constexpr):
        """This rank's `own` row plus every peer's row `row` of this slot (received into this rank's
        buffer `mine`), in rank order as all_reduce_reference adds, in float32."""
        total = tl.zeros(own.shape, dtype=tl.float32)
        for rank in tl.static_range(WORLD):
            if rank == RANK:
                total += own.to(tl.float32)
            else:
                at = mine + _offset(slot, rank, row, WORLD, SLOT_ROWS, ROW_STRIDE) + cols
                got, gave_up = _receive(at, mask, empty, abort, max_polls, SENTINEL)
                if gave_up:  # the peer never wrote its row: gone or hung
                    total = _give_up(total, ASM)
                total += got.to(own.dtype, bitcast=True).to(tl.float32)
        return total

    @triton.jit
    def _add_rms_norm_store(summed, residual, w, out, residual_out, row, stride_r, stride_o, stride_ro, cols, mask,
                            eps, HIDDEN: tl.constexpr):
        """Row `row` of the sum over ranks (`summed`, in the model dtype) plus the residual: stored as
        the new residual, and normalised and scaled by the weight's row w into out (HF's rounding for
        w's dtype: norm.scaled_by_weight)."""
        h = summed + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out + row * stride_ro + cols, h, mask=mask)
        h32 = h.to(tl.float32)
        variance = tl.sum(h32 * h32, axis=0) / HIDDEN
        tl.store(out + row * stride_o + cols, scaled_by_weight(h32 * tl.rsqrt(variance + eps), w, h), mask=mask)

    @triton.jit
    def _all_reduce_add_rms_norm_kernel(x, residual, weight, out, residual_out, buffers, counters, abort_addr, rows,
                                        stride_x, stride_r, stride_o, stride_ro, eps,
                                        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SLOT_ROWS: tl.constexpr,
                                        ROW_STRIDE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                        SENTINEL: tl.constexpr, BITS: tl.constexpr, max_polls, NORM: tl.constexpr,
                                        ROW0: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """NORM: the sum, plus the residual, normalised (out) and the new residual (residual_out);
        else out = the sum alone. abort_addr: an int32 word in host memory the device can read
        (pinned); once it is nonzero a wait for a peer gives up at its next check. ROW0: row r of x
        counts and is exchanged at buffer row ROW0 + r; ROW0 = PUSHED_ROW: a pushed row (one), which
        a GEMV sent the peers already (`push_pushed_row`)."""
        # A persistent grid (at most one program per multiprocessor, all resident at once), and
        # each program sends its row before it waits for the peers': no program waits on one that
        # cannot start. Under programmatic dependent launch the programs start during the
        # projection's tail and the next kernel's during this one's (it waits for every program
        # here to end before it reads anything), so the reduction stays inside the decode step's
        # chain of overlapped launches instead of breaking it twice.
        wait_and_release(PDL)
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        dtype = x.dtype.element_ty
        itype = tl.int16 if BITS == 16 else tl.int32
        mine = tl.load(buffers + RANK).to(tl.pointer_type(itype))
        abort = abort_addr.to(tl.pointer_type(tl.int32))
        if NORM:
            w = tl.load(weight + cols, mask=mask, other=0.0)
        empty = tl.full([BLOCK], SENTINEL, itype)
        for row in range(tl.program_id(0), rows, tl.num_programs(0)):
            at = ROW0 + row  # the row's place in the buffers and counters
            slot = _claim_slot(counters, at)
            part = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
            if ROW0 == 0:  # else the GEMV that made x has pushed it
                _push_to_peers(buffers, _offset(slot, RANK, at, WORLD, SLOT_ROWS, ROW_STRIDE),
                               _outgoing(part, itype, SENTINEL), cols, mask, itype, RANK, WORLD)
            total = _sum_over_ranks(part, mine, slot, at, cols, mask, empty, abort, max_polls, SLOT_ROWS,
                                    ROW_STRIDE, RANK, WORLD, SENTINEL, ASM)
            if NORM:
                _add_rms_norm_store(total.to(dtype), residual, w, out, residual_out, row, stride_r, stride_o,
                                    stride_ro, cols, mask, eps, HIDDEN)
            else:
                tl.store(out + row * stride_o + cols, total.to(dtype), mask=mask)


if triton is not None:

    @triton.jit
    def _exchange_kernel(x, out, residual, weight, residual_out, buffers, counters, abort_addr, rows, norm_rows,
                         stride_x, stride_o, stride_r, stride_ro, eps,
                         HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SLOT_ROWS: tl.constexpr,
                         ROW_STRIDE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                         SENTINEL: tl.constexpr, BITS: tl.constexpr, max_polls, GATHER: tl.constexpr,
                         NORM: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """The all-reduce kernel's push-and-poll exchange for DP attention, over `rows` rows a rank
        (each row i counted in counters[i]):
        GATHER: out[r * rows + i] = rank r's x[i] (x [rows, hidden], out [world * rows, hidden]);
        else (reduce-scatter): out[i] = the sum over ranks, in rank order, of their x[RANK * rows + i]
        (x [world * rows, hidden], out [rows, hidden]): each rank sends a peer only that peer's rows;
        NORM (reduce-scatter only): of the first norm_rows rows (this replica's tokens, the rest
        padding) the sum plus the residual, normalised, into out and the new residual into
        residual_out ([norm_rows, hidden] both); the padding rows are exchanged, not stored."""
        wait_and_release(PDL)  # as in the all-reduce kernel
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        itype = tl.int16 if BITS == 16 else tl.int32
        mine = tl.load(buffers + RANK).to(tl.pointer_type(itype))
        abort = abort_addr.to(tl.pointer_type(tl.int32))
        empty = tl.full([BLOCK], SENTINEL, itype)
        dtype = x.dtype.element_ty
        if NORM:
            w = tl.load(weight + cols, mask=mask, other=0.0)
        for row in range(tl.program_id(0), rows, tl.num_programs(0)):
            slot = _claim_slot(counters, row)
            sent = _offset(slot, RANK, row, WORLD, SLOT_ROWS, ROW_STRIDE)
            if GATHER:
                bits = _outgoing(tl.load(x + row * stride_x + cols, mask=mask, other=0.0), itype, SENTINEL)
                _push_to_peers(buffers, sent, bits, cols, mask, itype, RANK, WORLD)
                # this rank's row as its peers receive it (-0.0 as +0.0): every rank gathers the same bits
                tl.store(out + (RANK * rows + row) * stride_o + cols, bits.to(dtype, bitcast=True), mask=mask)
                for peer in tl.static_range(WORLD):
                    if peer != RANK:
                        at = mine + _offset(slot, peer, row, WORLD, SLOT_ROWS, ROW_STRIDE) + cols
                        got, gave_up = _receive(at, mask, empty, abort, max_polls, SENTINEL)
                        value = got.to(dtype, bitcast=True)
                        if gave_up:
                            value = _give_up(value.to(tl.float32), ASM).to(dtype)
                        tl.store(out + (peer * rows + row) * stride_o + cols, value, mask=mask)
            else:
                for peer in tl.static_range(WORLD):
                    if peer != RANK:
                        theirs = tl.load(x + (peer * rows + row) * stride_x + cols, mask=mask, other=0.0)
                        _push(buffers, peer, sent, _outgoing(theirs, itype, SENTINEL), cols, mask, itype)
                own = tl.load(x + (RANK * rows + row) * stride_x + cols, mask=mask, other=0.0)
                total = _sum_over_ranks(own, mine, slot, row, cols, mask, empty, abort, max_polls, SLOT_ROWS,
                                        ROW_STRIDE, RANK, WORLD, SENTINEL, ASM)
                if NORM:
                    if row < norm_rows:
                        _add_rms_norm_store(total.to(dtype), residual, w, out, residual_out, row, stride_r,
                                            stride_o, stride_ro, cols, mask, eps, HIDDEN)
                else:
                    tl.store(out + row * stride_o + cols, total.to(dtype), mask=mask)


def _check_max_polls(max_polls: int) -> None:
    if not 0 < max_polls < 1 << 31:
        raise ValueError(f"max_polls must be between 1 and 2**31 - 1 (the kernel counts reads in int32), "
                         f"got {max_polls}")


def exchange_rows(x: torch.Tensor, gather: bool, buffers: torch.Tensor, counters: torch.Tensor, rank: int,
                  world: int, abort: torch.Tensor, max_polls: int = EXCHANGE_MAX_POLLS) -> torch.Tensor:
    """DP attention's exchanges through the fused kernel's buffers (same arguments as
    fused_all_reduce). gather: x [rows, hidden] -> every rank's x stacked in rank order [world *
    rows, hidden]; else x [world * rows, hidden] -> this rank's rows of the sum over ranks [rows,
    hidden]. rows <= FUSED_MAX_ROWS, hidden <= FUSED_MAX_HIDDEN, x contiguous."""
    rows = x.shape[0] if gather else x.shape[0] // world
    out = torch.empty((world * rows if gather else rows, x.shape[1]), dtype=x.dtype, device=x.device)
    _launch_exchange(x, out, None, None, None, 0.0, gather, buffers, counters, rank, world, abort, max_polls)
    return out


def scatter_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         buffers: torch.Tensor, counters: torch.Tensor, rank: int, world: int, abort: torch.Tensor,
                         max_polls: int = EXCHANGE_MAX_POLLS) -> tuple[torch.Tensor, torch.Tensor]:
    """DP attention's reduce-scatter (as exchange_rows) fused with the residual add and RMSNorm
    after it: x [world * rows, hidden], residual [tokens, hidden] (tokens <= rows: the replica's
    own tokens, the rest of its rows padding) -> (rms_norm(mine + residual) * weight, mine +
    residual), [tokens, hidden] each, where mine = this rank's first `tokens` rows of the sum."""
    out, residual_out = torch.empty_like(residual), torch.empty_like(residual)
    _launch_exchange(x, out, residual, weight, residual_out, eps, False, buffers, counters, rank, world, abort,
                     max_polls)
    return out, residual_out


def _launch_exchange(x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                     residual_out: torch.Tensor | None, eps: float, gather: bool, buffers: torch.Tensor,
                     counters: torch.Tensor, rank: int, world: int, abort: torch.Tensor, max_polls: int) -> None:
    _check_max_polls(max_polls)
    hidden = x.shape[1]
    rows = x.shape[0] if gather else x.shape[0] // world
    if rows == 0:
        return
    norm = residual is not None
    _exchange_kernel[(min(rows, multiprocessor_count(x.device)),)](
        x, out, residual if norm else x, weight if norm else x, residual_out if norm else out, buffers, counters,
        abort.data_ptr(), rows, residual.shape[0] if norm else 0, x.stride(0), out.stride(0),
        residual.stride(0) if norm else 0, residual_out.stride(0) if norm else 0, eps,
        HIDDEN=hidden, BLOCK=next_power_of_2(hidden), SLOT_ROWS=BUFFER_ROWS, ROW_STRIDE=FUSED_MAX_HIDDEN,
        RANK=rank, WORLD=world, SENTINEL=sentinel_bits(x.dtype), BITS=8 * x.dtype.itemsize, max_polls=max_polls,
        GATHER=gather, NORM=norm, ASM=not INTERPRETED, num_warps=8 if hidden >= 4096 else 4, **pdl_launch(x.device))


def fused_all_reduce(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                     buffers: torch.Tensor, counters: torch.Tensor, rank: int, world: int, abort: torch.Tensor,
                     max_polls: int = MAX_POLLS, pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the fused kernel for this rank. x, residual: [rows, hidden] (rows <= FUSED_MAX_ROWS,
    hidden <= FUSED_MAX_HIDDEN); residual and weight None: the all-reduce alone, (sum, None).
    buffers: [world] int64 addresses of every rank's buffer ([2 slots, world, BUFFER_ROWS,
    FUSED_MAX_HIDDEN] of x's dtype, the sentinel wherever nothing waits to be read); counters:
    [BUFFER_ROWS] int32, this rank's calls per row; abort: int32 [1] the device can read
    (pinned host memory, or the device's own), nonzero to give up waiting; max_polls: reads of a
    peer's row before the kernel gives up on it (see MAX_POLLS). pushed: x is one row that the
    GEMV which made it pushed to the peers (`push_pushed_row`): this call only waits and sums."""
    _check_max_polls(max_polls)
    rows, hidden = x.shape
    if pushed and rows != 1:
        raise ValueError(f"a pushed all-reduce takes one row, got {rows}")
    norm = residual is not None
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if norm else None
    num_warps = 8 if hidden >= 4096 else 4
    _all_reduce_add_rms_norm_kernel[(min(rows, multiprocessor_count(x.device)),)](
        x, residual if norm else x, weight if norm else x, out, residual_out if norm else out, buffers, counters,
        abort.data_ptr(), rows, x.stride(0), residual.stride(0) if norm else 0, out.stride(0),
        residual_out.stride(0) if norm else 0, eps,
        HIDDEN=hidden, BLOCK=next_power_of_2(hidden), SLOT_ROWS=BUFFER_ROWS, ROW_STRIDE=FUSED_MAX_HIDDEN,
        RANK=rank, WORLD=world, SENTINEL=sentinel_bits(x.dtype), BITS=8 * x.dtype.itemsize, max_polls=max_polls,
        NORM=norm, ROW0=PUSHED_ROW if pushed else 0, ASM=not INTERPRETED, num_warps=num_warps, **pdl_launch(x.device))
    return out, residual_out


class SymmMemFusedAllReduce(SymmMemOneShotAllReduce):
    """The all-reduce (+ residual add + RMSNorm) of decode rows in one Triton kernel over its own
    double-buffered symmetric buffer (see the module docstring); the one-shot all-reduce past them."""

    name = "symm_mem_fused"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        return super().unsupported_reason(device)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, device, dtype, max_bytes)
        world = dist.get_world_size(group)
        # [2 slots, world, BUFFER_ROWS, hidden]: slot s, row r of rank p's partial sum, written by rank p
        rows = symm_mem.empty(2 * world * BUFFER_ROWS * FUSED_MAX_HIDDEN, dtype=dtype, device=device)
        rows.view(bits_dtype(dtype)).fill_(sentinel_bits(dtype))
        handle = rendezvous(rows, self.group_name)
        self.world, self.rank = handle.world_size, handle.rank
        self.rows = rows  # kept alive: self.buffers holds addresses into every rank's copy
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)  # [world]
        self.counters = torch.zeros(BUFFER_ROWS, dtype=torch.int32, device=device)  # calls per row, this rank
        self.abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # read by the device (unified addresses)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's buffer holds the sentinel before any rank writes to it

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        if x.dim() != 2:
            return False
        rows, hidden = x.shape
        return (x.dtype == self.dtype and 0 < rows <= FUSED_MAX_ROWS
                and hidden <= FUSED_MAX_HIDDEN and x.stride(1) == 1
                and (residual is None or (residual.dtype == x.dtype and residual.stride(1) == 1)))

    def _exchanges(self, x: torch.Tensor, rows: int) -> bool:
        return (x.dim() == 2 and x.dtype == self.dtype and 0 < rows <= FUSED_MAX_ROWS
                and x.shape[1] <= FUSED_MAX_HIDDEN and x.is_contiguous())

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self._exchanges(x, x.shape[0]):
            return None
        return exchange_rows(x, True, self.buffers, self.counters, self.rank, self.world, self.abort)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] % self.world or not self._exchanges(x, x.shape[0] // self.world):
            return None
        return exchange_rows(x, False, self.buffers, self.counters, self.rank, self.world, self.abort)

    def reduce_scatter_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = x.shape[0] // self.world
        if (x.shape[0] % self.world or not self._exchanges(x, rows) or residual.shape[0] > rows
                or residual.dtype != x.dtype or residual.stride(1) != 1):
            return None
        return scatter_add_rms_norm(x, residual, weight, eps, self.buffers, self.counters, self.rank, self.world,
                                    self.abort)

    def release_waits(self) -> None:
        """Make every wait of the kernel, running or to come, give up (a rank died: its rows will
        never come; called from the engine's worker monitor)."""
        self.abort.fill_(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused(x):
            return super().__call__(x)
        return fused_all_reduce(x, None, None, 0.0, self.buffers, self.counters, self.rank, self.world,
                                self.abort)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fused(x, residual):
            return super().add_rms_norm(x, residual, weight, eps)
        return fused_all_reduce(x, residual, weight, eps, self.buffers, self.counters, self.rank, self.world,
                                self.abort)


class SymmMemPushedAllReduce(SymmMemFusedAllReduce):
    """symm_mem_fused, whose one-row all-reduces take the rows a row-parallel GEMV pushed to the
    peers from its epilogue (module docstring): the GEMV asks `takes_pushed`, pushes with
    `push_arguments` and marks its output (`pushed`); the next call, if it is on that output, only
    waits for the peers' rows and sums; any other call first takes the pushed output, discarding
    its sum. Every rank makes the same calls, so all take (or discard) the same pushed rows. A
    pushed output must meet a call in the same forward pass (its CUDA graph): the model settles
    what is left at its end (`settle_pushes`). The output must reach the call unchanged: the call
    adds this rank's row as it is then to the peers' rows as pushed. Chosen with
    BARYON_KERNEL_ALL_REDUCE=symm_mem_pushed."""

    name = "symm_mem_pushed"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        super().__init__(group, device, dtype, max_bytes)
        self._pushed: torch.Tensor | None = None  # the output pushed last, until a call takes it

    def takes_pushed(self, rows: int, width: int, dtype: torch.dtype) -> bool:
        # Not under torch.compile: the mark is host-side state the trace would not keep.
        return rows == 1 and dtype == self.dtype and width <= FUSED_MAX_HIDDEN and not torch.compiler.is_compiling()

    def push_arguments(self) -> dict:
        """What `push_pushed_row` takes besides the values: the GEMV's launch arguments, asked for
        just before it launches (an output pushed before and not taken yet is taken first: its slot
        is the one this push goes to)."""
        self._settle_pushed(None)
        return dict(buffers=self.buffers, counters=self.counters, RANK=self.rank, WORLD=self.world,
                    SLOT_ROWS=BUFFER_ROWS, ROW_STRIDE=FUSED_MAX_HIDDEN, ROW=PUSHED_ROW,
                    SENTINEL=sentinel_bits(self.dtype), BITS=8 * self.dtype.itemsize)

    def settle_pushes(self) -> None:
        self._settle_pushed(None)

    def pushed(self, out: torch.Tensor) -> None:
        """out [1, width], the output of the GEMV launched with `push_arguments`, is in the peers'
        buffers already."""
        self._pushed = out

    def _settle_pushed(self, x: torch.Tensor | None, residual: torch.Tensor | None = None) -> bool:
        """Whether this call (on x, with residual) takes the output pushed last: it then only waits
        and sums. A pushed output that this call does not take is taken now, its sum discarded."""
        marked, self._pushed = self._pushed, None
        if marked is None:
            return False
        if (x is not None and x.data_ptr() == marked.data_ptr() and x.shape == marked.shape
                and self.fused(x, residual)):
            return True
        fused_all_reduce(marked, None, None, 0.0, self.buffers, self.counters, self.rank, self.world, self.abort,
                         pushed=True)
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._settle_pushed(x):
            return fused_all_reduce(x, None, None, 0.0, self.buffers, self.counters, self.rank, self.world,
                                    self.abort, pushed=True)[0]
        return super().__call__(x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._settle_pushed(x, residual):
            return fused_all_reduce(x, residual, weight, eps, self.buffers, self.counters, self.rank, self.world,
                                    self.abort, pushed=True)
        return super().add_rms_norm(x, residual, weight, eps)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        self._settle_pushed(None)
        return super().gather(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor | None:
        self._settle_pushed(None)
        return super().reduce_scatter(x)

    def reduce_scatter_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._settle_pushed(None)
        return super().reduce_scatter_add_rms_norm(x, residual, weight, eps)
