"""Run the inline PTX of a lane-decode kernel helper on the host: the few 32-bit integer and packed
16-bit float instructions the decoders use (mov, and, or, shl, shr, lop3, prmt, fma.rn.bf16x2 /
f16x2), so that a test can check the assembly text itself on every byte against the float32
formula it replaces, without a GPU.

Operands are registers named in the block, `$N` (the asm's outputs, then its inputs, each a 32-bit
register) or immediates. A packed FMA computes each 16-bit lane's a * b + c exactly and rounds once
to the lane's type (round to nearest even, subnormals kept), as the PTX ISA defines it.
"""

from __future__ import annotations

import re

import numpy as np
import torch

_LANE_DTYPES = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}
_MASK = 0xFFFFFFFF


def _lanes_to_floats(word: int, dtype: torch.dtype) -> list[float]:
    halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
    return halves.view(dtype).double().tolist()


def _floats_to_word(values: list[float], dtype: torch.dtype) -> int:
    # float64 -> float32 is exact for these products (<= 24 significant bits: checked), then one
    # rounding to the 16-bit type.
    single = np.array(values, dtype=np.float64).astype(np.float32)
    assert np.array_equal(single.astype(np.float64), np.array(values)), "product not exact in float32"
    halves = torch.from_numpy(single).to(dtype).view(torch.int16).to(torch.int32).tolist()
    return (halves[0] & 0xFFFF) | ((halves[1] & 0xFFFF) << 16)


def _prmt(a: int, b: int, selector: int) -> int:
    pool = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:  # sign-replicate mode: the selected byte's top bit everywhere
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run(asm: str, inputs: list[int], num_outputs: int) -> list[int]:
    """Outputs ($0 .. $num_outputs-1) of the asm block for 32-bit inputs ($num_outputs ...)."""
    regs: dict[str, int] = {f"${num_outputs + i}": value & _MASK for i, value in enumerate(inputs)}

    def value(operand: str) -> int:
        if operand in regs:
            return regs[operand]
        return int(operand, 0) & _MASK

    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        args = [value(s) for s in srcs]
        if op == "mov.b32":
            result = args[0]
        elif op == "and.b32":
            result = args[0] & args[1]
        elif op == "or.b32":
            result = args[0] | args[1]
        elif op == "shl.b32":
            result = (args[0] << args[1]) & _MASK
        elif op == "shr.b32":
            result = args[0] >> args[1]
        elif op == "prmt.b32":
            result = _prmt(*args)
        elif op == "lop3.b32":  # bit i of the result: the table's bit (a_i b_i c_i) read as a number
            a, b, c, table = args
            result = 0
            for i in range(32):
                index = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
                result |= ((table >> index) & 1) << i
        elif (match := re.fullmatch(r"fma\.rn\.(bf16x2|f16x2)", op)) is not None:
            dtype = _LANE_DTYPES[match.group(1)]
            a, b, c = (_lanes_to_floats(x, dtype) for x in args)
            result = _floats_to_word([x * y + z for x, y, z in zip(a, b, c)], dtype)
        else:
            raise NotImplementedError(f"instruction {op!r} (line {line!r})")
        regs[dst] = result
    return [regs[f"${i}"] for i in range(num_outputs)]


def pack(values: torch.Tensor) -> list[int]:
    """A 1-D tensor of 8- or 16-bit elements as the 32-bit registers Triton's inline asm gets them
    in (element 0 in the low bits)."""
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]


def unpack(words: list[int], dtype: torch.dtype) -> torch.Tensor:
    raw = b"".join(w.to_bytes(4, "little") for w in words)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
