"""What every Triton kernel module shares: the optional import and the CPU rule."""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import torch

from baryon.kernels.selector import Kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the selector falls back to the torch references
    triton = None
    tl = None

# The CPU interpreter cannot take loaded values as loop bounds; kernels that loop over such
# bounds use a while loop when interpreted.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_unsupported_reason(device: torch.device, family: str) -> str | None:
    """Triton kernels run on CUDA; on CPU only in the interpreter and when asked for by name
    (TRITON_INTERPRET=1 and BARYON_KERNEL_<FAMILY>=triton): the interpreter is for tests."""
    if triton is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    forced = os.environ.get(f"BARYON_KERNEL_{family.upper()}") == "triton"
    if INTERPRETED and forced:
        return None
    return f"needs a CUDA device (on CPU: TRITON_INTERPRET=1 and BARYON_KERNEL_{family.upper()}=triton)"


@functools.lru_cache(maxsize=None)
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (Hopper and later, compiled
    kernels only). A kernel launched with it (`launch_pdl=True`) may start while the kernel before
    it still runs, once every program of that one has called `gdc_launch_dependents()` (or exited):
    it must call `gdc_wait()` before it reads anything an earlier kernel wrote and before it writes
    anything, and may read constant data (weights) before. Decode GEMVs use it to start streaming
    their weights during the previous kernel's tail; the small kernels of a decode step (norms,
    activation, QKV prologue, attention, split combine) wait and release at their first
    statement, which hides their launch behind the kernel before. Both calls are no-ops in a
    kernel launched without it."""
    if triton is None or INTERPRETED or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes a `PDL: tl.constexpr` argument: its flag and, where
    programmatic dependent launch is on, the launch option."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


wait_and_release = None  # a Triton helper where Triton is installed (below)
if triton is not None:

    @triton.jit
    def wait_and_release(PDL: tl.constexpr):
        """The first statement of a PDL-launched kernel that reads its inputs at once: wait for
        the kernel before (its outputs visible), then let the next kernel start launching."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def multiprocessor_count(device: torch.device, off_gpu: int = 132) -> int:
    """The device's streaming multiprocessors; off_gpu where it has none (the interpreter's
    tests: 132 sizes grids as on an H100, a small number keeps K splits rare on test shapes)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return off_gpu


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class TritonKernel(Kernel):
    """Base of the Triton implementations of an op family (`family` names it for the CPU rule)."""

    name = "triton"
    family: ClassVar[str]

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return triton_unsupported_reason(device, cls.family)
