"""bitsandbytes checkpoints (`quant_method: bitsandbytes`): what transformers saves of a model
loaded with a `BitsAndBytesConfig` (unsloth's `-bnb-4bit` uploads, most QLoRA merges).

No kernel here reads these layouts, so each quantized weight is dequantized as it streams from the
checkpoint, into the float weight its layer holds (`checkpoint_tensors`): the checkpoint loads and
runs exactly as the float model of its dequantized weights, at float memory. Tensors of a module
<m> (4-bit: bitsandbytes' `QuantState.as_dict(packed=True)` under `<m>.weight.`):

    4-bit  <m>.weight                       uint8 [ceil(N * K / 2), 1]: the 4-bit codes of the
                                            [N, K] weight flattened row by row, two a byte, the
                                            first in the high nibble
           <m>.weight.quant_map             float32 [16]: each code's value (NF4 or FP4)
           <m>.weight.absmax                float32 [blocks]: the scale of each `blocksize` values;
                                            with double quantization uint8 codes of
           <m>.weight.nested_quant_map      float32 [256], scaled per `nested_blocksize` blocks by
           <m>.weight.nested_absmax         float32 [ceil(blocks / nested_blocksize)], plus the
                                            quant state's `nested_offset`
           <m>.weight.quant_state.bitsandbytes__{nf4,fp4}  uint8: JSON (blocksize, shape, offset)
           w = quant_map[code] * absmax[block]
    8-bit  <m>.weight int8 [N, K], <m>.SCB float32 [N] (LLM.int8, row-major `weight_format` 0):
           w = weight * SCB * (1 / 127 as bitsandbytes rounds it)

Modules the checkpoint kept in float (`llm_int8_skip_modules`, the LM head) stream as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from baryon.quantization.base import LinearMethod, QuantizationConfig

Weights = Iterator[tuple[str, torch.Tensor, str]]  # (checkpoint name, tensor, file)

_FOUR_BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_INV_127 = 7.874015718698502e-3  # bitsandbytes' int8_vectorwise_dequant multiplies by this
_QUANT_STATE = "quant_state.bitsandbytes__"


class BitsAndBytesConfig(QuantizationConfig):
    name = "bitsandbytes"

    def __init__(self, config: dict[str, Any]) -> None:
        self.four_bit = bool(config.get("load_in_4bit"))
        if self.four_bit == bool(config.get("load_in_8bit")):
            raise ValueError("a bitsandbytes quantization_config needs exactly one of load_in_4bit and load_in_8bit")
        storage = config.get("bnb_4bit_quant_storage", "uint8")
        if self.four_bit and storage not in ("uint8", None):
            raise ValueError(f"bitsandbytes bnb_4bit_quant_storage={storage!r} is not supported; supported: uint8")

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None  # the layers hold the dequantized weights

    def moe_method(self, layer: nn.Module, prefix: str):
        return None

    def checkpoint_tensors(self, weights: Weights) -> Weights:
        """The checkpoint's tensors with every quantized weight and its companions replaced by
        the dequantized float32 weight `<m>.weight`, yielded once all of them have streamed by."""
        pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> its parts seen so far
        for name, tensor, file in weights:
            module, part = _bnb_part(name, tensor)
            if module is None:
                yield name, tensor, file
                continue
            if part == "weight_format":
                _check_row_major(name, tensor)
                continue
            parts = pending.setdefault(module, {})
            parts[part] = tensor
            if _complete(parts, self.four_bit):
                del pending[module]
                yield f"{module}.weight", _dequantize(module, parts, self.four_bit), file
        if pending:
            module, parts = next(iter(pending.items()))
            raise ValueError(f"bitsandbytes: the checkpoint has {sorted(parts)} of {module} but not "
                             f"{_missing(parts, self.four_bit)}: its quantized weight cannot be read")


def _bnb_part(name: str, tensor: torch.Tensor) -> tuple[str | None, str | None]:
    """(module, part) of a tensor that belongs to a quantized weight, else (None, None): a packed
    4-bit `weight` (uint8) or an 8-bit one (int8), and their companions."""
    if name.endswith(".weight") and tensor.dtype in (torch.uint8, torch.int8):
        return name[: -len(".weight")], "weight"
    if ".weight." in name:
        module, _, part = name.partition(".weight.")
        if part in _FOUR_BIT_PARTS:
            return module, part
        if part.startswith(_QUANT_STATE):
            return module, "quant_state"
    for suffix in ("SCB", "weight_format"):
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], suffix
    return None, None


def _check_row_major(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() != 1 or int(tensor.reshape(())) != 0:
        raise ValueError(f"bitsandbytes: {name} says the 8-bit weight is not stored row-major (format "
                         f"{tensor.tolist()}); supported: 0 (row)")


def _needed(parts: dict[str, torch.Tensor], four_bit: bool) -> set[str]:
    if not four_bit:
        return {"weight", "SCB"}
    needed = {"weight", "absmax", "quant_map", "quant_state"}
    if "quant_state" in parts and "nested_blocksize" in _state(parts):
        needed |= {"nested_absmax", "nested_quant_map"}
    return needed


def _complete(parts: dict[str, torch.Tensor], four_bit: bool) -> bool:
    return _needed(parts, four_bit) <= parts.keys()


def _missing(parts: dict[str, torch.Tensor], four_bit: bool) -> list[str]:
    return sorted(_needed(parts, four_bit) - parts.keys())


def _state(parts: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The 4-bit quant state's JSON (blocksize, shape, nested_blocksize, nested_offset, ...)."""
    return json.loads(bytes(parts["quant_state"].tolist()).decode())


def _dequantize(module: str, parts: dict[str, torch.Tensor], four_bit: bool) -> torch.Tensor:
    """The float32 weight [N, K] of one quantized module."""
    if not four_bit:
        codes, scales = parts["weight"], parts["SCB"].float()
        if codes.dim() != 2 or scales.shape != (codes.shape[0],):
            raise ValueError(f"bitsandbytes: {module}.weight {tuple(codes.shape)} and {module}.SCB "
                             f"{tuple(scales.shape)} are not an 8-bit [N, K] weight with one scale per row")
        return codes.float() * scales[:, None] * _INV_127
    state = _state(parts)
    shape, blocksize = tuple(state["shape"]), int(state["blocksize"])
    numel = shape[0] * shape[1]
    packed = parts["weight"].reshape(-1)
    if packed.numel() != -(-numel // 2):
        raise ValueError(f"bitsandbytes: {module}.weight holds {packed.numel()} bytes, not the "
                         f"{-(-numel // 2)} of a 4-bit {list(shape)} weight")
    codes = torch.stack((packed >> 4, packed & 15), dim=1).reshape(-1)[:numel].int()  # [N * K]
    absmax = parts["absmax"]
    if "nested_blocksize" in state:  # double quantization: the absmax as 8-bit codes
        nested = int(state["nested_blocksize"])
        block_scales = parts["nested_absmax"].float().repeat_interleave(nested)[: absmax.numel()]
        absmax = parts["nested_quant_map"].float().index_select(0, absmax.int()) * block_scales \
            + float(state["nested_offset"])
    if absmax.numel() != -(-numel // blocksize):
        raise ValueError(f"bitsandbytes: {module}.weight.absmax has {absmax.numel()} entries, not one per "
                         f"{blocksize} values of a {list(shape)} weight")
    values = parts["quant_map"].float().index_select(0, codes)  # [N * K]
    del codes
    if numel % blocksize == 0:  # scaled in place, block by block (no [N * K] copy of the scales)
        return values.view(-1, blocksize).mul_(absmax.float()[:, None]).view(shape)
    return (values * absmax.float().repeat_interleave(blocksize)[:numel]).reshape(shape)
