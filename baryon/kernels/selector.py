"""The kernel selector: each op family lists its implementations in priority order.

An implementation is a class deriving from `Kernel`. It says whether it runs on a device
(`unsupported_reason`) and whether it can serve a layer's configuration
(`cannot_implement_reason`), each returning None for yes or a reason for no. The first that
accepts wins and the choice is logged once. A torch reference is always last, so every op runs
on CPU. `BARYON_KERNEL_<FAMILY>=<name>` (e.g. `BARYON_KERNEL_ATTENTION=torch`) forces a choice;
a forced kernel that cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from baryon.logger import get_logger

logger = get_logger(__name__)


class Kernel:
    """Base of every selectable implementation."""

    name: ClassVar[str]

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return None

    @classmethod
    def cannot_implement_reason(cls, **config: Any) -> str | None:
        return None


# family -> "module:Class" in priority order (imported only when considered).
_REGISTRY: dict[str, list[str]] = {
    "attention": ["baryon.kernels.attention.triton_paged:TritonPagedAttention",
                  "baryon.kernels.attention.cpu_paged:CpuPagedAttention",
                  "baryon.kernels.attention.torch_paged:TorchPagedAttention"],
    "mla_attention": ["baryon.kernels.attention.mla_triton:TritonMLAAttention",
                      "baryon.kernels.attention.mla_torch:TorchMLAAttention"],
    "mla_indexer": ["baryon.kernels.attention.mla_indexer:TritonIndexer",
                    "baryon.kernels.attention.mla_indexer:TorchIndexer"],
    "mla_prologue": ["baryon.kernels.mla_prologue:TritonMLAPrologue", "baryon.kernels.mla_prologue:TorchMLAPrologue"],
    "rms_norm": ["baryon.kernels.norm:TritonRMSNorm", "baryon.kernels.norm:CpuRMSNorm",
                 "baryon.kernels.norm:TorchRMSNorm"],
    "silu_and_mul": ["baryon.kernels.activation:TritonSiluAndMul", "baryon.kernels.activation:TorchSiluAndMul"],
    "gelu_tanh_and_mul": ["baryon.kernels.activation:TritonGeluTanhAndMul",
                          "baryon.kernels.activation:TorchGeluTanhAndMul"],
    "qkv_prologue": ["baryon.kernels.qkv_prologue:TritonQKVPrologue", "baryon.kernels.qkv_prologue:CpuQKVPrologue",
                     "baryon.kernels.qkv_prologue:TorchQKVPrologue"],
    "decoder_layer": ["baryon.kernels.decoder_layer:CpuDecoderLayer", "baryon.kernels.decoder_layer:ModulesDecoderLayer"],
    "dense_linear": ["baryon.kernels.dense_linear:ZentorchDenseLinear", "baryon.kernels.dense_linear:TorchDenseLinear"],
    "dense_gemv": ["baryon.kernels.dense_gemv:TritonDenseGemv", "baryon.kernels.dense_gemv:TorchDenseGemv"],
    "dense_decode_linear": ["baryon.kernels.dense_decode_gemm:TritonDenseDecodeLinear",
                            "baryon.kernels.dense_decode_gemm:TorchDenseDecodeLinear"],
    "block_quant_linear": ["baryon.kernels.block_quant:CpuInt8BlockQuantLinear",
                           "baryon.kernels.block_quant:CpuBlockQuantLinear",
                           "baryon.kernels.block_quant:TorchBlockQuantLinear"],
    "act_quant": ["baryon.kernels.quant.act_quant:TritonActQuant", "baryon.kernels.quant.act_quant:TorchActQuant"],
    "fp8_linear": ["baryon.kernels.quant.fp8_gemm:ScaledMMFp8Linear", "baryon.kernels.quant.fp8_gemm:TritonFp8Linear",
                   "baryon.kernels.quant.fp8_gemm:TorchFp8Linear"],
    "w8_gemv": ["baryon.kernels.quant.w8_gemv:TritonW8Gemv", "baryon.kernels.quant.w8_gemv:TorchW8Gemv"],
    "fp8_decode_linear": ["baryon.kernels.quant.fp8_decode_gemm:TritonFp8DecodeLinear",
                          "baryon.kernels.quant.fp8_decode_gemm:TorchFp8DecodeLinear"],
    "int8_linear": ["baryon.kernels.quant.int8_gemm:TritonInt8Linear", "baryon.kernels.quant.cpu_block_linear:CpuBlockInt8Linear",
                    "baryon.kernels.quant.int8_zentorch:ZentorchInt8Linear", "baryon.kernels.quant.int8_gemm:TorchInt8Linear"],
    "w4a16_linear": ["baryon.kernels.quant.w4a16:TritonW4A16Linear", "baryon.kernels.quant.cpu_block_linear:CpuBlockW4A16Linear",
                     "baryon.kernels.quant.w4a16:TorchW4A16Linear"],
    "sampling": ["baryon.kernels.sampling_triton:TritonSampling", "baryon.kernels.sampling_cpu:CpuSampling",
                 "baryon.kernels.sampling:TorchSampling"],
    "vocab_argmax": ["baryon.kernels.vocab_argmax:TritonVocabArgmax", "baryon.kernels.vocab_argmax:TorchVocabArgmax"],
    "rejection_sampling": ["baryon.kernels.rejection_sampling_triton:TritonRejectionSampling", "baryon.kernels.rejection_sampling:TorchRejectionSampling"],
    "token_bitmask": ["baryon.kernels.token_bitmask_triton:TritonTokenBitmask", "baryon.kernels.token_bitmask:CpuTokenBitmask",
                      "baryon.kernels.token_bitmask:TorchTokenBitmask"],
    "causal_conv1d": ["baryon.kernels.linear_attention_triton:TritonCausalConv1d",
                      "baryon.kernels.linear_attention:TorchCausalConv1d"],
    "gated_delta_rule": ["baryon.kernels.linear_attention_triton:TritonGatedDeltaRule",
                         "baryon.kernels.linear_attention:TorchGatedDeltaRule"],
    "gated_rms_norm": ["baryon.kernels.linear_attention_triton:TritonGatedRMSNorm",
                       "baryon.kernels.linear_attention:TorchGatedRMSNorm"],
    "moe_routing": ["baryon.kernels.moe.routing:TritonRouting", "baryon.kernels.moe.routing:TorchRouting"],
    "fused_moe": ["baryon.kernels.moe.experts_triton:TritonFusedExperts",
                  "baryon.kernels.moe.experts_grouped_mm:GroupedMMFusedExperts",
                  "baryon.kernels.moe.experts_torch:TorchFusedExperts"],
    "fused_moe_mxfp4": ["baryon.kernels.moe.experts_triton:TritonMxfp4FusedExperts",
                        "baryon.kernels.moe.experts_torch:TorchMxfp4FusedExperts"],
    "fused_moe_int4": ["baryon.kernels.moe.experts_triton:TritonInt4FusedExperts",
                       "baryon.kernels.moe.experts_torch:TorchInt4FusedExperts"],
    # symm_mem_fused: the one-shot all-reduce, and the all-reduce + residual add + RMSNorm of decode
    # rows as one kernel that pushes each rank's rows to its peers and polls for theirs (no barrier):
    # two H100s, `benchmarks/all_reduce.py`, 4.1 / 6.1 / 9.1 / 14.2 us at 1 / 64 / 128 / 256 rows
    # against 10.9 / 15.4 / 19.6 / 25.9 for the one-shot all-reduce and the norm kernel.
    # symm_mem_pushed (only when forced, until measured): symm_mem_fused whose one-row all-reduces
    # take rows the row-parallel GEMV before them pushed to the peers from its epilogue.
    "all_reduce": ["baryon.kernels.all_reduce_rms_norm:SymmMemFusedAllReduce",
                   "baryon.kernels.all_reduce_rms_norm:SymmMemPushedAllReduce",
                   "baryon.kernels.all_reduce:SymmMemOneShotAllReduce",
                   "baryon.kernels.all_reduce:TorchDistributedAllReduce"],
    "fused_moe_fp8": ["baryon.kernels.moe.experts_triton:TritonFp8FusedExperts",
                      "baryon.kernels.moe.experts_torch:TorchFp8FusedExperts"],
    "fused_moe_int8": ["baryon.kernels.moe.experts_triton:TritonInt8FusedExperts",
                       "baryon.kernels.moe.experts_torch:TorchInt8FusedExperts"],
}
_logged: set[tuple[str, str]] = set()
_fastest: dict[tuple, type[Kernel]] = {}


def families() -> list[str]:
    return list(_REGISTRY)


def candidates(family: str) -> list[type[Kernel]]:
    if family not in _REGISTRY:
        raise ValueError(f"unknown kernel family {family!r}; known: {families()}")
    classes = []
    for target in _REGISTRY[family]:
        module, attr = target.split(":")
        classes.append(getattr(importlib.import_module(module), attr))
    return classes


def select(family: str, device: torch.device, **config: Any) -> type[Kernel]:
    """The first implementation of `family` that runs on `device` and accepts `config`."""
    forced = os.environ.get(f"BARYON_KERNEL_{family.upper()}")
    reasons = []
    for cls in candidates(family):
        if forced and cls.name != forced:
            continue
        reason = cls.unsupported_reason(device) or cls.cannot_implement_reason(**config)
        if reason is None:
            if (family, cls.name) not in _logged:
                _logged.add((family, cls.name))
                logger.info("kernel %s: using %s", family, cls.name)
            return cls
        reasons.append(f"{cls.name}: {reason}")
    if forced and not reasons:
        names = [c.name for c in candidates(family)]
        raise ValueError(f"BARYON_KERNEL_{family.upper()}={forced!r} names no {family} kernel; known: {names}")
    raise ValueError(f"no {family} kernel can serve {config} on {device}: " + "; ".join(reasons))


def select_fastest(family: str, device: torch.device, trial: Callable[[type[Kernel]], Callable[[], Any]],
                   repeats: int = 5, **config: Any) -> type[Kernel]:
    """For families where no implementation wins everywhere: every implementation that runs on
    `device` and accepts `config` is timed (`trial(cls)` returns a call that runs it once on
    representative inputs; the best of `repeats` runs counts) and the fastest is returned. One
    that accepts alone is returned untimed, a forced one (`BARYON_KERNEL_<FAMILY>`) as `select`
    does; the choice is remembered per (family, device, config) and logged with the timings."""
    forced = os.environ.get(f"BARYON_KERNEL_{family.upper()}")
    if forced:
        return select(family, device, **config)
    key = (family, str(device), tuple(sorted((k, str(v)) for k, v in config.items())))
    if key in _fastest:
        return _fastest[key]
    able = [cls for cls in candidates(family)
            if cls.unsupported_reason(device) is None and cls.cannot_implement_reason(**config) is None]
    if len(able) <= 1:
        choice = select(family, device, **config)
    else:
        times = {}
        for cls in able:
            run = trial(cls)
            run()  # first-call costs (packing, page faults) are not the steady state
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            times[cls] = best
        choice = min(able, key=times.__getitem__)
        logger.info("kernel %s %s: %s -> %s", family, dict(config),
                    ", ".join(f"{cls.name} {times[cls] * 1e6:.0f} us" for cls in able), choice.name)
    _fastest[key] = choice
    return choice
