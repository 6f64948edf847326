"""Logit soft-capping (Gemma 2): s -> cap * tanh(s / cap), which bounds scores to (-cap, cap) and
leaves small ones nearly unchanged. Attention scores are capped before the softmax
(`attn_logit_softcapping`), the LM head's logits before sampling (`final_logit_softcapping`).
The torch reference, and the same function for Triton kernels."""

from __future__ import annotations

import torch

from baryon.kernels.triton_utils import tl, triton


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap), in the scores' dtype (as transformers computes it); cap None: the
    scores unchanged."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


if triton is not None:

    @triton.jit
    def soft_cap_tile(scores, CAP: tl.constexpr):
        """soft_cap of a float32 tile: tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|), which never
        overflows (Triton has no portable tanh: this runs compiled and in the interpreter)."""
        x = scores / CAP
        decay = tl.exp(-2.0 * tl.abs(x))
        magnitude = (1.0 - decay) / (1.0 + decay)
        return tl.where(x < 0, -magnitude, magnitude) * CAP
