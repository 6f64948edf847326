"""The sampler: logits of the rows to sample -> next token ids (and logprobs), batched on device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baryon.kernels.selector import select


@dataclass
class PenaltyInputs:
    prompt_mask: torch.Tensor  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [B, V] float32: times the token was generated so far
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, already on the device."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64 (0 = all); None when no row truncates
    top_p: torch.Tensor | None  # [B] float32; None when no row truncates
    min_p: torch.Tensor | None  # [B] float32; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> the request's own seeded generator
    penalties: PenaltyInputs | None
    banned: torch.Tensor | None  # [B, V] bool: tokens that may not be sampled (stop tokens before min_tokens)
    num_logprobs: int | None  # largest logprobs count asked for in the batch; None: no logprobs


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # With logprobs: [B, 1 + num_logprobs] ids and logprobs, the sampled token first, then the top ones.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_rank: torch.Tensor | None = None  # [B] int64, 1 = most likely


def _rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def penalised_logits(kernel, logits: torch.Tensor, batch: SamplingBatch,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Banned tokens and penalties applied to logits [N, V]; rows: the batch entry of each of the
    N rows (None: row i is entry i). kernel: the "sampling" selector choice."""
    if batch.banned is not None:
        logits = logits.masked_fill(_rows(batch.banned, rows), float("-inf"))
    if batch.penalties is not None:
        p = batch.penalties
        logits = kernel.apply_penalties(logits, *(_rows(t, rows) for t in (
            p.prompt_mask, p.output_counts, p.presence, p.frequency, p.repetition)))
    return logits


def sampling_probs(kernel, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] (penalised) logits -> the distribution a sampling row draws from: temperature,
    top-k / top-p, softmax, min-p (which leaves it unnormalised: an exponential race needs no sum
    of 1). rows as in penalised_logits."""
    logits = logits / _rows(batch.temperature, rows).unsqueeze(1)
    probs = kernel.apply_top_k_top_p(logits, _rows(batch.top_k, rows), _rows(batch.top_p, rows)).softmax(dim=-1)
    if batch.min_p is not None:
        probs = kernel.apply_min_p(probs, _rows(batch.min_p, rows))
    return probs


def row_seeds(generator: torch.Generator, batch: SamplingBatch) -> torch.Tensor:
    """[B] int64: each row's seed for this step's noise, drawn from the request's own generator
    where it has a seed (its draws then do not depend on the batch), else from `generator`."""
    seeds = torch.randint(1 << 62, batch.greedy.shape, generator=generator, device=batch.greedy.device)
    for row, request_generator in batch.generators.items():
        seeds[row] = torch.randint(1 << 62, (1,), generator=request_generator, device=request_generator.device)[0]
    return seeds


def draw_tokens(kernel, logits: torch.Tensor, batch: SamplingBatch, seeds: torch.Tensor) -> torch.Tensor:
    """(Penalised) logits [B, V] -> each row's token [B]: greedy rows their argmax, the others a
    draw with the row's seed (kernel.sample_rows: on GPUs the exponential race in one pass, on
    CPU by inverse CDF) over the logits (top-k / top-p leave -inf on the tokens they drop; they
    need the temperature applied first) or, with min-p, which works on probabilities, over the
    log of the distribution sampling_probs makes. kernel: the "sampling" selector choice."""
    temperature = batch.temperature
    if batch.min_p is not None:
        log_probs = sampling_probs(kernel, logits, batch).log()
        drawn = kernel.sample_rows(log_probs, torch.ones_like(temperature), torch.zeros_like(batch.greedy), seeds)
        return torch.where(batch.greedy, logits.argmax(dim=-1), drawn)  # (rounded probabilities may tie)
    if batch.top_k is not None or batch.top_p is not None:
        logits = kernel.apply_top_k_top_p(logits / temperature.unsqueeze(1), batch.top_k, batch.top_p)
        temperature = torch.ones_like(temperature)  # greedy rows' are 1: their argmax is unchanged
    return kernel.sample_rows(logits, temperature, batch.greedy, seeds)


class Sampler(nn.Module):
    def __init__(self, device: torch.device, seed: int) -> None:
        super().__init__()
        self.kernel = select("sampling", device)
        # Draws for the rows that bring no seed of their own.
        self.generator = torch.Generator(device).manual_seed(seed)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V] float32 -> SamplerOutput. Logprobs are those of the model's raw
        distribution (before penalties, temperature and truncation), as vLLM reports them."""
        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
        logits = penalised_logits(self.kernel, logits, batch)
        sampled = logits.argmax(dim=-1) if batch.all_greedy else \
            draw_tokens(self.kernel, logits, batch, row_seeds(self.generator, batch))
        output = SamplerOutput(sampled=sampled)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, batch.num_logprobs, output)
        return output

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, k: int, output: SamplerOutput) -> None:
        sampled = output.sampled.unsqueeze(1)
        sampled_logprob = logprobs.gather(1, sampled)  # [B, 1]
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [B, k]
        output.logprob_token_ids = torch.cat((sampled, top_ids), dim=1)
        output.logprobs = torch.cat((sampled_logprob, top_logprobs), dim=1)
        output.sampled_rank = (logprobs > sampled_logprob).sum(dim=-1) + 1
