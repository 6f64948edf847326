"""Process groups and the collectives the layers call.

Layers ask here for their rank and the group size and call the collectives unconditionally; with
one rank every collective returns its input, so a model is written once for any number of GPUs.
A tensor-parallel engine calls `init_distributed` on every rank (rank 0 in the engine's process,
the others in worker processes) before it builds the model.

Groups: the tensor-parallel group (every rank of one engine) carries the layers' all-reduces and
all-gathers; with expert parallelism the same ranks also divide each MoE layer's experts among
them (each rank runs its experts on every token and the MoE block's one all-reduce adds the
ranks' parts), so a MoE layer's experts are then not split along their intermediate size. A
gloo group over the same ranks carries host-side agreements (the KV-cache size).

DP attention (`init_distributed(..., data_parallel=True)`): the ranks are data-parallel replicas,
each with its own requests and attention (no tensor-parallel group); the experts are divided
among all of them, and each MoE layer gathers every replica's tokens (`dp_all_gather`), runs its
experts on them and hands each replica back the sum of the ranks' parts for its own tokens
(`dp_reduce_scatter`). The replicas agree each step, over gloo, on how many tokens every one pads
its MoE input to (`dp_all_gather_host`). Where the rows fit the fused all-reduce's buffers
(decode steps, symmetric memory) the gather and the scatter are each one kernel of that family
(each replica pushes its rows, or each peer's share of the sum, straight into the peers' buffers),
the scatter fused with the next layer's residual add and RMSNorm (the MoE block leaves its
replicas' parts unscattered to that norm, `dp_reduce_scatter_add_rms_norm`); NCCL's all-gather
and reduce-scatter take the larger steps.

The tensor-parallel all-reduce is chosen by the kernel selector (family `all_reduce`): on GPUs a
one-shot all-reduce over symmetric memory for small messages (decode steps), NCCL's otherwise;
`BARYON_KERNEL_ALL_REDUCE=torch` keeps NCCL for every message.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from baryon.kernels.selector import Kernel, select
from baryon.logger import get_logger

logger = get_logger(__name__)

_TP_GROUP: dist.ProcessGroup | None = None
_DP_GROUP: dist.ProcessGroup | None = None  # DP attention: the replicas that exchange MoE tokens
_EP_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None
_TP_ALL_REDUCE: Kernel | None = None  # a callable reducer over _TP_GROUP
_DP_ALL_REDUCE: Kernel | None = None  # DP attention: a reducer over _DP_GROUP (its decode-sized exchanges)

# How long a collective may wait for the other ranks before the process group gives up. Long:
# ranks compile kernels at different speeds on a first run; a dead worker is noticed by the
# engine's worker monitor well before this.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# How long the ranks may take to meet at start-up (starting Python and importing torch): a worker
# that dies before it joins must not leave rank 0 waiting for COLLECTIVE_TIMEOUT.
JOIN_TIMEOUT = timedelta(minutes=3)
# How long shutdown waits for torch to tear the process group down (see destroy_distributed).
TEARDOWN_TIMEOUT_S = 10.0


def init_distributed(world_size: int, rank: int, init_method: str, backend: str,
                     expert_parallel: bool, dtype: torch.dtype, data_parallel: bool = False) -> None:
    """Join the engine's ranks (blocks until all `world_size` have joined `init_method`) and
    install the groups. backend: "nccl" (GPUs) or "gloo" (CPU); dtype: the model's (the
    activations the layers all-reduce); data_parallel: the ranks are DP-attention replicas (see
    the module's docstring), not the tensor-parallel ranks of one engine."""
    global _CPU_GROUP, _DP_GROUP, _DP_ALL_REDUCE
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group (an earlier multi-GPU engine's "
                           "teardown did not finish, see the log): start the new engine in a new process")
    address = urlparse(init_method)  # tcp://host:port
    store = dist.TCPStore(address.hostname, address.port, world_size, is_master=rank == 0, timeout=JOIN_TIMEOUT)
    device = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank, timeout=COLLECTIVE_TIMEOUT,
                            **device)
    world = dist.group.WORLD
    init_tensor_parallel(None if data_parallel else world, dtype)
    init_expert_parallel(world if expert_parallel or data_parallel else None)
    _DP_GROUP = world if data_parallel else None
    _DP_ALL_REDUCE = _reducer(world, dtype) if data_parallel and world_size > 1 else None
    _CPU_GROUP = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def destroy_distributed() -> None:
    """Leave the process group (shutdown); the layers see one rank again.

    The group is aborted, not destroyed: NCCL's orderly teardown (`destroy_process_group`) waits
    until every rank tears down too, so rank 0 waited forever for a worker that had already
    exited (or was killed after its grace period). No collective is in flight at shutdown, and an
    abort waits for nobody once the ranks have freed their CUDA graphs (ModelRunner.
    release_cuda_graphs: a live graph that captured NCCL's collectives held even the abort, seen
    on two H100s). It is still given at most TEARDOWN_TIMEOUT_S: a shutdown must never hang."""
    global _CPU_GROUP, _DP_GROUP, _DP_ALL_REDUCE
    init_tensor_parallel(None, None)
    init_expert_parallel(None)
    _CPU_GROUP, _DP_GROUP, _DP_ALL_REDUCE = None, None, None
    if not dist.is_initialized():
        return
    teardown = threading.Thread(target=abort_distributed, name="baryon-process-group-teardown", daemon=True)
    teardown.start()
    teardown.join(TEARDOWN_TIMEOUT_S)
    if teardown.is_alive():
        logger.error("the process group's teardown did not return within %.0f s; leaving it (this process "
                     "cannot start another multi-GPU engine)", TEARDOWN_TIMEOUT_S)


def abort_distributed() -> None:
    """Give up the process group at once (shutdown, or a rank died): collectives queued on the
    device that wait for a dead rank are released instead of hanging."""
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # a backend that cannot abort: tear down the ordinary way
        if dist.is_initialized():
            dist.destroy_process_group()


def release_waits() -> None:
    """A rank died or a step hangs: the all-reduce and exchange kernels polling for a peer's rows
    give up (aborting the process group releases NCCL's collectives, not those), tensor-parallel
    and DP-attention ones alike."""
    for reducer in (_TP_ALL_REDUCE, _DP_ALL_REDUCE):
        if reducer is not None:
            reducer.release_waits()


def init_tensor_parallel(group: dist.ProcessGroup | None, dtype: torch.dtype | None) -> None:
    """Install the tensor-parallel process group (None: single rank) and its all-reduce for
    activations of `dtype` (a collective: every rank of the group calls it)."""
    global _TP_GROUP, _TP_ALL_REDUCE
    _TP_GROUP, _TP_ALL_REDUCE = group, None
    if group is not None and dist.get_world_size(group) > 1:
        _TP_ALL_REDUCE = _reducer(group, dtype)


def _reducer(group: dist.ProcessGroup, dtype: torch.dtype) -> Kernel:
    """The selected all-reduce over `group` for activations of `dtype` (a collective)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return select("all_reduce", device, world_size=dist.get_world_size(group)).create(group, device, dtype)


def init_expert_parallel(group: dist.ProcessGroup | None) -> None:
    """Install the expert-parallel process group (None: every rank holds every expert)."""
    global _EP_GROUP
    _EP_GROUP = group


def tp_world_size() -> int:
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


def ep_world_size() -> int:
    """Ranks the experts of each MoE layer are divided among (1: every rank holds every expert)."""
    return 1 if _EP_GROUP is None else dist.get_world_size(_EP_GROUP)


def ep_rank() -> int:
    return 0 if _EP_GROUP is None else dist.get_rank(_EP_GROUP)


def moe_tp_world_size() -> int:
    """Ranks each expert's intermediate size is split over: the tensor-parallel ranks, or one
    when expert parallelism divides the experts instead."""
    return 1 if _EP_GROUP is not None else tp_world_size()


def moe_tp_rank() -> int:
    return 0 if _EP_GROUP is not None else tp_rank()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks: x itself (one rank, or summed in place) or a new
    tensor (the one-shot all-reduce): use the returned tensor."""
    if tp_world_size() == 1:
        return x
    return _TP_ALL_REDUCE(x)


def tp_all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: this rank's partial sums [rows, hidden] -> (rms_norm(sum + residual) * weight, sum +
    residual): the all-reduce and the norm after it, in one kernel where the selected all-reduce
    fuses them (decode rows on GPUs)."""
    if tp_world_size() == 1:
        raise RuntimeError("a norm that reduces its input on a single rank: nothing left it unreduced")
    return _TP_ALL_REDUCE.add_rms_norm(x, residual, weight, eps)


def tp_push_target(rows: int, width: int, dtype: torch.dtype) -> Kernel | None:
    """The tensor-parallel reducer, where it takes a row-parallel GEMV's [rows, width] output
    pushed to the peers from the GEMV's epilogue (`Reducer.takes_pushed`), else None."""
    reducer = _TP_ALL_REDUCE
    return reducer if reducer is not None and reducer.takes_pushed(rows, width, dtype) else None


def tp_settle_pushes() -> None:
    """The end of a model's forward pass: a GEMV-pushed output that no all-reduce took is taken
    now, so that none is left for the next pass (another CUDA graph) to meet."""
    if _TP_ALL_REDUCE is not None:
        _TP_ALL_REDUCE.settle_pushes()


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim` (rank order)."""
    world = tp_world_size()
    if world == 1:
        return x
    flat = _gather_rows(x, _TP_GROUP, world)  # [world * rows, ...]
    dim = dim % x.dim()
    if dim == 0:
        return flat
    gathered = flat.view((world,) + tuple(x.shape))  # [world, *x.shape]
    return torch.cat(gathered.unbind(0), dim=dim)


def _gather(x: torch.Tensor, reducer: Kernel | None, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """Every rank's `x` stacked along dim 0 in rank order: in the reducer's one-kernel gather where
    it serves x (decode rows on GPUs), else the group's all-gather."""
    x = x.contiguous()
    if reducer is not None and (gathered := reducer.gather(x)) is not None:
        return gathered
    return _gather_rows(x, group, world)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """Every rank's `x` (the same shape on each) stacked along dim 0, in rank order."""
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every tensor-parallel rank (in place): what rank 0 sampled becomes the
    next step's input everywhere."""
    if tp_world_size() > 1:
        dist.broadcast(x, src=dist.get_global_rank(_TP_GROUP, 0), group=_TP_GROUP)
    return x


def dp_world_size() -> int:
    """DP-attention replicas that exchange MoE tokens (1: none, every MoE layer is local)."""
    return 1 if _DP_GROUP is None else dist.get_world_size(_DP_GROUP)


def dp_rank() -> int:
    return 0 if _DP_GROUP is None else dist.get_rank(_DP_GROUP)


def dp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, hidden], the same shape on every replica -> [replicas * tokens, hidden],
    replica r's rows at r * tokens."""
    return _gather(x, _DP_ALL_REDUCE, _DP_GROUP, dp_world_size())


def dp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """x: [replicas * tokens, hidden] -> [tokens, hidden]: rows r * tokens .. of every replica's x,
    summed, on replica r."""
    x = x.contiguous()
    if _DP_ALL_REDUCE is not None and (mine := _DP_ALL_REDUCE.reduce_scatter(x)) is not None:
        return mine
    world = dp_world_size()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.device.type == "cpu":  # gloo has no reduce-scatter: sum everything, keep this replica's rows
        dist.all_reduce(x, group=_DP_GROUP)
        out.copy_(x.view((world,) + tuple(out.shape))[dist.get_rank(_DP_GROUP)])
    else:
        dist.reduce_scatter_tensor(out, x, group=_DP_GROUP)
    return out


def dp_reduce_scatter_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x: [replicas * tokens, hidden] as for dp_reduce_scatter, residual: [own, hidden] (own <=
    tokens: this replica's tokens, the rest of its rows padding) -> (rms_norm(mine + residual) *
    weight, mine + residual) with mine the first `own` rows of this replica's sum, in one kernel
    where the DP reducer has one for x (decode rows); else None: the caller reduce-scatters and
    normalises."""
    if _DP_ALL_REDUCE is None or not x.is_contiguous():
        return None
    return _DP_ALL_REDUCE.reduce_scatter_add_rms_norm(x, residual, weight, eps)


def dp_all_gather_host(values: list[int]) -> list[list[int]]:
    """Every replica's `values` (host integers, the same count on each), in rank order: the
    replicas' agreement on a step."""
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dp_world_size())]
    dist.all_gather(gathered, mine, group=_CPU_GROUP)
    return [g.tolist() for g in gathered]


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (a host-side agreement, e.g. the KV-cache size)."""
    if _CPU_GROUP is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}.")
    return numerator // denominator
