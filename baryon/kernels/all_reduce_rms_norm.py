"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

In a Llama-family layer under tensor parallelism the o and down projections end in an all-reduce
whose result goes straight into `post_attention_layernorm` / the next `input_layernorm` with the
residual. A decode step pays, twice per layer, one all-reduce kernel (two cross-GPU barriers)
and one norm kernel; this is one kernel with one barrier:

    for each row r (a persistent grid of at most one program per multiprocessor walks the rows):
    epoch e = the row's call count + 1 (a counter per row in device memory, so CUDA-graph replays
    count on); write x[r] into this rank's symmetric buffer, slot e & 1;
    every thread releases its stores (system scope); set flag[r, this rank] = e on every peer
    (release); wait until every peer has set flag[r, peer] >= e here (acquire), then every thread
    acquires it too; sum the row over the ranks' buffers (float32, rounded to the model dtype as
    the all-reduce would), add the residual, store it, normalise, scale.

No second barrier: a peer writes the other slot in the next call, and can only come back to
this slot after this rank has signalled the next call, i.e. after it finished reading this one.
Rows past `fused_max_rows` (where it stops being faster; the buffers hold FUSED_MAX_ROWS), hidden
sizes past FUSED_MAX_HIDDEN or another dtype take the all-reduce and then the norm kernel, with the
same numerics.

    reducer.add_rms_norm(partial, residual, weight, eps) -> (rms_norm(sum + residual), sum + residual)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from baryon.kernels.all_reduce import (ONE_SHOT_MAX_BYTES, SymmMemOneShotAllReduce, all_reduce_reference,
                                      rendezvous)
from baryon.kernels.norm import rms_norm_reference
from baryon.kernels.triton_utils import multiprocessor_count, next_power_of_2, tl, triton

FUSED_MAX_ROWS = 512  # decode batches
FUSED_MAX_HIDDEN = 8192
FENCE_THREADS = 256  # the most threads a program runs (8 warps)


def all_reduce_add_rms_norm_reference(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What every rank's fused call returns for the ranks' partial sums `parts` ([rows, hidden]
    each): the all-reduce rounded to their dtype, plus the residual, normalised (HF's rounding)."""
    summed = all_reduce_reference(parts) + residual
    return rms_norm_reference(summed, weight, eps), summed


if triton is not None:

    @triton.jit
    def _all_reduce_add_rms_norm_kernel(x, residual, weight, out, residual_out, buffers, flags, counters,
                                        fence_scratch, rows,
                                        stride_x, stride_r, stride_o, stride_ro, eps,
                                        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SLOT_ROWS: tl.constexpr,
                                        ROW_STRIDE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                        THREADS: tl.constexpr):
        # A persistent grid (at most one program per multiprocessor, all resident at once), so no
        # program waits on a peer's program that cannot start.
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        # One element per thread: the atomics below give every thread release / acquire
        # semantics. One thread's release (or acquire) across a CTA barrier did not cover the
        # other warps' row stores (or loads): two H200s read half a row from the call before
        # last in the float32 stress case of tests/test_gpu.py.
        lanes = tl.arange(0, THREADS)
        mine = tl.load(buffers + RANK).to(tl.pointer_type(x.dtype.element_ty))
        my_flags = tl.load(flags + RANK).to(tl.pointer_type(tl.int32))
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        for row in range(tl.program_id(0), rows, tl.num_programs(0)):
            epoch = tl.load(counters + row) + 1
            tl.store(counters + row, epoch)
            at = ((epoch & 1) * SLOT_ROWS + row).to(tl.int64) * ROW_STRIDE  # the row's place in a rank's buffer
            part = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
            tl.store(mine + at + cols, part, mask=mask)
            tl.atomic_add(fence_scratch + lanes, 0, sem="release", scope="sys")  # each thread's stores visible ...
            tl.debug_barrier()  # ... before any peer is told
            for peer in tl.static_range(WORLD):
                if peer != RANK:
                    peer_flags = tl.load(flags + peer).to(tl.pointer_type(tl.int32))
                    tl.atomic_xchg(peer_flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
            for peer in tl.static_range(WORLD):
                if peer != RANK:
                    # Signed difference: the counts may wrap; a peer may already be one call ahead.
                    while tl.atomic_add(my_flags + row * WORLD + peer, 0, sem="acquire", scope="sys") - epoch < 0:
                        pass
            tl.debug_barrier()
            for peer in tl.static_range(WORLD):  # every thread's loads after an acquire of its own
                if peer != RANK:
                    tl.atomic_add(my_flags + row * WORLD + peer + lanes * 0, 0, sem="acquire", scope="sys")
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for rank in tl.static_range(WORLD):  # rank order, as all_reduce_reference adds
                if rank == RANK:
                    total += part.to(tl.float32)
                else:
                    theirs = tl.load(buffers + rank).to(tl.pointer_type(x.dtype.element_ty))
                    total += tl.load(theirs + at + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
            h = total.to(part.dtype) + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
            tl.store(residual_out + row * stride_ro + cols, h, mask=mask)
            h32 = h.to(tl.float32)
            variance = tl.sum(h32 * h32, axis=0) / HIDDEN
            normed = (h32 * tl.rsqrt(variance + eps)).to(h.dtype)
            tl.store(out + row * stride_o + cols, (normed.to(tl.float32) * w).to(h.dtype), mask=mask)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buffers: torch.Tensor, flags: torch.Tensor, counters: torch.Tensor,
                            fence_scratch: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel for this rank. x, residual: [rows, hidden] (rows <= FUSED_MAX_ROWS,
    hidden <= FUSED_MAX_HIDDEN); buffers: [world] int64 addresses of every rank's row buffer
    ([2, FUSED_MAX_ROWS, FUSED_MAX_HIDDEN] of x's dtype); flags: [world] int64 addresses of every
    rank's int32 flags [FUSED_MAX_ROWS, world]; counters: [FUSED_MAX_ROWS] int32, this rank's;
    fence_scratch: [FENCE_THREADS] int32 the threads' release atomics add 0 to."""
    rows, hidden = x.shape
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    num_warps = 8 if hidden >= 4096 else 4
    _all_reduce_add_rms_norm_kernel[(min(rows, multiprocessor_count(x.device)),)](
        x, residual, weight, out, residual_out, buffers, flags, counters, fence_scratch, rows,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0), eps,
        HIDDEN=hidden, BLOCK=next_power_of_2(hidden), SLOT_ROWS=FUSED_MAX_ROWS, ROW_STRIDE=FUSED_MAX_HIDDEN,
        RANK=rank, WORLD=world, THREADS=32 * num_warps, num_warps=num_warps)
    return out, residual_out


class SymmMemFusedAllReduce(SymmMemOneShotAllReduce):
    """The one-shot all-reduce, and the all-reduce + residual add + RMSNorm of decode rows in one
    Triton kernel over its own double-buffered symmetric buffer and flags."""

    name = "symm_mem_fused"
    # Rows up to which add_rms_norm takes the fused kernel. `benchmarks/all_reduce.py` (hidden 4096
    # bf16, graph-replayed, all-reduce + add + norm), fused / one-shot then norm kernel: two H100s,
    # one thread releasing and acquiring for its CTA (which raced), 7.9 / 10.5 us at 1 row, 11.1 /
    # 11.6 at 16, 19.3 / 15.1 at 64; two H200s, every thread for itself, 8.2 / 8.6 at 1 row, 9.0 /
    # 8.9 at 8, 10.3 / 9.9 at 16.
    fused_max_rows = 16

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        return super().unsupported_reason(device)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, device, dtype, max_bytes)
        rows = symm_mem.empty(2 * FUSED_MAX_ROWS * FUSED_MAX_HIDDEN, dtype=dtype, device=device)  # [2 slots, rows, hidden]
        handle = rendezvous(rows, self.group_name)
        self.world, self.rank = handle.world_size, handle.rank
        self.rows = rows
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)  # [world]
        flags = symm_mem.empty(FUSED_MAX_ROWS * self.world, dtype=torch.int32, device=device)  # [rows, world]
        flags.zero_()
        self.flag_storage = flags
        self.flags = torch.tensor(rendezvous(flags, self.group_name).buffer_ptrs, dtype=torch.int64,
                                  device=device)
        self.counters = torch.zeros(FUSED_MAX_ROWS, dtype=torch.int32, device=device)  # calls per row, this rank
        self.fence_scratch = torch.zeros(FENCE_THREADS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before any rank sets one

    def fused(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        rows, hidden = x.shape
        return (x.dtype == self.dtype == residual.dtype and 0 < rows <= min(self.fused_max_rows, FUSED_MAX_ROWS)
                and hidden <= FUSED_MAX_HIDDEN and x.stride(1) == 1 and residual.stride(1) == 1)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fused(x, residual):
            return super().add_rms_norm(x, residual, weight, eps)
        return all_reduce_add_rms_norm(x, residual, weight, eps, self.buffers, self.flags, self.counters,
                                       self.fence_scratch, self.rank, self.world)
