"""Rejection sampling for speculative decoding as a Triton kernel: one program per request.

Same rule and layout as the torch reference in rejection_sampling.py (read its docstring). A
program loads all of its request's drafts at once (BLOCK >= max_spec_len + 1 lanes), finds the
first rejected one with a min-reduction and writes the request's whole output row, so it has no
loop and no host synchronisation.
"""

from __future__ import annotations

import torch

from baryon.kernels.triton_utils import TritonKernel, next_power_of_2, tl, triton

if triton is not None:

    @triton.jit
    def _rejection_sample_kernel(draft_token_ids, cu_num_drafts, target_argmax, target_prob_of_draft,
                                 draft_prob_of_draft, uniforms, recovered_token_ids, bonus_token_ids, greedy,
                                 output_token_ids, num_output, OUTPUT_WIDTH: tl.constexpr,
                                 HAS_DRAFT_PROBS: tl.constexpr, BLOCK: tl.constexpr):
        """draft_token_ids, recovered_token_ids: [num_drafts] int64; cu_num_drafts: [B + 1] int32;
        target_argmax: [num_drafts + B] int64; target_prob_of_draft, draft_prob_of_draft (read
        only when HAS_DRAFT_PROBS), uniforms: [num_drafts] float32; bonus_token_ids: [B] int64;
        greedy: [B] uint8 -> output_token_ids: [B, OUTPUT_WIDTH] int64, num_output: [B] int32.
        BLOCK >= OUTPUT_WIDTH = max_spec_len + 1. Grid: (B,)."""
        request = tl.program_id(0).to(tl.int64)
        start = tl.load(cu_num_drafts + request).to(tl.int64)
        count = tl.load(cu_num_drafts + request + 1).to(tl.int64) - start
        position = tl.arange(0, BLOCK)  # [BLOCK]: draft j of the request, and output column j
        is_draft = position < count
        first_row = start + request  # the request's rows: first_row .. first_row + count
        draft = tl.load(draft_token_ids + start + position, mask=is_draft, other=-1)
        row_argmax = tl.load(target_argmax + first_row + position, mask=position <= count, other=-1)
        is_greedy = tl.load(greedy + request) != 0

        p = tl.load(target_prob_of_draft + start + position, mask=is_draft, other=0.0)
        u = tl.load(uniforms + start + position, mask=is_draft, other=0.0)
        if HAS_DRAFT_PROBS:
            u = u * tl.load(draft_prob_of_draft + start + position, mask=is_draft, other=0.0)
        accept = tl.where(is_greedy, draft == row_argmax, (u <= p) & (p > 0))
        num_accepted = tl.min(tl.where(is_draft & ~accept, position, count), axis=0)  # first rejection

        at_stop = position == num_accepted
        greedy_stop = tl.sum(tl.where(at_stop, row_argmax, 0), axis=0)
        recovered = tl.load(recovered_token_ids + start + position, mask=is_draft, other=0)
        recovered_stop = tl.sum(tl.where(at_stop & is_draft, recovered, 0), axis=0)
        sampled_stop = tl.where(num_accepted < count, recovered_stop, tl.load(bonus_token_ids + request))
        stop_token = tl.where(is_greedy, greedy_stop, sampled_stop)
        output = tl.where(position < num_accepted, draft, tl.where(at_stop, stop_token, -1))
        tl.store(output_token_ids + request * OUTPUT_WIDTH + position, output, mask=position < OUTPUT_WIDTH)
        tl.store(num_output + request, (num_accepted + 1).to(tl.int32))


class TritonRejectionSampling(TritonKernel):
    """The accept/reject decision as one Triton program per request (semantics of rejection_sampling.py)."""

    family = "rejection_sampling"

    @staticmethod
    def rejection_sample(draft_token_ids: torch.Tensor, cu_num_drafts: torch.Tensor, target_argmax: torch.Tensor,
                         target_prob_of_draft: torch.Tensor, draft_prob_of_draft: torch.Tensor | None,
                         uniforms: torch.Tensor, recovered_token_ids: torch.Tensor, bonus_token_ids: torch.Tensor,
                         greedy: torch.Tensor, max_spec_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shapes as rejection_sampling.rejection_sample -> output_token_ids [B, max_spec_len + 1]
        int64 (-1 padded), num_output [B] int32."""
        batch_size, device = cu_num_drafts.numel() - 1, draft_token_ids.device
        output_token_ids = torch.empty(batch_size, max_spec_len + 1, dtype=torch.int64, device=device)
        num_output = torch.empty(batch_size, dtype=torch.int32, device=device)
        if batch_size:
            has_draft_probs = draft_prob_of_draft is not None
            _rejection_sample_kernel[(batch_size,)](
                draft_token_ids.contiguous(), cu_num_drafts.contiguous(), target_argmax.contiguous(),
                target_prob_of_draft.contiguous(),
                draft_prob_of_draft.contiguous() if has_draft_probs else target_prob_of_draft,
                uniforms.contiguous(), recovered_token_ids.contiguous(), bonus_token_ids.contiguous(),
                greedy.contiguous().view(torch.uint8), output_token_ids, num_output, OUTPUT_WIDTH=max_spec_len + 1,
                HAS_DRAFT_PROBS=has_draft_probs, BLOCK=next_power_of_2(max_spec_len + 1))
        return output_token_ids, num_output
