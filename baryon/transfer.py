"""Host-to-device copies that do not block the host.

A copy from pageable host memory is synchronous: it waits for everything already queued on the
stream, which would stall the preparation of step N+1 behind step N's kernels and undo the
overlap. Staging through pinned memory makes the copy asynchronous; torch's caching host
allocator keeps each pinned buffer alive until the copy that reads it has run.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host: a CPU tensor the caller will not modify afterwards."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
