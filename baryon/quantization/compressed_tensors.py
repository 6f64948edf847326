"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, written by llm-compressor):
each of `config_groups` names its target modules and the quantization of their weights and input
activations; `ignore` lists the modules left in float. The schemes served:

    FP8       float 8-bit weights (tensor / channel / block strategy), float 8-bit activations
              (static per tensor, dynamic per token or per group)  -> Fp8LinearMethod
    W8A8      int 8-bit symmetric weights (channel), int 8-bit dynamic per-token symmetric
              activations                                              -> Int8LinearMethod
    WNA16     int 4- or 8-bit weights (group / channel, symmetric or with zero points), no
              activation quantization (`pack-quantized`)             -> WNA16LinearMethod
    NVFP4     float 4-bit (e2m1) weights in groups of 16 with float8 e4m3 scales and a float32
              global scale (`nvfp4-pack-quantized`), 4-bit or no activations -> dequantized at
              load (`checkpoint_tensors`: no kernel here reads it on Hopper or CPU; the layers
              hold the float weights and run unquantized activations, as vLLM's Hopper
              fallback does): weight_packed uint8 [N, K / 2] (two codes a byte, the first in the
              low nibble), weight_scale e4m3 [N, K / 16], weight_global_scale [1];
              w = e2m1(code) * weight_scale / weight_global_scale

Anything else is an error naming the scheme.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from baryon.quantization.base import LinearMethod, QuantizationConfig, is_ignored
from baryon.quantization.fp8 import Fp8LinearMethod
from baryon.quantization.int8 import Int8LinearMethod
from baryon.quantization.moe_fp8 import Fp8MoEMethod
from baryon.quantization.moe_int4 import weight_only_moe_method
from baryon.quantization.moe_int8 import Int8MoEMethod
from baryon.quantization.wna16 import WNA16LinearMethod

SUPPORTED = ("FP8 (float 8-bit weights tensor/channel/block + float 8-bit activations)",
             "NVFP4 (float 4-bit weights in groups of 16, dequantized at load)",
             "W8A8 (int 8-bit channel weights + dynamic per-token int 8-bit activations)",
             "WNA16 (int 4/8-bit group or channel weights, actorder none / weight / group, float activations)")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any]) -> None:
        self.groups = list((config.get("config_groups") or {}).values())
        if not self.groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        self.format = config.get("format")
        self.ignored = list(config.get("ignore") or [])
        for group in self.groups:
            _scheme_method(group, self.format)  # fail at load on an unsupported scheme
        self._nvfp4_of: dict[str, bool] = {}  # module -> whether its weights are NVFP4 (see checkpoint_tensors)

    def _group_for(self, prefix: str) -> dict[str, Any] | None:
        """The group whose targets name the module, ranked as the compressed_tensors package ranks
        them: an exact name first, then a `re:` pattern, then the class (`Linear`)."""
        for matches in (lambda t: t == prefix, lambda t: t.startswith("re:") and re.match(t[3:], prefix),
                        lambda t: t == "Linear"):
            for group in self.groups:
                if any(matches(target) for target in group.get("targets") or ["Linear"]):
                    return group
        return None

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_ignored(prefix, self.ignored):
            return None
        group = self._group_for(prefix)
        return None if group is None else _scheme_method(group, self.format)  # (NVFP4: None, dequantized)

    def _is_nvfp4(self, module: str) -> bool:
        if module not in self._nvfp4_of:
            group = None if is_ignored(module, self.ignored) else self._group_for(module)
            self._nvfp4_of[module] = group is not None and _is_nvfp4(group, self.format)
        return self._nvfp4_of[module]

    def checkpoint_tensors(self, weights):
        """NVFP4 modules' weight_packed / weight_scale / weight_global_scale, once all have streamed
        by, replaced by the dequantized float32 `weight` (input_global_scale dropped); every
        other tensor as stored."""
        if not any(_is_nvfp4(group, self.format) for group in self.groups):
            yield from weights
            return
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor, file in weights:
            module, _, part = name.rpartition(".")
            if part not in _NVFP4_PARTS or not self._is_nvfp4(module):
                yield name, tensor, file
                continue
            if part == "input_global_scale":
                continue  # activations stay unquantized here
            parts = pending.setdefault(module, {})
            parts[part] = tensor
            if len(parts) == 3:
                del pending[module]
                yield f"{module}.weight", dequantize_nvfp4(module, parts), file
        if pending:
            module, parts = next(iter(pending.items()))
            raise ValueError(f"compressed-tensors NVFP4: the checkpoint has {sorted(parts)} of {module} but not "
                             f"{sorted(set(_NVFP4_PARTS[:3]) - parts.keys())}: its weight cannot be read")

    def lm_head_method(self) -> LinearMethod | None:
        """llm-compressor quantizes every Linear its targets name, lm_head too unless `ignore`
        lists it (its recipes' default)."""
        return self.linear_method(None, "lm_head")

    def moe_method(self, layer: nn.Module, prefix: str):
        if is_ignored(prefix, self.ignored):
            return None
        group = self._group_for(prefix + ".0.gate_proj") or self._group_for(prefix)
        if group is None:
            return None
        method = _scheme_method(group, self.format)
        if method is None:  # NVFP4: float experts, dequantized as they load
            return None
        if isinstance(method, Fp8LinearMethod):
            if method.strategy == "block":
                return Fp8MoEMethod(method.block, scale_name="weight_scale")
            return Fp8MoEMethod(None, strategy=method.strategy, static_input=method.static_input)
        if isinstance(method, Int8LinearMethod):
            return Int8MoEMethod()
        return weight_only_moe_method(method, f"{self.name} {_describe(group)}")


def _describe(group: dict[str, Any]) -> str:
    w, a = group.get("weights") or {}, group.get("input_activations")
    act = "no activation quantization" if not a else \
        f"{a.get('type')} {a.get('num_bits')}-bit {a.get('strategy')} activations (dynamic={a.get('dynamic')})"
    return f"{w.get('type')} {w.get('num_bits')}-bit {w.get('strategy')} weights " \
           f"(symmetric={w.get('symmetric')}), {act}"


_NVFP4_PARTS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
# e2m1 code (bit 3 the sign) -> its value.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _is_nvfp4(group: dict[str, Any], fmt: str | None) -> bool:
    weights = group.get("weights") or {}
    return (weights.get("type") == "float" and weights.get("num_bits") == 4 and weights.get("group_size") == 16
            and (group.get("format") or fmt) in ("nvfp4-pack-quantized", None))


def dequantize_nvfp4(module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight [N, K] of an NVFP4 module (see the module docstring)."""
    packed, scale, global_scale = parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"]
    n, half = packed.shape
    if packed.dtype != torch.uint8 or scale.shape != (n, 2 * half // 16) or global_scale.numel() != 1:
        raise ValueError(f"compressed-tensors NVFP4: {module}.weight_packed {packed.dtype} {list(packed.shape)}, "
                         f"weight_scale {list(scale.shape)} and weight_global_scale {list(global_scale.shape)} are not "
                         f"uint8 [N, K / 2], [N, K / 16] and one value")
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, 2 * half).int()  # [N, K]
    values = _E2M1.index_select(0, codes.reshape(-1)).reshape(n, -1, 16)  # [N, K / 16, 16]
    group_scales = scale.float() / global_scale.float().reshape(())
    return (values * group_scales[:, :, None]).reshape(n, 2 * half)


def _scheme_method(group: dict[str, Any], fmt: str | None) -> LinearMethod | None:
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    fmt = group.get("format") or fmt
    unsupported = ValueError(f"compressed-tensors scheme {_describe(group)} (format {fmt!r}) is not "
                             f"supported; supported: {'; '.join(SUPPORTED)}")
    if _is_nvfp4(group, fmt):
        fp4_acts = not acts or (acts.get("type") == "float" and acts.get("num_bits") == 4)
        if not weights.get("symmetric", True) or not fp4_acts:
            raise unsupported
        return None  # dequantized at load (checkpoint_tensors)
    if weights.get("dynamic") or (acts and acts.get("type") != kind):
        raise unsupported
    if kind == "float" and bits == 8 and acts and acts.get("num_bits") == 8:
        if strategy == "block":
            block = weights.get("block_structure")
            if not block or len(block) != 2 or acts.get("strategy") not in ("group", "token") \
                    or not acts.get("dynamic"):
                raise unsupported
            return Fp8LinearMethod("block", False, (int(block[0]), int(block[1])), scale_name="weight_scale")
        static = not acts.get("dynamic")
        if strategy not in ("tensor", "channel") or (static and acts.get("strategy") != "tensor") \
                or (not static and acts.get("strategy") != "token"):
            raise unsupported
        return Fp8LinearMethod(strategy, static)
    if kind == "int" and bits == 8 and acts and acts.get("num_bits") == 8:
        if strategy != "channel" or not weights.get("symmetric", True) or not acts.get("dynamic") \
                or acts.get("strategy") != "token" or not acts.get("symmetric", True):
            raise unsupported
        return Int8LinearMethod()
    if kind == "int" and bits in (4, 8) and not acts and fmt in ("pack-quantized", None):
        act_order = False
        if strategy == "group":
            group_size = int(weights.get("group_size") or 0)
            actorder = weights.get("actorder")
            # "weight" / "static" (its older name) reorder columns during calibration only; "group" /
            # "dynamic" (and True, the oldest spelling) store each column's group (weight_g_idx).
            if group_size <= 0 or actorder not in (None, False, "weight", "static", "group", "dynamic", True):
                raise unsupported
            act_order = actorder in ("group", "dynamic", True)
        elif strategy == "channel":
            group_size = None
        else:
            raise unsupported
        return WNA16LinearMethod("compressed-tensors", bits, group_size, bool(weights.get("symmetric", True)),
                                 act_order)
    raise unsupported
