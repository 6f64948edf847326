"""GPTQ and AWQ checkpoints (`quant_method` gptq / awq): their `quantization_config` fields, read
into a `WNA16LinearMethod` with the format's tensor layout (see quantization/wna16.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from baryon.quantization.base import LinearMethod, QuantizationConfig, is_ignored
from baryon.quantization.moe_int4 import weight_only_moe_method
from baryon.quantization.wna16 import WNA16LinearMethod


def _group_size(config: dict[str, Any], name: str) -> int | None:
    group = int(config.get("group_size", 128))
    if group == -1:
        return None
    if group <= 0:
        raise ValueError(f"{name} group_size {group} is invalid: a positive size, or -1 for one group per row")
    return group


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, config: dict[str, Any]) -> None:
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(f"gptq bits={self.bits} is not supported; supported: 4, 8")
        self.group_size = _group_size(config, "gptq")
        self.desc_act = bool(config.get("desc_act", False))
        self.sym = bool(config.get("sym", True))
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        self.layout = fmt
        self.lm_head_quantized = bool(config.get("lm_head"))  # GPTQModel's lm_head=True
        self.ignored = list(config.get("modules_to_not_convert") or [])

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_ignored(prefix, self.ignored):
            return None
        return WNA16LinearMethod(self.layout, self.bits, self.group_size, self.sym, act_order=self.desc_act)

    def lm_head_method(self) -> LinearMethod | None:
        return self.linear_method(None, "lm_head") if self.lm_head_quantized else None

    def moe_method(self, layer: nn.Module, prefix: str):
        method = self.linear_method(layer, prefix)
        return None if method is None else weight_only_moe_method(method, self.name)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, config: dict[str, Any]) -> None:
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        if self.bits != 4:
            raise ValueError(f"awq bits={self.bits} is not supported; supported: 4")
        self.group_size = _group_size({"group_size": config.get("group_size", config.get("q_group_size", 128))},
                                      "awq")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported; supported: gemm")
        if not config.get("zero_point", True):
            raise ValueError("awq without zero points is not supported; supported: zero_point true")
        self.ignored = list(config.get("modules_to_not_convert") or [])

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_ignored(prefix, self.ignored):
            return None
        return WNA16LinearMethod("awq", 4, self.group_size, symmetric=False)

    def moe_method(self, layer: nn.Module, prefix: str):
        method = self.linear_method(layer, prefix)
        return None if method is None else weight_only_moe_method(method, self.name)
