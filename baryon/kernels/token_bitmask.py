"""A grammar's allowed-token bitmask applied to logits (constrained decoding): torch reference.

The bitmask is xgrammar's layout (`allocate_token_bitmask` / `fill_next_token_bitmask`): int32
[R, W] with W = ceil(V_mask / 32); bit j of word w, `(word >> j) & 1`, says whether token id
32 * w + j is allowed. Bitmask row r applies to logits row rows[r]; every token it does not allow
becomes -inf there, and logits rows no bitmask row names are left alone. Token ids the mask does
not reach (>= 32 * W) are disallowed; mask bits past the logits' vocabulary are ignored. Where a
logits row is named more than once, a token is disallowed if any of its bitmask rows disallows it.
"""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel

BITS_PER_WORD = 32


def unpack_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask: [R, W] int32 -> [R, vocab] bool, True where the token is allowed (False past 32 * W)."""
    num_rows, num_words = bitmask.shape
    covered_words = min(num_words, -(-vocab // BITS_PER_WORD))
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :covered_words, None] >> shifts) & 1  # [R, covered_words, 32]
    allowed = bits.reshape(num_rows, covered_words * BITS_PER_WORD)[:, :vocab].bool()  # [R, <= vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)  # [R, vocab]


class TorchTokenBitmask(Kernel):
    name = "torch"

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """In place: logits[rows[r], t] = -inf where bitmask[r] does not allow token t.
        logits: [B, V] float; bitmask: [R, W] int32; rows: [R] int64 (see the module docstring)."""
        if rows.numel() == 0:
            return
        blocked_by_row = ~unpack_allowed(bitmask, logits.shape[1])  # [R, V]
        blocked = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)  # [B, V]
        blocked.index_add_(0, rows, blocked_by_row)  # bool addition: OR over repeated rows
        logits.masked_fill_(blocked, float("-inf"))


class CpuTokenBitmask(Kernel):
    """The C++ kernel (kernels/cpu/token_bitmask.cpp): one word read per 32 tokens, only the
    disallowed logits written; float32 logits (others take the torch reference)."""

    name = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        from baryon.kernels.cpu import unsupported_reason

        return unsupported_reason(device)

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or not bitmask.is_contiguous():
            TorchTokenBitmask.apply(logits, bitmask, rows)
            return
        torch.ops.baryon_cpu.apply_token_bitmask(logits, bitmask, rows)
