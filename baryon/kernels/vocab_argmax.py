"""Greedy tokens from vocabulary slices of the logits (family `vocab_argmax`).

A greedy decode step needs each row's first id of its largest logit. Under tensor parallelism each
rank holds a slice of the vocabulary's logits (ids vocab_start ... vocab_start + width - 1), so
each rank lists candidates, the ranks exchange them, and every rank picks the same winner:

    candidates(local [n, >= width], width, vocab_start) -> [n, C, 4]: in id order, C rows per row of
        local (C is the implementation's), each (a logit, the id of its first occurrence as three
        base-256 digits, lowest first), in local's dtype: exact for ids below 2**24 (a digit is
        at most 255, which bfloat16's 8 bits of precision hold)
    pick(every [G, n, C, 4]) -> [n] int64: the id of the largest logit over every candidate, the
        first in (G, C) order on a tie: with G ranks' candidates stacked in rank order, that is
        the lowest id holding the row's largest logit, as argmax over the whole row finds it
    argmax(local, width) -> [n] int64: the same for one slice holding the whole vocabulary

The torch reference lists one candidate a row (torch's max over the slice). On one row of a
75,968-wide slice (Qwen3's vocabulary at TP=2, bf16) torch's max with indices took 18 us and its
argmax 17 us on an H200, against 8.7 us over the whole 151,936 (graph-replayed; BENCHMARKS.md,
2026-11-27, session 34). The Triton kernel gives each CHUNK of a row its
own program, which writes that chunk's candidate; the pick reads all of a row's candidates. A
TP=2 greedy step is then two kernels and the exchange, where the torch ops were ten launches.
"""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, pdl_launch, tl, triton, wait_and_release

MAX_VOCAB = 1 << 24  # ids travel as three base-256 digits


def candidates_reference(local: torch.Tensor, width: int, vocab_start: int) -> torch.Tensor:
    """[n, 1, 4]: each row's largest logit among its first `width` columns and its first id."""
    value, best = local[:, :width].max(dim=-1, keepdim=True)  # [n, 1] each
    token = best + vocab_start
    digits = torch.cat((token % 256, token // 256 % 256, token // 65536), dim=1).to(local.dtype)  # [n, 3]
    return torch.cat((value, digits), dim=1).unsqueeze(1)


def pick_reference(every: torch.Tensor) -> torch.Tensor:
    """every [G, n, C, 4] -> [n] int64 (see the module docstring)."""
    groups, n, per_row, _ = every.shape
    flat = every.permute(1, 0, 2, 3).reshape(n, groups * per_row, 4)  # [n, G * C, 4] in (G, C) order
    winner = flat[:, :, 0].argmax(dim=1)  # [n]: the first candidate holding the largest logit
    chosen = flat.gather(1, winner.view(-1, 1, 1).expand(-1, 1, 4))[:, 0, 1:].long()  # [n, 3]
    return chosen[:, 0] + 256 * chosen[:, 1] + 65536 * chosen[:, 2]


def _check(local: torch.Tensor, width: int, vocab_start: int) -> None:
    if local.dim() != 2 or not 0 < width <= local.shape[1]:
        raise ValueError(f"vocab_argmax takes logits [n, >= width] with width > 0, got {tuple(local.shape)} "
                         f"and width {width}")
    if vocab_start + width > MAX_VOCAB:
        raise ValueError(f"ids up to {vocab_start + width} do not fit three base-256 digits (< {MAX_VOCAB})")


class TorchVocabArgmax(Kernel):
    name = "torch"

    @staticmethod
    def argmax(local: torch.Tensor, width: int) -> torch.Tensor:
        """One slice holding the whole vocabulary: [n] int64, torch's argmax (one op on CPU)."""
        return local[:, :width].argmax(dim=-1)

    @staticmethod
    def candidates(local: torch.Tensor, width: int, vocab_start: int) -> torch.Tensor:
        _check(local, width, vocab_start)
        return candidates_reference(local, width, vocab_start)

    @staticmethod
    def pick(every: torch.Tensor) -> torch.Tensor:
        return pick_reference(every)


CHUNK = 2048  # logits a program reduces: 37 programs a row over 75,968 ids, 75 over 151,936

if triton is not None:

    @triton.jit
    def _chunk_candidates_kernel(local, out, stride_l, width, vocab_start, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Program (row, c): the largest logit of columns [c * CHUNK, (c + 1) * CHUNK) of the row and
        its first id, as out[row, c] = (value, digit 0, digit 1, digit 2)."""
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(local + row * stride_l + cols, mask=cols < width, other=float("-inf")).to(tl.float32)  # exact
        value = tl.max(x, axis=0)
        token = vocab_start + chunk * CHUNK + _first_at(x, value, CHUNK)
        at = out + (row * tl.num_programs(1) + chunk) * 4
        dtype = out.dtype.element_ty
        tl.store(at, value.to(dtype))
        # digits through float32: the interpreter casts int32 to bfloat16 by its bits
        tl.store(at + 1, (token % 256).to(tl.float32).to(dtype))
        tl.store(at + 2, (token // 256 % 256).to(tl.float32).to(dtype))
        tl.store(at + 3, (token // 65536).to(tl.float32).to(dtype))

    @triton.jit
    def _first_at(values, largest, SIZE: tl.constexpr):
        """The first position of `largest` in values [SIZE] (0 where none equals it: all NaN)."""
        first = tl.min(tl.where(values == largest, tl.arange(0, SIZE), SIZE), axis=0)
        return tl.where(first == SIZE, 0, first)

    @triton.jit
    def _digit(at):
        return tl.load(at).to(tl.float32).to(tl.int64)

    @triton.jit
    def _pick_kernel(every, ids, n, GROUPS: tl.constexpr, PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
        """Program row: ids[row] = the id of the first candidate (in (group, c) order) of the row's
        largest logit; every [GROUPS, n, PER_ROW, 4] contiguous."""
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)  # candidate j = group * PER_ROW + c
        at = ((j // PER_ROW) * n + row) * PER_ROW * 4 + (j % PER_ROW) * 4
        values = tl.load(every + at, mask=j < GROUPS * PER_ROW, other=float("-inf")).to(tl.float32)
        first = _first_at(values, tl.max(values, axis=0), BLOCK)
        chosen = every + ((first // PER_ROW) * n + row) * PER_ROW * 4 + (first % PER_ROW) * 4
        token = (_digit(chosen + 1) + 256 * _digit(chosen + 2) + 65536 * _digit(chosen + 3))
        tl.store(ids + row, token)


class TritonVocabArgmax(TritonKernel):
    family = "vocab_argmax"

    @classmethod
    def argmax(cls, local: torch.Tensor, width: int) -> torch.Tensor:
        """One slice holding the whole vocabulary: [n] int64 (its candidates, picked)."""
        return cls.pick(cls.candidates(local, width, 0).unsqueeze(0))

    @staticmethod
    def candidates(local: torch.Tensor, width: int, vocab_start: int) -> torch.Tensor:
        _check(local, width, vocab_start)
        n = local.shape[0]
        chunks = -(-width // CHUNK)
        out = torch.empty(n, chunks, 4, dtype=local.dtype, device=local.device)  # [n, C, 4]
        if n:
            _chunk_candidates_kernel[(n, chunks)](local, out, local.stride(0), width, vocab_start, CHUNK=CHUNK,
                                                  num_warps=4, **pdl_launch(local.device))
        return out

    @staticmethod
    def pick(every: torch.Tensor) -> torch.Tensor:
        groups, n, per_row, _ = every.shape
        every = every.contiguous()
        ids = torch.empty(n, dtype=torch.int64, device=every.device)  # [n]
        if n:
            _pick_kernel[(n,)](every, ids, n, GROUPS=groups, PER_ROW=per_row,
                               BLOCK=next_power_of_2(groups * per_row), num_warps=4, **pdl_launch(every.device))
        return ids
