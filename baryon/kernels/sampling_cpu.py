"""Top-k / top-p on CPU without sorting the vocabulary, and the draw by inverse CDF (the sampling
family's CPU entry; the penalties and min-p are the torch reference's).

A full descending sort of a 49k-token row costs ~10 ms on a CPU core, as much as a decode step of
the default model. Here each row's top CANDIDATES logits come from `torch.topk`; top-k (k up to
CANDIDATES) and top-p are decided on them, the probabilities normalised over the whole row (or
over the row's top-k when one is set, as the reference does). The result equals the reference's
whenever the kept set lies inside the candidates, which is checked: when a row's k is larger, or
its candidates hold less probability than its top_p (a flat distribution), the batch takes the
sorting reference instead. Up to float rounding of the cumulative probability at the boundary,
the same tokens stay.
"""

from __future__ import annotations

import torch

from baryon.kernels.sampling import TorchSampling, apply_top_k_top_p

CANDIDATES = 256


def apply_top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor | None,
                                 top_p: torch.Tensor | None) -> torch.Tensor:
    """As sampling.apply_top_k_top_p: logits [B, V]; top_k [B] int (0 = all); top_p [B] (1 = all)."""
    if top_k is None and top_p is None:
        return logits
    rows, vocab = logits.shape
    count = min(vocab, CANDIDATES)
    # Rows without a top-k (0, or k >= vocab) and the k of the others.
    no_k = torch.ones(rows, dtype=torch.bool, device=logits.device) if top_k is None else (top_k <= 0) | (top_k >= vocab)
    if top_k is not None and bool(((top_k > count) & ~no_k).any()):
        return apply_top_k_top_p(logits, top_k, top_p)
    values, order = logits.topk(count, dim=-1)  # [B, count], descending
    drop = torch.zeros_like(values, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(no_k, count, top_k).clamp(min=1, max=count)
        drop |= (values < values.gather(1, (k - 1).unsqueeze(1))) & ~no_k.unsqueeze(1)
    keep_all = no_k.clone()  # rows that restrict nothing
    if top_p is not None:
        kept = values.masked_fill(drop, float("-inf"))
        # The reference's softmax runs over every token top-k kept: the whole row without top-k.
        normaliser = torch.where(no_k.unsqueeze(1), logits.logsumexp(dim=-1, keepdim=True),
                                 kept.logsumexp(dim=-1, keepdim=True))
        probs = (kept - normaliser).exp()
        restricting = top_p < 1
        if bool((restricting & (probs.sum(dim=-1) < top_p)).any()):  # a nucleus may reach past the candidates
            return apply_top_k_top_p(logits, top_k, top_p)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= (mass_before >= top_p.unsqueeze(1)) & restricting.unsqueeze(1)
        drop[:, 0] = False
        keep_all &= ~restricting
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill(drop, float("-inf")))
    return torch.where(keep_all.unsqueeze(1), logits, out)


def sample_rows_inverse_cdf(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                            seeds: torch.Tensor) -> torch.Tensor:
    """sampling.sample_rows by the inverse of each row's cumulative distribution: one uniform u
    per row from a generator seeded with its seed, then the first token whose cumulative
    probability exceeds u times the row's total. One exp per logit and no noise per token: a
    tenth of the race's time on a CPU (a 49,152-token row: ~0.1 ms against ~1 ms). The sums are
    float32, as the top-p reference's (a token below ~1e-7 of the mass behind it may be skipped)."""
    cdf = (logits / temperature.unsqueeze(1)).softmax(dim=-1).cumsum_(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]; NaN for a row with no finite logit
    u = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(seed)) for seed in seeds.tolist()]) \
        if len(seeds) else torch.empty(0)
    # Below the total (u * total may round up to it), so that the search ends on a token of
    # nonzero probability; right=True: the first token whose cumulative sum exceeds the target.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    drawn = torch.where(total.squeeze(1) > 0, drawn.clamp(max=logits.shape[1] - 1), 0)
    return torch.where(greedy, logits.argmax(dim=-1), drawn) if bool(greedy.any()) else drawn


class CpuSampling(TorchSampling):
    name = "cpu"
    apply_top_k_top_p = staticmethod(apply_top_k_top_p_candidates)
    sample_rows = staticmethod(sample_rows_inverse_cdf)

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return None if device.type == "cpu" else "runs on CPU only (GPUs have the Triton kernels)"
