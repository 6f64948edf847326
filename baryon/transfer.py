"""Host-to-device copies that do not block the host.

A copy from pageable host memory is synchronous: it waits for everything already queued on the
stream, which would stall the preparation of step N+1 behind step N's kernels and undo the
overlap. Staging through pinned memory makes the copy asynchronous; torch's caching host
allocator keeps each pinned buffer alive until the copy that reads it has run.

A step sends a dozen small arrays (token ids, positions, block tables, slots, sampling columns);
each copy of its own costs the host a pinned allocation, a device allocation and a launch
(~25 us apiece on an H100 host). `to_device_many` packs them into one pinned buffer and sends it
in one copy; the tensors it returns are views of the one device buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 16  # bytes: every packed array starts at a multiple of this (any dtype's view is aligned)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host: a CPU tensor the caller will not modify afterwards."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device_many(arrays: Sequence[np.ndarray | torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The arrays (host numpy arrays or CPU tensors, any shapes and dtypes) on `device`, in order,
    in one host-to-device copy. On a CPU device: the host arrays as tensors (no copy of numpy
    arrays), as `to_device` returns them."""
    hosts = [np.ascontiguousarray(a.numpy() if isinstance(a, torch.Tensor) else a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in hosts]
    offsets, total = [], 0
    for a in hosts:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    staging = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=True)  # [total] bytes
    staged = staging.numpy()
    for a, offset in zip(hosts, offsets):
        staged[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    packed = staging.to(device, non_blocking=True)
    # One view of the buffer per dtype, then one strided view per array (offsets are multiples
    # of ALIGN, so of every itemsize): two torch calls an array fewer than slicing and viewing.
    typed: dict[np.dtype, torch.Tensor] = {}
    views = []
    for a, offset in zip(hosts, offsets):
        whole = typed.get(a.dtype)
        if whole is None:
            whole = typed[a.dtype] = packed.view(_TORCH_DTYPE[a.dtype])
        views.append(whole.as_strided(a.shape, [s // a.itemsize for s in a.strides], offset // a.itemsize))
    return views


_TORCH_DTYPE = {np.dtype(d): t for d, t in (
    ("bool", torch.bool), ("uint8", torch.uint8), ("int8", torch.int8), ("int16", torch.int16),
    ("int32", torch.int32), ("int64", torch.int64), ("float16", torch.float16), ("float32", torch.float32),
    ("float64", torch.float64))}
