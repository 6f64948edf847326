"""baryon's C++ CPU kernels, compiled for this machine on first use and cached.

The sources (`*.cpp` beside this file) register their ops under `torch.ops.baryon_cpu`. They are
built once per machine with `torch.utils.cpp_extension.load` (gcc + ninja, `-O3 -march=native`)
into torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions); the
cache key includes the CPU's feature flags, so a home folder shared by different CPUs never runs
code built for another. A machine without a compiler gets a reason instead of the ops, and the
kernel selector falls back to the torch references.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
from collections.abc import Iterator

import torch

from baryon.logger import get_logger

logger = get_logger(__name__)

OPS = ("block_quant_linear", "block_quant_dequantize", "block_quant_linear_int8", "rms_norm", "qkv_prologue", "paged_attention",
       "decoder_layer", "apply_token_bitmask")
SOURCES = ("block_quant_linear.cpp", "block_quant_int8_dot.cpp", "rms_norm.cpp", "paged_attention.cpp",
           "decoder_layer.cpp", "token_bitmask.cpp")


def _cpu_fingerprint() -> str:
    """A short hash of what -march=native compiles for: the machine and its CPU flags."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@contextlib.contextmanager
def _build_guard(build_dir: str) -> Iterator[None]:
    """One baryon process at a time builds or loads the ops of `build_dir`, under an flock that
    the kernel drops if its holder dies. torch's own lock (a `lock` file that every load takes,
    even of an up-to-date build) stays behind when a build is killed (Ctrl-C during the first
    run), and then every later load waits on it forever; found while we hold the flock, it can
    only be such a leftover, so it is removed."""
    with open(os.path.join(build_dir, "baryon.flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        leftover = os.path.join(build_dir, "lock")
        if os.path.exists(leftover):
            logger.warning("removing %s, left by a build of the C++ CPU kernels that did not finish", leftover)
            os.remove(leftover)
        yield


@functools.cache
def load_error() -> str | None:
    """None once the ops are loaded (building them if needed), else why they cannot be."""
    if platform.system() != "Linux":
        return f"the C++ CPU kernels are built on Linux only (this is {platform.system()})"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    folder = os.path.dirname(__file__)
    name = f"baryon_cpu_{_cpu_fingerprint()}"
    try:
        with _build_guard(cpp_extension._get_build_directory(name, verbose=False)):
            cpp_extension.load(
                name=name,
                sources=[os.path.join(folder, source) for source in SOURCES],
                extra_include_paths=[folder],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, headers missing, ...
        logger.warning("baryon's C++ CPU kernels could not be built; using the torch references: %s", e)
        return f"building the C++ CPU kernels failed ({type(e).__name__}: {str(e).strip()[:300]})"
    if not all(hasattr(torch.ops.baryon_cpu, op) for op in OPS):
        return "the C++ CPU kernels were built but did not register their ops"
    return None


def unsupported_reason(device: torch.device) -> str | None:
    """Why the C++ CPU kernels cannot run on `device` (None: they can, built and loaded)."""
    if device.type != "cpu":
        return "runs on CPU only"
    return load_error()
