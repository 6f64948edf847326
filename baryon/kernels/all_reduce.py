"""The tensor-parallel all-reduce: torch.distributed's (NCCL on GPUs, gloo on CPU), or a one-shot
all-reduce over torch symmetric memory for the small messages of decode steps.

A decode step of a dense model all-reduces a [batch, hidden] activation twice per layer (after
attention and after the MLP): at batch 1 that is 8 KB, and NCCL's latency, not the bytes, sets its
cost. The one-shot all-reduce is one kernel: every rank copies its part into a buffer the other
GPUs map (peer-to-peer over NVLink), all ranks meet at a barrier on signal pads, and each rank
reads every rank's part and adds them itself; a second barrier frees the buffer for the next call.
It reads (world - 1) copies of the message over the links, so past `ONE_SHOT_MAX_BYTES` NCCL's ring
is used instead. Both are captured in CUDA graphs.

    reducer = select("all_reduce", device, world_size=2).create(group, device, dtype)
    summed = reducer(x)  # x: [tokens, hidden]; a new tensor, or x summed in place (NCCL)
    normed, residual = reducer.add_rms_norm(x, residual, weight, eps)  # the sum, + residual, RMSNorm

`symm_mem_fused` (kernels/all_reduce_rms_norm.py) also fuses that add and norm into the
all-reduce of decode rows.
"""

from __future__ import annotations

import atexit
import warnings

import torch
import torch.distributed as dist

from baryon.kernels.selector import Kernel, select
from baryon.logger import get_logger

logger = get_logger(__name__)

# Messages up to this size take the one-shot path. Two H100s (NVLink, `benchmarks/all_reduce.py`,
# hidden 4096 bf16, replayed from CUDA graphs): one-shot / NCCL 8.4 / 19.6 us at 8 KiB (batch 1),
# 13.2 / 20.2 at 512 KiB, 23.2 / 42.2 at 2 MiB, 36.9 / 43.0 at 4 MiB, 63.4 / 56.3 at 8 MiB.
ONE_SHOT_MAX_BYTES = 4 << 20


# Symmetric-memory rendezvous this process has made. torch numbers the store keys of every
# rendezvous with one counter per process (`store_comm_seq_id` in CUDASymmetricMemory), so ranks
# whose processes made different numbers of them wait for each other's keys forever: seen as a
# hang of the second TP=2 engine of a pytest run on two H200s (rank 0 lives in the engine's
# process, its workers are fresh). Such an engine all-reduces through NCCL instead.
_rendezvous_count = 0


# Every symmetric buffer this process made, never freed: torch (before its 2026-07 change to the
# CUDA backend's rendezvous cache, so in the 2.11 of the GPU hosts) keyed that cache by address,
# and a buffer allocated where a freed one was got the freed one's peer addresses back, so pushes
# to peers went to memory they no longer read (the likely cause of the exchange kernel giving up
# in a process that had freed three reducers, session 29; not confirmed on a GPU since). Kept,
# their addresses are never handed out again; each reducer
# holds a few to a few tens of MB, once per engine a process starts.
_SYMMETRIC_BUFFERS: list[torch.Tensor] = []
atexit.register(_SYMMETRIC_BUFFERS.clear)  # freed while CUDA is still up, not in the interpreter's teardown


def rendezvous(tensor: torch.Tensor, group_name: str):
    """torch's symmetric-memory rendezvous of `tensor` (from symm_mem.empty) over the group,
    counted for this process; the tensor is kept for the process's lifetime (see above)."""
    import torch.distributed._symmetric_memory as symm_mem

    global _rendezvous_count
    _rendezvous_count += 1
    _SYMMETRIC_BUFFERS.append(tensor)
    return symm_mem.rendezvous(tensor, group_name)


def all_reduce_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """What every rank's result must equal: the sum of the ranks' inputs, accumulated in float32."""
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)


class Reducer(Kernel):
    """What every all_reduce implementation offers the layers: the sum (`__call__`) and the sum
    followed by the residual add and RMSNorm (`add_rms_norm`; here the two ops one after the
    other, the norm through the kernel selector)."""

    norm_kernel: type[Kernel] | None = None  # rms_norm's, selected at the first call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def release_waits(self) -> None:
        """A rank died: make waits for it give up where the implementation can (NCCL's are
        released by aborting the process group)."""

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [rows, hidden] stacked in rank order [world * rows, hidden], in one
        low-latency kernel; None where this implementation has none for x (the caller takes the
        group's all-gather). DP attention's exchanges of decode steps."""
        return None

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's rows [rows, hidden] of the sum over ranks of x [world * rows, hidden] (rank
        r's rows at r * rows), in one low-latency kernel; None as for `gather`."""
        return None

    def reduce_scatter_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`reduce_scatter(x)`'s first residual.shape[0] rows plus residual, normalised: (rms_norm(...)
        * weight, ... + residual), in one low-latency kernel; None as for `gather`."""
        return None

    def takes_pushed(self, rows: int, width: int, dtype: torch.dtype) -> bool:
        """Whether a row-parallel GEMV's [rows, width] output may be pushed into the peers'
        buffers from the GEMV's own epilogue (`push_arguments`), so that this reducer's next call
        on that output (`pushed` marks it) only waits for the peers' rows. None here."""
        return False

    def settle_pushes(self) -> None:
        """The end of a forward pass: a pushed output that no call took is taken now (in the same
        CUDA graph as its push). Nothing here."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this rank's partial sum [rows, hidden] -> (rms_norm(sum + residual) * weight,
        sum + residual)."""
        if self.norm_kernel is None:
            self.norm_kernel = select("rms_norm", x.device)
        out, residual_out = self.norm_kernel.forward(self(x), weight, eps, residual)
        return out, residual_out


class TorchDistributedAllReduce(Reducer):
    """dist.all_reduce in place: NCCL on GPUs (its ring or tree), gloo on CPU."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> TorchDistributedAllReduce:
        return cls(group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


class SymmMemOneShotAllReduce(Reducer):
    """torch.ops.symm_mem.one_shot_all_reduce_copy_out over a symmetric buffer of
    ONE_SHOT_MAX_BYTES made once per engine (every rank allocates it in the same order: a
    collective); messages that do not fit, or of another dtype, go to NCCL."""

    name = "symm_mem_one_shot"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs CUDA GPUs (peer-to-peer symmetric memory)"
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            return f"torch {torch.__version__} has no symmetric-memory all-reduce"
        return None

    @classmethod
    def cannot_implement_reason(cls, world_size: int = 1, **config) -> str | None:
        return "one rank: nothing to reduce" if world_size < 2 else None

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = group.group_name
        self.dtype = dtype
        self.fallback = TorchDistributedAllReduce(group)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by older torch, a deprecated no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.capacity = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.capacity, dtype=dtype, device=device)  # [capacity]
        rendezvous(self.buffer, self.group_name)
        self._copy_in_kernel = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
               max_bytes: int = ONE_SHOT_MAX_BYTES) -> Reducer:
        """The one-shot reducer for messages up to max_bytes, or NCCL's where symmetric memory
        cannot be set up on this host or the ranks' processes have made different numbers of
        rendezvous before (see `_rendezvous_count`). The ranks agree before any rendezvous and
        after it, so that every rank runs the same collectives."""
        counts = torch.tensor([_rendezvous_count, -_rendezvous_count], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)  # [fewest, -most]
        fewest, most = int(counts[0]), -int(counts[1])
        if fewest != most:
            logger.warning("one-shot all-reduce unavailable: the ranks' processes set up symmetric memory %d to %d "
                           "times before (an earlier multi-GPU engine in one of them), and torch cannot pair such "
                           "ranks; using NCCL's (start each multi-GPU engine in a process of its own for the faster "
                           "small all-reduces)", fewest, most)
            return TorchDistributedAllReduce(group)
        try:
            reducer, ok = cls(group, device, dtype, max_bytes), 1
        except RuntimeError as e:  # e.g. no peer access between these GPUs
            logger.warning("one-shot all-reduce unavailable (%s); using NCCL's", e)
            reducer, ok = None, 0
        flag = torch.tensor([ok], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if int(flag.item()) == 0:
            return TorchDistributedAllReduce(group)
        return reducer

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.capacity and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x):
            return self.fallback(x)
        out = torch.empty_like(x)
        flat, slot = x.view(-1), self.buffer[: x.numel()]  # slot: this rank's part, where peers read it
        if self._copy_in_kernel:  # the copy into the slot happens inside the all-reduce kernel
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(slot, flat, "sum", self.group_name, out.view(-1))
        else:
            slot.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.group_name, out.view(-1))
        return out
