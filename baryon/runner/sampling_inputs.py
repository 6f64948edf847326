"""Build the sampler's batched tensors from the requests that sample a token this step."""

from __future__ import annotations

import numpy as np
import torch

from baryon.request import Request
from baryon.transfer import to_device, to_device_many
from baryon.layers.sampler import PenaltyInputs, SamplingBatch


def _token_matrix(rows: list[list[int]], vocab_size: int, device: torch.device, count: bool) -> torch.Tensor:
    """[len(rows), vocab_size]: per row, how often each token id occurs (count) or whether it does."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((len(rows), max(width, 1)), vocab_size, dtype=torch.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    padded = to_device(padded, device)
    # One spare column (id vocab_size) absorbs the padding.
    out = torch.zeros(len(rows), vocab_size + 1, device=device)
    out.scatter_add_(1, padded, torch.ones_like(padded, dtype=out.dtype))
    out = out[:, :vocab_size]
    return out if count else out > 0


def build_sampling_batch(requests: list[Request], vocab_size: int, device: torch.device,
                         pending: list[tuple[int, int]] = (), previous: torch.Tensor | None = None) -> SamplingBatch:
    """pending: (row, index into `previous`) for requests whose latest token is still on the
    device (previous: the last step's sampled ids); penalties count it from there."""
    params = [r.sampling_params for r in requests]

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)

    greedy = [p.is_greedy for p in params]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    # The columns every step sends, in one copy: temperature, greedy, and top-k / top-p / min-p
    # where some request sets them.
    use_top_k, use_top_p, use_min_p = any(top_k), any(p < 1.0 for p in top_p), any(min_p)
    columns = [np.array([1.0 if g else p.temperature for g, p in zip(greedy, params)], dtype=np.float32),
               np.array(greedy, dtype=np.bool_)]
    if use_top_k:
        columns.append(np.array(top_k, dtype=np.int64))
    if use_top_p:
        columns.append(np.array(top_p, dtype=np.float32))
    if use_min_p:
        columns.append(np.array(min_p, dtype=np.float32))
    temperature, greedy_rows, *optional = to_device_many(columns, device)
    optional = iter(optional)  # the optional columns sent, in the order above
    penalties = None
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        penalties = PenaltyInputs(
            prompt_mask=_token_matrix([r.prompt_token_ids for r in requests], vocab_size, device, count=False),
            output_counts=_output_counts(requests, vocab_size, device, pending, previous),
            presence=column([p.presence_penalty for p in params], torch.float32),
            frequency=column([p.frequency_penalty for p in params], torch.float32),
            repetition=column([p.repetition_penalty for p in params], torch.float32),
        )
    banned = None
    ban_rows = [(i, _stop_ids(r)) for i, r in enumerate(requests)
                if r.num_output_tokens + r.num_pending_tokens < r.sampling_params.min_tokens]
    if any(ids for _, ids in ban_rows):
        banned = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
        for i, ids in ban_rows:
            banned[i, [t for t in ids if t < vocab_size]] = True
        banned = to_device(banned, device)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperature=temperature,
        greedy=greedy_rows,
        all_greedy=all(greedy),
        top_k=next(optional) if use_top_k else None,
        top_p=next(optional) if use_top_p else None,
        min_p=next(optional) if use_min_p else None,
        generators={i: r.generator for i, r in enumerate(requests)
                    if r.generator is not None and not r.sampling_params.is_greedy},
        penalties=penalties,
        banned=banned,
        num_logprobs=max(asked) if asked else None,
    )


def _output_counts(requests: list[Request], vocab_size: int, device: torch.device,
                   pending: list[tuple[int, int]], previous: torch.Tensor | None) -> torch.Tensor:
    counts = _token_matrix([r.output_token_ids for r in requests], vocab_size, device, count=True)
    if pending:
        rows = to_device(torch.tensor([row for row, _ in pending]), device)
        tokens = previous[to_device(torch.tensor([source for _, source in pending]), device)]
        counts.index_put_((rows, tokens), torch.ones(len(pending), device=device), accumulate=True)
    return counts


def _stop_ids(request: Request) -> list[int]:
    """Token ids that would end the request (banned until min_tokens are generated)."""
    ids = list(request.sampling_params.stop_token_ids)
    if not request.sampling_params.ignore_eos:
        ids += list(request.eos_token_ids)
    return ids
