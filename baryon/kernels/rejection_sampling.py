"""Rejection sampling for speculative decoding (the accept/reject decision): torch reference.

Layout of one step: request i brought num_drafts_i = cu[i + 1] - cu[i] draft tokens (0 allowed),
flat in draft_token_ids[cu[i]:cu[i + 1]], and the target model scored num_drafts_i + 1 rows for
it, rows cu[i] + i .. cu[i + 1] + i: row cu[i] + i + j gives the target's distribution at draft j,
the last row the one after all of them (the bonus token).

For each request, drafts are taken in order while they are accepted: a greedy request accepts a
draft iff it equals its row's target argmax; a sampling request iff u * q <= p and p > 0, where p
is the target's (processed) probability of the draft, q the draft model's (1 for deterministic
drafts such as n-grams) and u ~ U[0, 1) - the acceptance probability min(1, p / q) of
speculative sampling (Leviathan et al., 2023). `p > 0` only matters when u = 0: a token the target
cannot emit is never accepted. At the first rejection the request emits its row's argmax (greedy)
or the recovered token the caller drew from the residual normalize(max(p - q, 0)) (sampling), and
stops; if every draft is accepted it emits the last row's argmax (greedy) or the bonus token drawn
from that row. So each request emits 1 to num_drafts_i + 1 tokens.
"""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_drafts: torch.Tensor, target_argmax: torch.Tensor,
                     target_prob_of_draft: torch.Tensor, draft_prob_of_draft: torch.Tensor | None,
                     uniforms: torch.Tensor, recovered_token_ids: torch.Tensor, bonus_token_ids: torch.Tensor,
                     greedy: torch.Tensor, max_spec_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_token_ids: [num_drafts] int64; cu_num_drafts: [B + 1] int32; target_argmax:
    [num_drafts + B] int64; target_prob_of_draft, draft_prob_of_draft (or None: q = 1), uniforms:
    [num_drafts] float32; recovered_token_ids: [num_drafts] int64; bonus_token_ids: [B] int64;
    greedy: [B] bool; max_spec_len >= every num_drafts_i.
    -> output_token_ids [B, max_spec_len + 1] int64 (-1 past each request's tokens), num_output [B] int32.
    No host synchronisation: every shape comes from the arguments' sizes and max_spec_len."""
    device = draft_token_ids.device
    batch_size, num_drafts = cu_num_drafts.numel() - 1, draft_token_ids.numel()
    starts = cu_num_drafts[:-1].long()  # [B]
    counts = cu_num_drafts[1:].long() - starts  # [B]
    request = torch.arange(batch_size, device=device)
    draft_request = torch.repeat_interleave(request, counts, output_size=num_drafts)  # [num_drafts]
    draft_position = torch.arange(num_drafts, device=device) - starts[draft_request]  # j within its request
    draft_row = torch.arange(num_drafts, device=device) + draft_request  # the target row scoring it

    q = draft_prob_of_draft if draft_prob_of_draft is not None else 1.0
    sampled_accept = (uniforms * q <= target_prob_of_draft) & (target_prob_of_draft > 0)
    accept = torch.where(greedy[draft_request], draft_token_ids == target_argmax[draft_row], sampled_accept)

    def padded(values: torch.Tensor, fill) -> torch.Tensor:  # [num_drafts] -> [B, max_spec_len + 1]
        out = torch.full((batch_size, max_spec_len + 1), fill, dtype=values.dtype, device=device)
        out[draft_request, draft_position] = values
        return out

    # Leading accepted drafts; the padding (and the last column) reads as a rejection.
    num_accepted = padded(accept, False).long().cumprod(dim=1).sum(dim=1)  # [B], <= counts
    stop = num_accepted.unsqueeze(1)  # [B, 1]: the column of the token that ends the request
    sampled_stop = torch.where(num_accepted < counts, padded(recovered_token_ids, 0).gather(1, stop).squeeze(1),
                               bonus_token_ids)
    stop_token = torch.where(greedy, target_argmax[starts + request + num_accepted], sampled_stop)  # [B]
    columns = torch.arange(max_spec_len + 1, device=device)
    output = torch.where(columns < stop, padded(draft_token_ids, -1), -1)
    output = torch.where(columns == stop, stop_token.unsqueeze(1), output)  # [B, max_spec_len + 1]
    return output, (num_accepted + 1).to(torch.int32)


class TorchRejectionSampling(Kernel):
    name = "torch"
    rejection_sample = staticmethod(rejection_sample)
