"""The rejection sampler: the target model's logits over each request's drafts -> the tokens it emits.

Rows: request i brought num_drafts_i draft tokens (cu_num_drafts[i]..cu_num_drafts[i + 1] of the
flat draft_token_ids) and owns num_drafts_i + 1 target rows, cu_num_drafts[i] + i onwards; row j
of a request is the target's distribution at its draft j, the last row the one after every draft.

Every row is processed as layers/sampler.Sampler processes a request's row (banned tokens and
penalties; greedy: argmax; sampling: temperature, top-k/top-p, softmax, min-p), with the request's
parameters. Greedy requests keep their drafts while they equal the target's argmax. Sampling
requests run speculative sampling (Leviathan et al., 2023): a draft is kept with probability
min(1, p / q); at the first rejection the token is drawn from normalize(max(p - q, 0)) (q: the
draft model's distribution, or one-hot at the draft for deterministic drafts); after the last
draft the bonus token is drawn from p. The emitted tokens then follow the processed target
distribution exactly, and a request with no drafts is sampled exactly as Sampler samples it.

Randomness: per request one seed (drawn as Sampler draws a row's, `row_seeds`): its bonus token
is drawn by Sampler's own `draw_tokens` with it, and its recovered tokens by an exponential race
over the Exp(1) noise row the sampling kernel makes from it (`race_noise`: on GPUs the very noise
of the bonus draw's race) - a request emits only one of them, at a position fixed by its
uniforms, so drawing them from one seed changes no distribution - and one uniform per draft. A
request with its own generator (batch.generators) draws both from it, seed first, so its tokens
do not depend on the rest of the batch; the others draw from the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baryon.kernels.selector import select
from baryon.layers.sampler import (Sampler, SamplerOutput, SamplingBatch, draw_tokens, penalised_logits, row_seeds,
                                   sampling_probs)


@dataclass
class RejectionSamplerOutput:
    output_token_ids: torch.Tensor  # [B, max_spec_len + 1] int64: accepted drafts then one token, -1 after
    num_output: torch.Tensor  # [B] int32: tokens each request emits, 1 .. num_drafts_i + 1
    # With logprobs, per target row [num_drafts + B, 1 + num_logprobs]: the token emitted at that row
    # first, then the top ones (rows past a request's num_output hold no meaning).
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_rank: torch.Tensor | None = None  # [num_drafts + B] int64, 1 = most likely


@dataclass
class _Layout:
    """Where each draft and row sits: host sizes and device index vectors."""

    cu_num_drafts_cpu: list[int]  # [B + 1]
    max_spec_len: int
    row_request: torch.Tensor  # [num_drafts + B] int64: the request owning each target row
    row_position: torch.Tensor  # [num_drafts + B] int64: the row's index within its request
    draft_request: torch.Tensor  # [num_drafts] int64: the request of each draft
    draft_row: torch.Tensor  # [num_drafts] int64: the target row scoring each draft
    last_row: torch.Tensor  # [B] int64: each request's bonus row

    @classmethod
    def build(cls, cu_num_drafts: torch.Tensor, cu_num_drafts_cpu) -> _Layout:
        host = [int(c) for c in cu_num_drafts_cpu]
        batch_size, num_drafts = len(host) - 1, host[-1]
        max_spec_len = max((b - a for a, b in zip(host, host[1:])), default=0)
        device = cu_num_drafts.device
        cu = cu_num_drafts.long()
        counts = cu[1:] - cu[:-1]  # [B]
        request = torch.arange(batch_size, device=device)
        row_request = torch.repeat_interleave(request, counts + 1, output_size=num_drafts + batch_size)
        row_position = torch.arange(num_drafts + batch_size, device=device) - (cu[:-1] + request)[row_request]
        draft_request = torch.repeat_interleave(request, counts, output_size=num_drafts)
        draft_row = torch.arange(num_drafts, device=device) + draft_request
        return cls(host, max_spec_len, row_request, row_position, draft_request, draft_row, cu[1:] + request)


class RejectionSampler(nn.Module):
    def __init__(self, device: torch.device, seed: int) -> None:
        super().__init__()
        self.kernel = select("rejection_sampling", device)
        self.sampling_kernel = select("sampling", device)
        # Draws for the requests that bring no seed of their own.
        self.generator = torch.Generator(device).manual_seed(seed)

    def forward(self, target_logits: torch.Tensor, draft_token_ids: torch.Tensor, cu_num_drafts: torch.Tensor,
                cu_num_drafts_cpu, draft_probs: torch.Tensor | None, batch: SamplingBatch) -> RejectionSamplerOutput:
        """target_logits: [num_drafts + B, V] float32 (rows as in the module docstring);
        draft_token_ids: [num_drafts] int64; cu_num_drafts: [B + 1] int32 on the device and
        cu_num_drafts_cpu the same on the host (list or numpy); draft_probs: [num_drafts, V] float32,
        the draft model's processed distribution at each draft, or None for deterministic drafts;
        batch: one entry per request. The output is as wide as the most drafts of a request + 1.
        Logprobs are those of the raw logits, as Sampler reports them."""
        layout = _Layout.build(cu_num_drafts, cu_num_drafts_cpu)
        raw_logprobs = target_logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
        logits = penalised_logits(self.sampling_kernel, target_logits, batch, layout.row_request)
        target_argmax = logits.argmax(dim=-1)  # [num_drafts + B]
        if batch.all_greedy:  # the kernel reads none of the sampling inputs
            no_probs = torch.zeros_like(draft_token_ids, dtype=torch.float32)
            sampled = (no_probs, None, no_probs, draft_token_ids, target_argmax[layout.last_row])
        else:
            sampled = self._sample(logits, draft_token_ids, draft_probs, batch, layout)
        target_prob_of_draft, draft_prob_of_draft, uniforms, recovered_token_ids, bonus_token_ids = sampled
        output_token_ids, num_output = self.kernel.rejection_sample(
            draft_token_ids, cu_num_drafts, target_argmax, target_prob_of_draft, draft_prob_of_draft, uniforms,
            recovered_token_ids, bonus_token_ids, batch.greedy, layout.max_spec_len)
        output = RejectionSamplerOutput(output_token_ids=output_token_ids, num_output=num_output)
        if raw_logprobs is not None:
            emitted = output_token_ids[layout.row_request, layout.row_position].clamp(min=0)  # [num_rows]
            row_output = SamplerOutput(sampled=emitted)
            Sampler._gather_logprobs(raw_logprobs, batch.num_logprobs, row_output)
            output.logprob_token_ids, output.logprobs = row_output.logprob_token_ids, row_output.logprobs
            output.sampled_rank = row_output.sampled_rank
        return output

    def _draw(self, batch: SamplingBatch, layout: _Layout,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> each request's seed [B] (drawn as Sampler draws them, so a request with no drafts
        samples as there) and uniforms [num_drafts] ~ U[0, 1)."""
        cu = layout.cu_num_drafts_cpu
        seeds = row_seeds(self.generator, batch)
        uniforms = torch.empty(cu[-1], device=device)
        if cu[-1]:  # an empty draw is not made at all: it might still advance a generator
            uniforms.uniform_(generator=self.generator)
            for request, generator in batch.generators.items():
                if cu[request + 1] > cu[request]:
                    uniforms[cu[request]:cu[request + 1]].uniform_(generator=generator)
        return seeds, uniforms

    def _sample(self, logits: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                batch: SamplingBatch, layout: _Layout):
        """-> (p of each draft [num_drafts], q of each draft [num_drafts] or None, uniforms
        [num_drafts], recovered token per draft [num_drafts], bonus token per request [B])."""
        probs = sampling_probs(self.sampling_kernel, logits, batch, layout.row_request)  # [num_rows, V], unnormalised after min-p
        seeds, uniforms = self._draw(batch, layout, probs.device)
        bonus_token_ids = draw_tokens(self.sampling_kernel, logits[layout.last_row], batch, seeds)  # [B], as Sampler
        noise = self.sampling_kernel.race_noise(seeds, probs.shape[1])  # [B, V], from the bonus draw's seeds
        draft_rows = probs[layout.draft_row]  # [num_drafts, V]
        draft_rows = draft_rows / draft_rows.sum(dim=-1, keepdim=True)  # p, compared with q
        drafts = draft_token_ids.unsqueeze(1)  # [num_drafts, 1]
        target_prob_of_draft = draft_rows.gather(1, drafts).squeeze(1)
        if draft_probs is None:  # q is one-hot at the draft
            draft_prob_of_draft = None
            residual = draft_rows.scatter(1, drafts, 0.0)
        else:
            draft_prob_of_draft = draft_probs.gather(1, drafts).squeeze(1)
            residual = (draft_rows - draft_probs).clamp_(min=0.0)
        # p == q leaves no residual (and the draft is then always kept): fall back to p.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, draft_rows)
        recovered_token_ids = (residual / noise[layout.draft_request]).argmax(dim=-1)  # [num_drafts]
        return target_prob_of_draft, draft_prob_of_draft, uniforms, recovered_token_ids, bonus_token_ids
