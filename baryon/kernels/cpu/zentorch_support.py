"""Whether zentorch (AMD's ZenDNN plugin for PyTorch, the optional extra `pip install -e ".[zen]"`)
can run an op here.

zentorch registers its ops under `torch.ops.zentorch` when imported. Its kernels assume more than
the wheel checks: measured on an AVX2-only Zen 3 (2026-11-24, zentorch 2.13.0.2), its float32
linear runs, `zentorch_dynamic_qlinear` returns wrong values for one row and dies of SIGILL for
more, and its bfloat16 GEMMs print "AVX512_BF16 ISA not supported" and return NaN. So every
candidate names the instruction sets it needs and is offered only where /proc/cpuinfo lists them;
nothing here imports zentorch unless a CPU kernel is being chosen.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

INSTALL_HINT = 'pip install -e ".[zen]"'


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, avx512f, avx512_vnni, ...)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


# ZenDNN's weight cache: 0 off, 1 a reordered copy beside the weight, 2 (its default) the reorder
# written over the weight itself. In place, the tensor a layer shares with anything else (a tied
# embedding, the kernel selector's timing of the other candidates, F.linear) becomes garbage:
# measured on a Zen 4 (zentorch 2.13.0.2), one timed call left a layer's weight reordered and the
# engine's logprobs off by 1.4 nats. The copy beside it is found again by the weight's address, so
# a new weight allocated where a freed one lived (a second engine in one process) is multiplied
# with the old one's copy (a bf16 engine's greedy tokens agreed on 91 of 256 positions after
# another engine had come and gone). Off, then: each call reorders, and the selector's timing of
# zentorch counts that.
_WEIGHT_CACHE_ENV = "ZENDNNL_MATMUL_WEIGHT_CACHE"


@functools.cache
def _import_error() -> str | None:
    if importlib.util.find_spec("zentorch") is None:
        return f"zentorch is not installed ({INSTALL_HINT})"
    os.environ[_WEIGHT_CACHE_ENV] = "0"  # set before zentorch reads it
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except Exception as e:  # built for another torch, a missing dependency, ...
        return f"zentorch does not import ({type(e).__name__}: {str(e).strip()[:200]})"
    return None


def zentorch_unavailable_reason(device: torch.device, ops: tuple[str, ...], isa: tuple[str, ...]) -> str | None:
    """None when zentorch is installed, imports, registers `ops` and the CPU has every flag in
    `isa`; otherwise why not."""
    if device.type != "cpu":
        return "runs on CPU only"
    missing_isa = [flag for flag in isa if flag not in cpu_flags()]
    if missing_isa:
        return f"this CPU lacks {', '.join(missing_isa)} (zentorch's kernel for this op needs it)"
    reason = _import_error()
    if reason is not None:
        return reason
    missing = [op for op in ops if not hasattr(torch.ops.zentorch, op)]
    return f"this zentorch lacks {', '.join(missing)}" if missing else None
