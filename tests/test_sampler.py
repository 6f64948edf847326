"""Sampling: the logit processors, the Sampler and SamplingParams against independent references.

The references below are deliberately naive (Python loops over rows and tokens, float64) so they
share no code or vectorisation trick with the batched torch implementation they check.
"""

from __future__ import annotations

import math

import pytest
import torch

from baryon.kernels import sampling_cpu
from baryon.kernels.sampling import apply_min_p, apply_penalties, apply_top_k_top_p
from baryon.kernels.sampling_cpu import apply_top_k_top_p_candidates
from baryon.layers.sampler import Sampler
from baryon.request import Request
from baryon.runner.sampling_inputs import build_sampling_batch
from baryon.sampling_params import SamplingParams

CPU = torch.device("cpu")

# chi-square critical values at significance 1e-6 (so a correct sampler fails ~never), by degrees
# of freedom; computed with scipy.stats.chi2.ppf(1 - 1e-6, df).
CHI2_CRIT = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52, 8: 42.70,
             9: 44.81, 10: 46.86, 11: 48.87}


# -- helpers ---------------------------------------------------------------------------------------

def make_request(params: SamplingParams, prompt=(0,), output=(), eos=(), generator=None, rid="r") -> Request:
    max_tokens = params.max_tokens if params.max_tokens is not None else 1000
    request = Request(rid, list(prompt), params, frozenset(eos), max_tokens=max_tokens)
    for token in output:
        request.append_output_token(int(token))
    request.generator = generator
    return request


def distinct_logits(gen: torch.Generator, rows: int, vocab: int, scale: float = 2.0,
                    min_gap: float = 1e-3) -> torch.Tensor:
    """Random float32 logits whose values within a row differ by more than min_gap (no near-ties)."""
    values = (torch.randn(rows, vocab, generator=gen) * scale).sort(dim=-1).values
    values = values + torch.arange(vocab) * (2 * min_gap)  # spread the sorted values apart
    order = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])
    logits = values.gather(1, order)
    assert vocab < 2 or logits.sort(dim=-1).values.diff(dim=-1).min() > min_gap
    return logits


def ref_softmax(row: list[float], tokens) -> dict[int, float]:
    """float64 softmax of row restricted to tokens."""
    top = max(row[i] for i in tokens)
    weights = {i: math.exp(row[i] - top) for i in tokens}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


def ref_top_k(row: list[float], k: int) -> set[int]:
    """The k largest logits (k <= 0 or >= vocab: all). Ties with the k-th are kept."""
    if k <= 0 or k >= len(row):
        return set(range(len(row)))
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, value in enumerate(row) if value >= kth}


def ref_top_p(row: list[float], candidates: set[int], p: float) -> tuple[set[int], float]:
    """Smallest prefix of the candidates (by decreasing probability, renormalised over the
    candidates) whose mass reaches p; always at least the top token. Also returns how close any
    prefix mass comes to p (to avoid boundaries that float32 rounding may decide either way)."""
    probs = ref_softmax(row, candidates)
    order = sorted(candidates, key=lambda i: -row[i])
    keep: set[int] = set()
    mass, margin = 0.0, float("inf")
    done = False
    for i in order:
        if not done:
            keep.add(i)
        mass += probs[i]
        margin = min(margin, abs(mass - p))
        if mass >= p:
            done = True
    return keep, margin


def ref_min_p(probs: list[float], min_p: float) -> tuple[set[int], float]:
    threshold = max(probs) * min_p
    keep = {i for i, q in enumerate(probs) if q >= threshold}
    margin = min((abs(q - threshold) for q in probs), default=float("inf"))
    return keep, margin


def ref_penalties(row: list[float], prompt: list[int], output: list[int], presence: float,
                  frequency: float, repetition: float) -> list[float]:
    """OpenAI / vLLM semantics, one token at a time."""
    result = []
    for token, logit in enumerate(row):
        count = output.count(token)
        if token in prompt or count > 0:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= count * frequency
        if count > 0:
            logit -= presence
        result.append(logit)
    return result


def finite_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def sampling_distribution(row: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
                          min_p: float = 0.0) -> dict[int, float]:
    """Reference distribution of one random row: temperature, then top-k, then top-p over the
    top-k survivors, then min-p relative to the top probability; renormalised."""
    scaled = [x / temperature for x in row]
    allowed = ref_top_k(scaled, top_k)
    if top_p < 1.0:
        allowed, _ = ref_top_p(scaled, allowed, top_p)
    if min_p > 0:
        probs = ref_softmax(scaled, allowed)
        threshold = max(probs.values()) * min_p
        allowed = {i for i in allowed if probs[i] >= threshold}
    return ref_softmax(scaled, allowed)


# -- top-k / top-p / min-p kernels ----------------------------------------------------------------

@pytest.fixture(params=["sort", "candidates"])
def top_k_top_p(request):
    """The sorting reference and the CPU kernel that decides on each row's top logits."""
    return apply_top_k_top_p if request.param == "sort" else apply_top_k_top_p_candidates


def test_candidates_equal_the_sort_on_large_vocabularies(seed, monkeypatch):
    """Rows whose kept set lies in the candidates and rows that fall back (k above the candidate
    count, flat distributions whose candidates hold less than top_p): the same tokens as sorting."""
    monkeypatch.setattr(sampling_cpu, "CANDIDATES", 64)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(12):
        rows, vocab = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(100, 3000, (1,), generator=gen))
        scale = float(torch.empty(1).uniform_(0.2, 8, generator=gen))  # flat to peaked
        logits = distinct_logits(gen, rows, vocab, scale=scale)
        ks = torch.randint(0, 100, (rows,), generator=gen) * (torch.rand(rows, generator=gen) < 0.5)  # 0: no top-k
        # Below 0.999: past it, a nucleus edge lies among tail tokens whose cumulative mass differs
        # from top_p by less than float32's rounding of the two sums (seen: top_p 0.9999614, the
        # full-vocabulary cumsum 0.9999609 / 0.9999623 around it), where either answer is right.
        ps = torch.empty(rows).uniform_(0.05, 0.999, generator=gen)
        ps[torch.rand(rows, generator=gen) < 0.3] = 1.0
        for top_k, top_p in ((ks, None), (None, ps), (ks, ps)):
            expected = apply_top_k_top_p(logits.clone(), top_k, top_p)
            got = apply_top_k_top_p_candidates(logits.clone(), top_k, top_p)
            assert torch.equal(torch.isfinite(got), torch.isfinite(expected)), (scale, top_k, top_p)
            assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])


def test_cpu_sampling_is_chosen_on_cpu():
    from baryon.kernels import selector

    assert selector.select("sampling", torch.device("cpu")).name == "cpu"


def test_top_k_keeps_exactly_the_k_largest(seed, top_k_top_p):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        vocab = int(torch.randint(2, 80, (1,), generator=gen))
        logits = distinct_logits(gen, rows, vocab, scale=3.0)
        ks = torch.randint(0, vocab + 4, (rows,), generator=gen)  # 0 = all, > vocab = all
        out = top_k_top_p(logits.clone(), ks, None)
        for r in range(rows):
            k = int(ks[r])
            expected = ref_top_k(logits[r].tolist(), k)
            assert finite_set(out[r]) == expected, f"row {r} k={k} vocab={vocab}"
            assert len(expected) == (vocab if k == 0 or k >= vocab else k)
            kept = sorted(expected)
            # Survivors keep their logits untouched; the rest are -inf.
            assert torch.equal(out[r, kept], logits[r, kept])
            assert torch.all(out[r][~torch.isfinite(out[r])] == float("-inf"))


def test_top_k_keeps_ties_with_the_kth_logit(top_k_top_p):
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    out = top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert finite_set(out[0]) == {0, 2, 3}


def _draw_top_p(gen: torch.Generator, row: list[float], candidates: set[int]) -> tuple[float, set[int]]:
    """A top_p away from any prefix-mass boundary, with the reference's kept set."""
    while True:
        p = float(torch.empty(1).uniform_(0.02, 0.995, generator=gen))
        keep, margin = ref_top_p(row, candidates, p)
        if margin > 1e-4:
            return p, keep


def test_top_p_keeps_smallest_prefix_reaching_p(seed, top_k_top_p):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        rows = int(torch.randint(1, 10, (1,), generator=gen))
        vocab = int(torch.randint(2, 60, (1,), generator=gen))
        logits = distinct_logits(gen, rows, vocab, scale=float(torch.empty(1).uniform_(0.3, 4, generator=gen)))
        ps, expected = [], []
        for r in range(rows):
            p, keep = _draw_top_p(gen, logits[r].tolist(), set(range(vocab)))
            ps.append(p)
            expected.append(keep)
        out = top_k_top_p(logits.clone(), None, torch.tensor(ps))
        for r in range(rows):
            assert finite_set(out[r]) == expected[r], f"row {r} p={ps[r]}"
            top = int(logits[r].argmax())
            assert top in finite_set(out[r])


def test_top_p_tiny_keeps_only_the_top_token(seed, top_k_top_p):
    gen = torch.Generator().manual_seed(seed)
    logits = distinct_logits(gen, 6, 50, scale=0.5)  # flat: the top token alone already exceeds p
    out = top_k_top_p(logits.clone(), None, torch.full((6,), 1e-6))
    for r in range(6):
        assert finite_set(out[r]) == {int(logits[r].argmax())}


def test_top_p_exact_mass_boundary(top_k_top_p):
    # Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 are exact in float32: a prefix reaching exactly p suffices.
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 1.0]]) * math.log(2)
    for p, kept in [(0.5, {0}), (0.50001, {0, 1}), (0.75, {0, 1}), (0.8, {0, 1, 2}), (0.875, {0, 1, 2}),
                    (1.0, {0, 1, 2, 3, 4})]:
        out = top_k_top_p(logits.clone(), None, torch.tensor([p]))
        assert finite_set(out[0]) == kept, p


def test_top_k_then_top_p_combined(seed, top_k_top_p):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        rows = int(torch.randint(1, 10, (1,), generator=gen))
        vocab = int(torch.randint(3, 60, (1,), generator=gen))
        logits = distinct_logits(gen, rows, vocab, scale=2.0)
        ks, ps, expected = [], [], []
        for r in range(rows):
            row = logits[r].tolist()
            k = int(torch.randint(0, vocab + 1, (1,), generator=gen))
            after_k = ref_top_k(row, k)
            if torch.rand(1, generator=gen) < 0.25:
                p, keep = 1.0, after_k  # this row truncates by top-k only
            else:
                # top-p is computed on the distribution renormalised over the top-k survivors.
                p, keep = _draw_top_p(gen, row, after_k)
            ks.append(k)
            ps.append(p)
            expected.append(keep)
        out = top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
        for r in range(rows):
            assert finite_set(out[r]) == expected[r], f"row {r} k={ks[r]} p={ps[r]}"


def test_top_p_one_keeps_every_token_in_a_mixed_batch(seed, top_k_top_p):
    gen = torch.Generator().manual_seed(seed)
    # One dominant token: its float32 probability rounds to 1.0, the others are tiny but non-zero.
    logits = torch.randn(2, 100, generator=gen) - 30
    logits[:, int(torch.randint(0, 100, (1,), generator=gen))] = 0.0
    assert (logits.softmax(dim=-1) > 0).all()
    out = top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all(), f"{int((~torch.isfinite(out[0])).sum())} tokens dropped at top_p=1"


def test_min_p_threshold_relative_to_max_prob(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        rows = int(torch.randint(1, 10, (1,), generator=gen))
        vocab = int(torch.randint(2, 60, (1,), generator=gen))
        probs = distinct_logits(gen, rows, vocab, scale=2.0).softmax(dim=-1)
        min_ps, expected = [], []
        for r in range(rows):
            row = probs[r].tolist()
            while True:
                m = 0.0 if torch.rand(1, generator=gen) < 0.2 else float(torch.rand(1, generator=gen))
                keep, margin = ref_min_p(row, m)
                if m == 0.0 or margin > 1e-6:
                    break
            min_ps.append(m)
            expected.append(keep)
        out = apply_min_p(probs.clone(), torch.tensor(min_ps))
        for r in range(rows):
            kept = set(torch.nonzero(out[r] > 0).flatten().tolist())
            assert kept == expected[r], f"row {r} min_p={min_ps[r]}"
            assert int(probs[r].argmax()) in kept
            idx = sorted(kept)
            assert torch.equal(out[r, idx], probs[r, idx])


def test_min_p_one_keeps_only_the_top_token(seed):
    gen = torch.Generator().manual_seed(seed)
    probs = distinct_logits(gen, 4, 30).softmax(dim=-1)
    out = apply_min_p(probs.clone(), torch.ones(4))
    for r in range(4):
        assert set(torch.nonzero(out[r] > 0).flatten().tolist()) == {int(probs[r].argmax())}


# -- penalties ------------------------------------------------------------------------------------

def test_penalties_hand_example():
    # token 0: in prompt only, positive; 1: in prompt only, negative; 2: generated 3 times;
    # 3: generated once, negative; 4: unseen.
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=2.0)
    req = make_request(params, prompt=[0, 1, 0], output=[2, 3, 2, 2])
    p = build_sampling_batch([req], 5, CPU).penalties
    out = apply_penalties(logits.clone(), p.prompt_mask, p.output_counts, p.presence, p.frequency, p.repetition)
    expected = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 3 * 0.5 - 0.7, -1.0 * 2 - 0.5 - 0.7, 0.5]
    torch.testing.assert_close(out[0], torch.tensor(expected), rtol=0, atol=1e-6)


def test_penalties_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 40
    for _ in range(5):
        rows = int(torch.randint(1, 9, (1,), generator=gen))
        requests, specs = [], []
        for r in range(rows):
            prompt = torch.randint(0, vocab, (int(torch.randint(1, 15, (1,), generator=gen)),), generator=gen).tolist()
            # Few distinct ids so tokens repeat (frequency counts > 1).
            output = torch.randint(0, vocab // 3, (int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen).tolist()
            if torch.rand(1, generator=gen) < 0.3:
                pres, freq, rep = 0.0, 0.0, 1.0  # a row without penalties in a penalised batch
            else:
                pres, freq = (torch.rand(2, generator=gen) * 4 - 2).tolist()
                rep = float(torch.empty(1).uniform_(0.3, 3.0, generator=gen))
            params = SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)
            requests.append(make_request(params, prompt=prompt, output=output, rid=f"r{r}"))
            specs.append((prompt, output, params.presence_penalty, params.frequency_penalty,
                          params.repetition_penalty))
        if all(s[2:] == (0.0, 0.0, 1.0) for s in specs):
            continue
        logits = torch.randn(rows, vocab, generator=gen) * 3
        p = build_sampling_batch(requests, vocab, CPU).penalties
        assert p is not None
        out = apply_penalties(logits.clone(), p.prompt_mask, p.output_counts, p.presence, p.frequency,
                              p.repetition)
        for r, spec in enumerate(specs):
            expected = torch.tensor(ref_penalties(logits[r].tolist(), *spec), dtype=torch.float32)
            torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)
            if spec[2:] == (0.0, 0.0, 1.0):
                assert torch.equal(out[r], logits[r])


def test_no_penalties_means_no_penalty_inputs():
    reqs = [make_request(SamplingParams(temperature=0.5), output=[1, 1]), make_request(SamplingParams(temperature=0))]
    assert build_sampling_batch(reqs, 10, CPU).penalties is None


def test_greedy_with_penalties_picks_argmax_of_penalised_logits(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 30
    sampler = Sampler(CPU, seed)
    for _ in range(10):
        logits = torch.randn(1, vocab, generator=gen) * 2
        top = logits[0].topk(3).indices.tolist()
        # Penalise the current favourites so the choice really moves.
        params = SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.8)
        req = make_request(params, prompt=[top[0]], output=[top[1], top[1], top[2]])
        expected_row = ref_penalties(logits[0].tolist(), [top[0]], [top[1], top[1], top[2]], 1.5, 1.0, 1.8)
        ordered = sorted(expected_row, reverse=True)
        if ordered[0] - ordered[1] < 1e-4:
            continue
        out = sampler(logits.clone(), build_sampling_batch([req], vocab, CPU))
        assert int(out.sampled[0]) == max(range(vocab), key=lambda i: expected_row[i])


# -- the Sampler ----------------------------------------------------------------------------------

def test_greedy_rows_are_argmax_in_a_mixed_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 50
    configs = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5),  # truncation ignored when greedy
        SamplingParams(temperature=2.0, top_k=10, top_p=0.9),
        SamplingParams(temperature=1e-6),  # below the greedy threshold
        SamplingParams(temperature=1.0, min_p=0.05, seed=3),
        SamplingParams(temperature=0, seed=7),
        SamplingParams(temperature=3.0),
    ]
    greedy_rows = [i for i, p in enumerate(configs) if p.is_greedy]
    assert greedy_rows == [0, 2, 4, 6]
    random_seen: dict[int, set[int]] = {i: set() for i in range(len(configs)) if i not in greedy_rows}
    for step in range(20):
        sampler = Sampler(CPU, seed + step)
        # Random rows get flat logits (so they visibly vary); greedy rows get decisive ones.
        logits = distinct_logits(gen, len(configs), vocab, scale=1.0, min_gap=1e-4)
        for i in random_seen:
            logits[i] *= 0.05
        reqs = [make_request(p, rid=f"r{i}", generator=torch.Generator().manual_seed(seed + 31 * step + i)
                             if p.seed is not None else None) for i, p in enumerate(configs)]
        batch = build_sampling_batch(reqs, vocab, CPU)
        assert not batch.all_greedy
        out = sampler(logits.clone(), batch)
        for i in greedy_rows:
            assert int(out.sampled[i]) == int(logits[i].argmax()), f"greedy row {i}"
        for i in random_seen:
            random_seen[i].add(int(out.sampled[i]))
    for i, seen in random_seen.items():
        assert len(seen) > 3, f"random row {i} looks greedy: {seen}"


def test_all_greedy_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = distinct_logits(gen, 7, 33, min_gap=1e-4)
    reqs = [make_request(SamplingParams(temperature=0), rid=str(i)) for i in range(7)]
    batch = build_sampling_batch(reqs, 33, CPU)
    assert batch.all_greedy
    out = Sampler(CPU, seed)(logits.clone(), batch)
    assert torch.equal(out.sampled, logits.argmax(dim=-1))


def _run_seeded(target: SamplingParams, target_seed: int, target_logits: torch.Tensor, position: int,
                others: list[SamplingParams], sampler_seed: int, noise_seed: int) -> list[int]:
    """Sample len(target_logits) steps of one seeded request placed at `position` among `others`
    (whose logits and generators are random)."""
    vocab = target_logits.shape[1]
    gen = torch.Generator().manual_seed(noise_seed)
    sampler = Sampler(CPU, sampler_seed)
    target_req = make_request(target, prompt=[1, 2, 3], generator=torch.Generator().manual_seed(target_seed), rid="t")
    other_reqs = []
    for i, p in enumerate(others):
        g = torch.Generator().manual_seed(noise_seed + 1000 + i) if p.seed is not None else None
        other_reqs.append(make_request(p, prompt=[i % vocab], output=[(i + 1) % vocab], eos=[0], generator=g,
                                       rid=f"o{i}"))
    tokens = []
    for step in range(target_logits.shape[0]):
        reqs = other_reqs[:position] + [target_req] + other_reqs[position:]
        logits = torch.randn(len(reqs), vocab, generator=gen) * 2
        logits[position] = target_logits[step]
        out = sampler(logits, build_sampling_batch(reqs, vocab, CPU))
        token = int(out.sampled[position])
        tokens.append(token)
        target_req.append_output_token(token)
        for r in other_reqs:
            r.append_output_token(int(torch.randint(0, vocab, (1,), generator=gen)))
    return tokens


def test_seeded_request_is_independent_of_the_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, steps = 64, 12
    target = SamplingParams(temperature=0.9, top_k=40, top_p=0.97, seed=seed)
    target_logits = torch.randn(steps, vocab, generator=gen)
    alone = _run_seeded(target, seed, target_logits, 0, [], seed + 1, seed + 2)
    assert len(set(alone)) > 1
    batches = [
        (0, [SamplingParams(temperature=0)] * 3),
        (2, [SamplingParams(temperature=1.3), SamplingParams(temperature=0.5, seed=11),
             SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.7, top_k=2)]),
        (1, [SamplingParams(temperature=1.0, seed=5, top_p=0.5), SamplingParams(temperature=1.0, min_tokens=4),
             SamplingParams(temperature=0)]),
        (5, [SamplingParams(temperature=2.0, presence_penalty=1.0)] * 3
         + [SamplingParams(temperature=1.0, frequency_penalty=-1.0, repetition_penalty=1.3, seed=9)] * 2
         + [SamplingParams(temperature=0.0)] * 2),
    ]
    for n, (position, others) in enumerate(batches):
        got = _run_seeded(target, seed, target_logits, position, others, seed + 10 + n, seed + 20 + n)
        assert got == alone, f"batch {n} (row {position}) changed the seeded request's tokens"


def test_different_seeds_give_different_streams(seed):
    vocab, steps = 64, 20
    logits = torch.zeros(steps, vocab)  # uniform: two streams agree by chance with prob 64**-20
    params = SamplingParams(temperature=1.0, seed=0)
    a = _run_seeded(params, seed, logits, 0, [], 0, 0)
    b = _run_seeded(params, seed + 1, logits, 0, [], 0, 0)
    c = _run_seeded(params, seed, logits, 0, [], 1, 1)
    assert a != b
    assert a == c


def _assert_frequencies(samples: torch.Tensor, dist: dict[int, float], vocab: int, label: str) -> None:
    counts = torch.bincount(samples, minlength=vocab).tolist()
    outside = [t for t in range(vocab) if t not in dist and counts[t]]
    assert not outside, f"{label}: sampled tokens outside the allowed set: {outside}"
    support = sorted(dist)
    if len(support) == 1:
        assert counts[support[0]] == len(samples)
        return
    stat = chi_square([counts[t] for t in support], [dist[t] for t in support])
    assert stat < CHI2_CRIT[len(support) - 1], (
        f"{label}: chi2={stat:.1f} (df={len(support) - 1}); counts={[counts[t] for t in support]}, "
        f"expected={[round(dist[t] * len(samples)) for t in support]}")


def test_sampling_frequencies_match_the_distribution(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, draws = 8, 20000
    logits = torch.empty(vocab).uniform_(-1.5, 1.5, generator=gen)
    temperature = float(torch.empty(1).uniform_(0.6, 1.5, generator=gen))
    row = logits.tolist()
    # Row groups: plain temperature; top-k + min-p; top-p (away from mass boundaries).
    scaled = [x / temperature for x in row]
    top_p, _ = _draw_top_p(gen, scaled, set(range(vocab)))
    top_p_after_k, _ = _draw_top_p(gen, scaled, ref_top_k(scaled, 4))
    groups = [
        dict(),
        dict(top_k=5, min_p=float(torch.empty(1).uniform_(0.2, 0.6, generator=gen))),
        dict(top_p=top_p),
        dict(top_k=4, top_p=top_p_after_k),
    ]
    reqs, dists = [], []
    for g in groups:
        params = SamplingParams(temperature=temperature, **g)
        dists.append(sampling_distribution(row, temperature, params.top_k, params.top_p, params.min_p))
        reqs += [make_request(params, rid=str(i)) for i in range(draws)]
    batch = build_sampling_batch(reqs, vocab, CPU)
    out = Sampler(CPU, seed)(logits.expand(len(reqs), vocab).contiguous(), batch)
    for i, (g, dist) in enumerate(zip(groups, dists)):
        _assert_frequencies(out.sampled[i * draws:(i + 1) * draws], dist, vocab, f"group {g} T={temperature:.3f}")


def test_seeded_rows_sample_the_right_distribution(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, draws = 6, 6000
    logits = torch.empty(vocab).uniform_(-1.2, 1.2, generator=gen)
    temperature = 0.8
    params = SamplingParams(temperature=temperature, seed=0)
    reqs = [make_request(params, rid=str(i), generator=torch.Generator().manual_seed(seed * 7919 + i))
            for i in range(draws)]
    out = Sampler(CPU, seed)(logits.expand(draws, vocab).contiguous(), build_sampling_batch(reqs, vocab, CPU))
    _assert_frequencies(out.sampled, sampling_distribution(logits.tolist(), temperature), vocab, "seeded rows")


def test_banned_tokens_never_sampled_before_min_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, eos, stop_id, copies = 20, 5, 7, 300
    logits = torch.randn(vocab, generator=gen)
    logits[eos] = logits[stop_id] = 8.0  # overwhelmingly likely when allowed
    kinds = [
        # (params, output so far, banned set)
        (SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop_id, 500]), [1, 2], {eos, stop_id}),
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id]), [], {eos, stop_id}),
        (SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True), [], {stop_id}),
        (SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop_id]), [1, 2], set()),  # reached
        (SamplingParams(temperature=1.0), [], set()),
    ]
    reqs = []
    for k, (params, output, _) in enumerate(kinds):
        reqs += [make_request(params, output=output, eos=[eos], rid=f"{k}-{i}") for i in range(copies)]
    batch = build_sampling_batch(reqs, vocab, CPU)
    assert batch.banned is not None
    out = Sampler(CPU, seed)(logits.expand(len(reqs), vocab).contiguous(), batch)
    for k, (params, _, banned) in enumerate(kinds):
        sampled = set(out.sampled[k * copies:(k + 1) * copies].tolist())
        assert not (sampled & banned), f"kind {k}: banned {sampled & banned} were sampled"
        allowed_favourites = {eos, stop_id} - banned
        if allowed_favourites:
            # When allowed they dominate, so banning really is what kept them out above.
            assert sampled & allowed_favourites, f"kind {k}"
    # The greedy row picks the best non-banned token.
    masked = logits.clone()
    masked[[eos, stop_id]] = float("-inf")
    assert set(out.sampled[copies:2 * copies].tolist()) == {int(masked.argmax())}


def test_no_banned_matrix_without_min_tokens():
    reqs = [make_request(SamplingParams(stop_token_ids=[3]), eos=[2]),
            make_request(SamplingParams(min_tokens=1), output=[4], eos=[2])]
    assert build_sampling_batch(reqs, 10, CPU).banned is None


def test_logprobs_are_raw_log_softmax(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 50
    configs = [
        SamplingParams(temperature=0.7, logprobs=3),
        SamplingParams(temperature=0, logprobs=5, presence_penalty=2.0, repetition_penalty=2.0),
        SamplingParams(temperature=1.5, logprobs=0, top_k=5),
        SamplingParams(temperature=1.0),  # asks none, still gets a row
        SamplingParams(temperature=1.2, logprobs=1, frequency_penalty=1.5, min_tokens=5),
    ]
    sampler = Sampler(CPU, seed)
    for step in range(5):
        logits = distinct_logits(gen, len(configs), vocab, scale=2.0, min_gap=1e-3)
        reqs = []
        for i, p in enumerate(configs):
            top = logits[i].topk(2).indices.tolist()
            # Outputs that include the current favourites so penalties move the choice away.
            reqs.append(make_request(p, prompt=[top[0]], output=[top[0], top[1]], eos=[top[1]], rid=str(i)))
        batch = build_sampling_batch(reqs, vocab, CPU)
        assert batch.num_logprobs == 5
        out = sampler(logits.clone(), batch)
        assert out.logprob_token_ids.shape == (len(configs), 6) and out.logprobs.shape == (len(configs), 6)
        raw = logits.double().log_softmax(dim=-1)
        for i in range(len(configs)):
            sampled = int(out.sampled[i])
            ids = out.logprob_token_ids[i].tolist()
            values = out.logprobs[i].double()
            assert ids[0] == sampled
            torch.testing.assert_close(values, raw[i, ids], rtol=0, atol=1e-5)
            ranked = sorted(range(vocab), key=lambda t: -raw[i, t].item())
            assert ids[1:] == ranked[:5], f"row {i}: top ids not the raw top-5 in order"
            assert all(values[j] >= values[j + 1] for j in range(1, 5))
            rank = 1 + sum(1 for t in range(vocab) if logits[i, t] > logits[i, sampled])
            assert int(out.sampled_rank[i]) == rank
        # The penalised greedy row is pushed off the raw favourite: its rank is > 1.
        assert int(out.sampled_rank[1]) > 1


def test_no_logprobs_when_nobody_asks(seed):
    reqs = [make_request(SamplingParams(), rid="a"), make_request(SamplingParams(temperature=0), rid="b")]
    batch = build_sampling_batch(reqs, 10, CPU)
    assert batch.num_logprobs is None
    out = Sampler(CPU, seed)(torch.randn(2, 10, generator=torch.Generator().manual_seed(seed)), batch)
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_rank is None


# -- SamplingParams ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(seed=1.5), "seed"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=1e-46), "repetition_penalty"),  # 0 in float32
    (dict(temperature=1e39), "temperature"),  # inf in float32
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=["ok", "\udfff"]), "stop"),  # not Unicode: no tokenizer or UTF-8 encoder takes it
    (dict(stop=123), "stop"),  # not a string or a list: a ValueError too, not a TypeError
    (dict(stop=[f"s{i}" for i in range(1025)]), "stop"),  # past MAX_STOP_STRINGS
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(structured_outputs={"bogus": 1}), "structured_outputs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-3), "prompt_logprobs"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_valid_edge_values_are_accepted():
    SamplingParams(n=3, temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, repetition_penalty=0.01, max_tokens=None, min_tokens=10,
                   stop=["a", "bc"], stop_token_ids=[0, 5], logprobs=0, prompt_logprobs=0, ignore_eos=True)
    SamplingParams(max_tokens=4, min_tokens=4)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["x", "yz"]).stop_strings == ["x", "yz"]
    assert SamplingParams().stop_strings == [] and SamplingParams().stop_token_ids == []


def test_greedy_normalisation():
    p = SamplingParams(temperature=0.0, top_p=0.3, top_k=7, min_p=0.4)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    p = SamplingParams(temperature=1e-6, top_k=7)
    assert p.is_greedy and p.top_k == 0
    p = SamplingParams(temperature=0.5, top_p=0.3, top_k=7, min_p=0.4)
    assert not p.is_greedy and (p.top_p, p.top_k, p.min_p) == (0.3, 7, 0.4)
    assert SamplingParams(top_k=-1).top_k == 0


def test_for_sample_seeds(seed):
    p = SamplingParams(n=4, seed=seed, temperature=0.8, top_k=3, stop=["x"], logprobs=2)
    for i in range(4):
        s = p.for_sample(i)
        assert s.n == 1 and s.seed == seed + i
        assert (s.temperature, s.top_k, s.stop_strings, s.logprobs) == (0.8, 3, ["x"], 2)
    assert p.n == 4 and p.seed == seed  # the original is untouched
    unseeded = SamplingParams(n=2).for_sample(1)
    assert unseeded.seed is None and unseeded.n == 1


def assert_draws_follow_the_softmax(sample_rows, seed: int, rows: int, device=CPU) -> None:
    """`rows` rows of one distribution, each with its own seed: the tokens' frequencies match
    softmax(logits / temperature) within five standard deviations; a -inf token is never drawn."""
    gen = torch.Generator().manual_seed(seed)
    vocab, temperature = 6, 0.7
    base = torch.randn(vocab, generator=gen)
    base[2] = float("-inf")
    logits = base.expand(rows, vocab).contiguous().to(device)
    seeds = torch.randint(0, 1 << 62, (rows,), generator=gen).to(device)
    drawn = sample_rows(logits, torch.full((rows,), temperature, device=device),
                        torch.zeros(rows, dtype=torch.bool, device=device), seeds)
    counts = torch.bincount(drawn.cpu(), minlength=vocab).double()
    p = torch.softmax(base.double() / temperature, dim=0)
    sigma = (rows * p * (1 - p)).sqrt()
    assert counts[2] == 0
    assert ((counts - rows * p).abs() <= 5 * sigma + 1e-9).all(), (counts.tolist(), (rows * p).tolist())


def assert_draws_follow_their_seeds(sample_rows, seed: int, rows: int, vocab: int, device=CPU):
    """Greedy rows give their argmax (first of a tie); a row with one finite logit gives it, one
    with none token 0; a row's token depends on its seed and logits only (not on the other rows,
    its place or its batch), and other seeds draw other tokens. Returns the inputs and the draw."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.empty(rows).uniform_(0.3, 2.0, generator=gen)
    greedy = torch.rand(rows, generator=gen) < 0.3
    temperature[greedy] = 1.0
    greedy[0] = True
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1
    logits[1] = float("-inf")
    logits[1, vocab // 2] = 0.0
    logits[2] = float("-inf")
    seeds = torch.randint(0, 1 << 62, (rows,), generator=gen)
    logits, temperature, greedy, seeds = (t.to(device) for t in (logits, temperature, greedy, seeds))
    drawn = sample_rows(logits, temperature, greedy, seeds)
    assert drawn[0] == 5 and drawn[1] == vocab // 2 and drawn[2] == 0
    assert torch.equal(drawn[greedy], logits[greedy].argmax(dim=-1))
    order = torch.randperm(rows, generator=gen).to(device)
    assert torch.equal(sample_rows(logits[order], temperature[order], greedy[order], seeds[order]), drawn[order])
    assert sample_rows(logits[3:4], temperature[3:4], greedy[3:4], seeds[3:4]).item() == drawn[3].item()
    sampled = ~greedy
    sampled[:3] = False
    others = [sample_rows(logits, temperature, greedy, seeds + k)[sampled] for k in (1, 2, 3)]
    assert any(not torch.equal(o, drawn[sampled]) for o in others)
    return (logits, temperature, greedy, seeds), drawn


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_sample_rows_follow_the_softmax_and_their_seeds(seed, impl):
    """The draw of each CPU implementation (torch: the exponential race, cpu: inverse CDF): the
    softmax's frequencies, and the seeds' and greedy rows' properties above."""
    from baryon.kernels.sampling import TorchSampling
    from baryon.kernels.sampling_cpu import CpuSampling

    sample_rows = {"torch": TorchSampling, "cpu": CpuSampling}[impl].sample_rows
    assert_draws_follow_the_softmax(sample_rows, seed, rows=4000)
    assert_draws_follow_their_seeds(sample_rows, seed, rows=16, vocab=300)
