"""Proposers: what drafts the tokens that the target model then verifies in one step.

A proposer is asked, after each step, for up to `max_drafts[i]` tokens to follow each request's
tokens (`Request.all_token_ids`). The runner schedules them with the request's next decode and
the rejection sampler keeps the ones the target agrees with. A proposer that samples its drafts
(a draft model at temperature > 0) also gives their probabilities (`draft_probs`), which the
rejection rule needs; deterministic drafts (n-gram lookup, greedy draft models) give none.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from baryon.layers.attention import PagedKVLayer
from baryon.layers.sampler import SamplingBatch
from baryon.request import Request
from baryon.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    # The draft's attention layers: the runner gives them caches beside the target's (same block ids).
    attention_layers: list[PagedKVLayer]
    samples: bool  # whether propose() reads the requests' sampling parameters (else it gets None)

    def propose(self, requests: list[Request], max_drafts: list[int],
                sampling: SamplingBatch | None) -> list[list[int]]:
        """Up to max_drafts[i] tokens to follow request i's tokens; sampling: the requests' parameters."""
        ...

    def draft_probs(self, requests: list[Request], num_drafts: list[int], vocab_size: int) -> torch.Tensor | None:
        """[sum(num_drafts), vocab] probabilities the drafts were drawn from (None: deterministic)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request that ended."""
        ...


class PromptLookupProposer:
    """n-gram prompt lookup over each request's history, kept as a growing numpy array per request
    (so a step converts only the new tokens)."""

    attention_layers: list[PagedKVLayer] = []
    samples = False

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        # One more than k: a proposal made one token behind drops its first token.
        self.ngram = NgramProposer(num_speculative_tokens + 1, prompt_lookup_min, prompt_lookup_max)
        self.histories: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, length)

    def _history(self, request: Request) -> np.ndarray:
        tokens = request.all_token_ids
        buffer, length = self.histories.get(request.request_id, (np.empty(0, dtype=np.int64), 0))
        if len(tokens) > len(buffer):
            grown = np.empty(max(2 * len(buffer), len(tokens), 256), dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:len(tokens)] = tokens[length:]
        self.histories[request.request_id] = (buffer, len(tokens))
        return buffer[:len(tokens)]

    def propose(self, requests: list[Request], max_drafts: list[int],
                sampling: SamplingBatch | None) -> list[list[int]]:
        return self.ngram.propose([self._history(r) for r in requests], max_drafts)

    def draft_probs(self, requests: list[Request], num_drafts: list[int], vocab_size: int) -> torch.Tensor | None:
        return None

    def forget(self, request_id: str) -> None:
        self.histories.pop(request_id, None)
