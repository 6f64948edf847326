"""Tensor-parallel group state and collectives.

Layers ask here for their rank and the group size and call the collectives unconditionally; with
one rank (the only mode so far) the collectives return their input, so the models are already
written for tensor parallelism and a later multi-GPU runner only has to initialise the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_EP_GROUP: dist.ProcessGroup | None = None


def init_tensor_parallel(group: dist.ProcessGroup | None) -> None:
    """Install the tensor-parallel process group (None: single rank)."""
    global _TP_GROUP
    _TP_GROUP = group


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


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place when there are several)."""
    if tp_world_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`."""
    world = tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}.")
    return numerator // denominator
