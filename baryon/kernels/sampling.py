"""Logit processing and drawing for sampling (penalties, top-k, top-p, min-p, one draw per row
from its seed): torch reference.

All functions work on the whole batch at once ([num_rows, vocab] tensors with per-row
parameters); none loops over requests or the vocabulary in Python.
"""

from __future__ import annotations

import torch

from baryon.kernels.selector import Kernel


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM/OpenAI semantics. logits: [B, V] float32; prompt_mask: [B, V] bool (token in the
    prompt); output_counts: [B, V] (times generated so far); presence/frequency/repetition: [B].

    repetition divides positive (multiplies negative) logits of tokens seen in prompt or output;
    frequency subtracts count * frequency; presence subtracts presence once per generated token.
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k most likely tokens (0 = all) and then the smallest set whose
    probability reaches top_p (1 = all); the rest get -inf. logits: [B, V]; top_k [B] int; top_p [B]."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]: the k-th largest logit
        drop |= sorted_logits < kth
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        # top_p = 1 keeps everything, even where float32 sums reach 1 before the tail.
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's top probability.
    probs: [B, V]; min_p: [B] (0 = off)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                seeds: torch.Tensor) -> torch.Tensor:
    """One token per row: logits [B, V] (-inf where a token may not be drawn), temperature [B],
    greedy [B] bool, seeds [B] int64 -> [B] int64. A greedy row takes its argmax; any other row
    draws from softmax(logits / temperature) with randomness from the row's seed alone, so that a
    row's draw does not depend on the rest of the batch (each implementation its own way of
    turning the seed into a draw). A row with no finite logit gets token 0. Here: the exponential
    race in log space, argmax(logits / temperature - log q) with q ~ Exp(1) for every token from
    a generator seeded with the row's seed (`race_noise`), which needs no softmax."""
    keys = logits / temperature.unsqueeze(1)
    drawn = (keys - race_noise(seeds, keys.shape[1]).log()).nan_to_num(nan=float("-inf")).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def race_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds [B] int64 -> [B, vocab] float32 ~ Exp(1), each row from a generator seeded with its
    seed: the noise of `sample_rows`' race (the rejection sampler draws its recovered tokens with it)."""
    noise = torch.empty(len(seeds), vocab, device=seeds.device)
    for row, seed in enumerate(seeds.tolist()):
        noise[row].exponential_(generator=torch.Generator(seeds.device).manual_seed(seed))
    return noise


class TorchSampling(Kernel):
    name = "torch"
    apply_penalties = staticmethod(apply_penalties)
    apply_top_k_top_p = staticmethod(apply_top_k_top_p)
    apply_min_p = staticmethod(apply_min_p)
    sample_rows = staticmethod(sample_rows)
    race_noise = staticmethod(race_noise)
