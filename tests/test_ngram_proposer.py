"""NgramProposer against a plain-Python prompt-lookup reference on random short histories over a
small vocabulary (so n-grams repeat), plus the edge cases of the matching rule and bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from baryon.spec_decode.ngram import NgramProposer


def reference_proposal(history: list[int], num_speculative_tokens: int, prompt_lookup_min: int,
                       prompt_lookup_max: int, max_draft: int) -> list[int]:
    """Longest n first; for it the most recent earlier occurrence; the tokens that followed."""
    num_drafts = min(num_speculative_tokens, max_draft)
    if num_drafts <= 0:
        return []
    length = len(history)
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        suffix = history[length - n:]
        # An occurrence starting at `start` ends at start + n - 1, which must be <= length - 2.
        for start in range(length - 1 - n, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + num_drafts]
    return []


def propose_one(proposer: NgramProposer, history: list[int], max_draft: int = 100) -> list[int]:
    return proposer.propose([np.array(history, dtype=np.int64)], [max_draft])[0]


def test_matches_reference_on_random_histories(seed):
    rng = np.random.default_rng(seed)
    num_matched = 0
    for _ in range(200):
        prompt_lookup_min = int(rng.integers(1, 4))
        prompt_lookup_max = prompt_lookup_min + int(rng.integers(0, 4))
        k = int(rng.integers(1, 7))
        proposer = NgramProposer(k, prompt_lookup_min, prompt_lookup_max)
        batch = int(rng.integers(1, 9))
        vocab = int(rng.integers(2, 6))
        histories = [rng.integers(0, vocab, size=int(rng.integers(0, 40)), dtype=np.int64)
                     for _ in range(batch)]
        max_drafts = [int(rng.integers(0, 8)) for _ in range(batch)]
        copies = [h.copy() for h in histories]

        got = proposer.propose(histories, max_drafts)

        want = [reference_proposal(h.tolist(), k, prompt_lookup_min, prompt_lookup_max, m)
                for h, m in zip(histories, max_drafts)]
        assert got == want, (seed, prompt_lookup_min, prompt_lookup_max, k, max_drafts)
        assert all(type(t) is int for draft in got for t in draft)
        for h, c in zip(histories, copies):
            np.testing.assert_array_equal(h, c)  # the histories are only read
        num_matched += sum(len(d) > 0 for d in got)
    assert num_matched > 100  # the small vocabulary makes matches common


def test_views_of_a_longer_buffer(seed):
    """The runner passes views (a prefix of a preallocated buffer); tokens past it are unseen."""
    rng = np.random.default_rng(seed)
    buffer = rng.integers(0, 3, size=(4, 64), dtype=np.int64)
    lengths = [int(n) for n in rng.integers(2, 64, size=4)]
    proposer = NgramProposer(4, 1, 3)
    got = proposer.propose([buffer[i, :n] for i, n in enumerate(lengths)], [4] * 4)
    want = [reference_proposal(buffer[i, :n].tolist(), 4, 1, 3, 4) for i, n in enumerate(lengths)]
    assert got == want


def test_no_match():
    proposer = NgramProposer(3, 1, 3)
    assert propose_one(proposer, [1, 2, 3, 4, 5]) == []
    # The suffix bigram (4, 5) never occurs earlier and min is 2: the unigram 5 does not count.
    assert propose_one(NgramProposer(3, 2, 3), [5, 1, 2, 4, 5]) == []
    assert propose_one(NgramProposer(3, 1, 3), [5, 1, 2, 4, 5]) == [1, 2, 4]


def test_short_histories():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([np.array([], dtype=np.int64)], [3]) == [[]]
    assert propose_one(proposer, [7]) == []
    assert propose_one(proposer, [7, 7]) == [7]
    # Shorter than prompt_lookup_min + 1: no n-gram of an accepted length can occur earlier.
    assert propose_one(NgramProposer(3, 2, 3), [7, 7]) == []
    assert propose_one(NgramProposer(3, 2, 3), [7, 7, 7]) == [7]


def test_max_drafts_caps_the_proposal():
    proposer = NgramProposer(4, 1, 2)
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_one(proposer, history, max_draft=0) == []
    assert propose_one(proposer, history, max_draft=2) == [3, 4]
    assert propose_one(proposer, history, max_draft=100) == [3, 4, 5, 6]
    assert proposer.propose([np.array(history)] * 3, [0, 1, 9]) == [[], [3], [3, 4, 5, 6]]


def test_continuation_shorter_than_k_at_the_end():
    proposer = NgramProposer(5, 1, 3)
    # The only earlier occurrence of (8, 9) is followed by two tokens before the history ends;
    # the occurrence may overlap the suffix itself.
    assert propose_one(proposer, [8, 9, 8, 9]) == [8, 9]
    assert propose_one(proposer, [3, 8, 9, 1, 8, 9]) == [1, 8, 9]


def test_most_recent_occurrence_wins():
    proposer = NgramProposer(2, 2, 2)
    history = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 30, 31, 1, 2]
    assert propose_one(proposer, history) == [30, 31]


def test_longest_n_is_preferred_over_a_more_recent_shorter_match():
    proposer = NgramProposer(2, 1, 3)
    # The trigram (4, 5, 6) occurs once, early; the unigram 6 occurs more recently.
    history = [4, 5, 6, 100, 101, 0, 6, 200, 201, 4, 5, 6]
    assert propose_one(proposer, history) == [100, 101]
    # With max 1 only the unigram is searched, and its most recent occurrence wins.
    assert propose_one(NgramProposer(2, 1, 1), history) == [200, 201]
    # The bigram (5, 6) is longer than the unigram but shorter than max: still preferred.
    assert propose_one(proposer, [5, 6, 100, 6, 200, 9, 5, 6]) == [100, 6]


@pytest.mark.parametrize("args, field", [
    ((0, 1, 3), "num_speculative_tokens"),
    ((-1, 1, 3), "num_speculative_tokens"),
    ((3, 0, 3), "prompt_lookup_min"),
    ((3, 4, 3), "prompt_lookup_max"),
])
def test_invalid_arguments(args, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)


def test_invalid_propose_arguments():
    proposer = NgramProposer(3, 1, 3)
    with pytest.raises(ValueError, match="same length"):
        proposer.propose([np.arange(4)], [1, 2])
    with pytest.raises(ValueError, match="max_drafts"):
        proposer.propose([np.arange(4)], [-1])
    with pytest.raises(ValueError, match="1-D"):
        proposer.propose([np.zeros((2, 3), dtype=np.int64)], [3])
