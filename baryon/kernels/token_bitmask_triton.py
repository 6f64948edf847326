"""A grammar's allowed-token bitmask applied to logits as a Triton kernel.

Same layout and rule as the torch reference in token_bitmask.py (read its docstring). One
program per (bitmask row, block of BLOCK_WORDS * 32 tokens): it loads the block's words once,
expands them into a [BLOCK_WORDS, 32] tile of bits and stores -inf only at disallowed tokens, so
allowed logits are never read or written.
"""

from __future__ import annotations

import torch

from baryon.kernels.token_bitmask import BITS_PER_WORD
from baryon.kernels.triton_utils import TritonKernel, tl, triton

# 32 words = 1024 tokens a program: a 151,936-token vocabulary is 149 programs per row, enough
# to fill an H100 at batch 1.
BLOCK_WORDS = 32

if triton is not None:

    @triton.jit
    def _apply_token_bitmask_kernel(logits, bitmask, rows, stride_logits, stride_bitmask, VOCAB, NUM_WORDS,
                                    BLOCK_WORDS: tl.constexpr, BITS: tl.constexpr):
        """logits: [B, VOCAB] float (unit column stride); bitmask: [R, NUM_WORDS] int32 (unit
        column stride); rows: [R] int. Grid: (R, cdiv(VOCAB, BLOCK_WORDS * BITS))."""
        mask_row = tl.program_id(0).to(tl.int64)
        logits_row = tl.load(rows + mask_row).to(tl.int64)
        word_ids = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # [BLOCK_WORDS]
        # Words past the mask read as 0: their tokens are disallowed.
        words = tl.load(bitmask + mask_row * stride_bitmask + word_ids, mask=word_ids < NUM_WORDS, other=0)
        bit_ids = tl.arange(0, BITS)  # [BITS]
        allowed = (words[:, None] >> bit_ids[None, :]) & 1  # [BLOCK_WORDS, BITS]
        token_ids = word_ids[:, None] * BITS + bit_ids[None, :]  # [BLOCK_WORDS, BITS]
        blocked = (allowed == 0) & (token_ids < VOCAB)
        minus_inf = tl.full([BLOCK_WORDS, BITS], float("-inf"), tl.float32)
        tl.store(logits + logits_row * stride_logits + token_ids, minus_inf, mask=blocked)


class TritonTokenBitmask(TritonKernel):
    """The bitmask as one Triton program per (bitmask row, vocabulary block) (semantics of token_bitmask.py)."""

    family = "token_bitmask"

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """In place: logits[rows[r], t] = -inf where bitmask[r] does not allow token t.
        logits: [B, V] float (rows may be strided, columns contiguous); bitmask: [R, W] int32;
        rows: [R] int64."""
        num_mask_rows, vocab = rows.numel(), logits.shape[1]
        if num_mask_rows == 0 or vocab == 0:
            return
        if logits.stride(1) != 1:
            raise ValueError("token_bitmask: logits need contiguous columns (stride 1 along the vocabulary)")
        bitmask = bitmask if bitmask.stride(1) == 1 else bitmask.contiguous()
        block_tokens = BLOCK_WORDS * BITS_PER_WORD
        grid = (num_mask_rows, -(-vocab // block_tokens))
        _apply_token_bitmask_kernel[grid](logits, bitmask, rows.contiguous(), logits.stride(0), bitmask.stride(0),
                                          vocab, bitmask.shape[1], BLOCK_WORDS=BLOCK_WORDS, BITS=BITS_PER_WORD)
