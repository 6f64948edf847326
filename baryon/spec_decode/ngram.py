"""N-gram prompt lookup: draft tokens copied from earlier in a request's own history.

Code completion, editing, summarisation and retrieval-augmented answers repeat long spans of
their context verbatim. Prompt lookup exploits that without any draft model: take the last
``n`` tokens of the history, find where that n-gram occurred before, and propose the tokens that
followed it there. The target model verifies the drafts in one forward pass; when the span
really repeats, several tokens are accepted for the price of one step, and when it does not,
the cost is a few rejected slots (vLLM's ``method: "ngram"``).

Matching rule, per request: the longest ``n`` in ``[prompt_lookup_max, prompt_lookup_min]``
whose suffix n-gram also occurs earlier (ending before the last token, so at least one token
follows it); among its occurrences the most recent; the proposal is up to
``min(num_speculative_tokens, max_drafts)`` tokens that followed it (fewer at the history's end).

The search is vectorised with numpy: the candidates are every position holding the last token,
and each further lag filters them with one gather and comparison, so the cost is one pass over
the history plus ``prompt_lookup_max - 1`` passes over the (usually few) surviving candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes draft tokens by prompt lookup; holds no state between calls."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({prompt_lookup_min}), "
                f"got {prompt_lookup_max}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[np.ndarray],
                max_drafts: Sequence[int]) -> list[list[int]]:
        """Draft tokens for each request (possibly none).

        token_ids[i]: request i's whole history (prompt + output), a 1-D integer array that is
        only read. max_drafts[i]: how many drafts request i may take this step (0: none).
        """
        if len(token_ids) != len(max_drafts):
            raise ValueError(f"token_ids and max_drafts must have the same length, got "
                             f"{len(token_ids)} and {len(max_drafts)}")
        drafts = []
        for history, max_draft in zip(token_ids, max_drafts):
            if max_draft < 0:
                raise ValueError(f"max_drafts must be >= 0, got {max_draft}")
            num_drafts = min(self.num_speculative_tokens, max_draft)
            end = self._find_match_end(history) if num_drafts > 0 else None
            if end is None:
                drafts.append([])
            else:
                drafts.append(history[end + 1:end + 1 + num_drafts].tolist())
        return drafts

    def _find_match_end(self, history: np.ndarray) -> int | None:
        """Index of the last token of the chosen earlier occurrence, or None if none matches.

        A candidate ``i`` (``i <= len - 2``) survives lag ``j`` when
        ``history[i - j] == history[len - 1 - j]``; after lag ``n - 1`` the survivors are the
        ends of the earlier occurrences of the suffix n-gram, in increasing order.
        """
        if history.ndim != 1:
            raise ValueError(f"each token_ids entry must be 1-D, got shape {history.shape}")
        length = history.shape[0]
        if length < self.prompt_lookup_min + 1:
            return None
        # [num_candidates] positions before the last token that hold the last token
        candidates = np.flatnonzero(history[:-1] == history[-1])
        best_end = None
        for lag in range(self.prompt_lookup_max):
            if lag > 0:
                # An occurrence ending at i starts at i - lag >= 0 (candidates are sorted).
                candidates = candidates[np.searchsorted(candidates, lag):]
                if candidates.size == 0:
                    break
                candidates = candidates[history[candidates - lag] == history[length - 1 - lag]]
            if candidates.size == 0:
                break
            if lag + 1 >= self.prompt_lookup_min:
                best_end = int(candidates[-1])  # the most recent occurrence of this n-gram
        return best_end
