"""Rejection sampling for speculative decoding: the accept/reject kernels (torch reference, Triton in
the interpreter or on CUDA) against a plain Python loop, and the RejectionSampler against the
distribution it must preserve, greedy decoding, Sampler (requests without drafts), seeded
reproducibility and logprobs.
"""

from __future__ import annotations

import pytest
import torch

from baryon.kernels import rejection_sampling_triton
from baryon.kernels.rejection_sampling import rejection_sample
from baryon.layers.sampler import PenaltyInputs, Sampler, SamplingBatch
from baryon.spec_decode.rejection_sampler import RejectionSampler

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

# Chi-square critical values at significance 1e-6 (a correct sampler fails ~never), by degrees of
# freedom: scipy.stats.chi2.isf(1e-6, df).
CHI2_CRIT = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52, 8: 42.70, 9: 44.81,
             10: 46.86, 11: 48.87, 12: 50.83, 13: 52.75, 14: 54.64, 15: 56.49}


# -- the kernels -----------------------------------------------------------------------------------

def kernel_case(gen: torch.Generator, batch_size: int, max_spec_len: int, vocab: int = 20,
                with_draft_probs: bool = True) -> dict:
    """Random rejection_sample arguments (on CPU). Probabilities sit on grids (u: k/64, q: m/64,
    p: n/4096) so u * q is exact in float32, and a fifth of the ps equal u * q: the boundary of
    the rule (u * q <= p) is hit often, p = 0 = u * q now and then."""
    counts = torch.randint(0, max_spec_len + 1, (batch_size,), generator=gen)
    counts[torch.rand(batch_size, generator=gen) < 0.2] = 0
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), counts.cumsum(0)))
    num_drafts = int(cu[-1])
    target_argmax = torch.randint(0, vocab, (num_drafts + batch_size,), generator=gen)
    draft_row = torch.arange(num_drafts) + torch.repeat_interleave(torch.arange(batch_size), counts)
    agrees = torch.rand(num_drafts, generator=gen) < 0.8  # greedy requests accept a prefix of some length
    drafts = torch.where(agrees, target_argmax[draft_row], torch.randint(0, vocab, (num_drafts,), generator=gen))
    uniforms = torch.randint(0, 64, (num_drafts,), generator=gen).float() / 64
    q = torch.randint(0, 65, (num_drafts,), generator=gen).float() / 64 if with_draft_probs else None
    p = torch.randint(0, 4097, (num_drafts,), generator=gen).float() / 4096
    p = torch.where(torch.rand(num_drafts, generator=gen) < 0.2, uniforms * (1.0 if q is None else q), p)
    return dict(draft_token_ids=drafts, cu_num_drafts=cu.to(torch.int32), target_argmax=target_argmax,
                target_prob_of_draft=p, draft_prob_of_draft=q, uniforms=uniforms,
                recovered_token_ids=torch.randint(0, vocab, (num_drafts,), generator=gen),
                bonus_token_ids=torch.randint(0, vocab, (batch_size,), generator=gen),
                greedy=torch.rand(batch_size, generator=gen) < 0.4, max_spec_len=max_spec_len)


def loop_rejection_sample(case: dict) -> tuple[list[list[int]], list[int]]:
    """The rule, one draft at a time."""
    drafts, cu = case["draft_token_ids"].tolist(), case["cu_num_drafts"].tolist()
    argmax, p, u = case["target_argmax"].tolist(), case["target_prob_of_draft"].tolist(), case["uniforms"].tolist()
    q = case["draft_prob_of_draft"].tolist() if case["draft_prob_of_draft"] is not None else [1.0] * len(drafts)
    outputs = []
    for i, greedy in enumerate(case["greedy"].tolist()):
        tokens = []
        for j in range(cu[i], cu[i + 1]):
            row = j + i
            accepted = drafts[j] == argmax[row] if greedy else (u[j] * q[j] <= p[j] and p[j] > 0)
            if not accepted:
                tokens.append(argmax[row] if greedy else case["recovered_token_ids"][j].item())
                break
            tokens.append(drafts[j])
        else:
            tokens.append(argmax[cu[i + 1] + i] if greedy else case["bonus_token_ids"][i].item())
        outputs.append(tokens)
    return outputs, [len(t) for t in outputs]


def assert_output(output: torch.Tensor, num_output: torch.Tensor, expected: list[list[int]], width: int) -> None:
    assert output.dtype == torch.int64 and num_output.dtype == torch.int32
    assert num_output.tolist() == [len(t) for t in expected]
    assert output.tolist() == [t + [-1] * (width - len(t)) for t in expected]


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_torch_kernel_matches_a_python_loop(seed, with_draft_probs):
    gen = torch.Generator().manual_seed(seed)
    for batch_size, max_spec_len in [(1, 0), (1, 3), (7, 1), (16, 4), (40, 7), (3, 5)]:
        case = kernel_case(gen, batch_size, max_spec_len, with_draft_probs=with_draft_probs)
        expected, _ = loop_rejection_sample(case)
        output, num_output = rejection_sample(**case)
        assert_output(output, num_output, expected, max_spec_len + 1)


def test_torch_kernel_with_no_drafts_at_all():
    case = kernel_case(torch.Generator().manual_seed(0), 5, 0)
    case["max_spec_len"] = 3  # wider than needed: padded with -1
    output, num_output = rejection_sample(**case)
    greedy = case["greedy"]
    expected = torch.where(greedy, case["target_argmax"], case["bonus_token_ids"])
    assert num_output.tolist() == [1] * 5
    assert output[:, 0].tolist() == expected.tolist() and (output[:, 1:] == -1).all()


@pytest.mark.skipif(rejection_sampling_triton.triton is None, reason="triton is not installed")
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_triton_kernel_matches_torch(seed, with_draft_probs):
    """On CUDA when present, else in Triton's interpreter (TRITON_INTERPRET=1, set by conftest)."""
    from baryon.kernels.rejection_sampling_triton import TritonRejectionSampling

    gen = torch.Generator().manual_seed(seed)
    sizes = [(1, 0), (4, 0), (1, 3), (9, 1), (12, 4), (6, 7), (64, 5)] if CUDA else [(1, 0), (4, 0), (1, 3),
                                                                                      (9, 1), (12, 4), (6, 7)]
    for batch_size, max_spec_len in sizes:
        case = kernel_case(gen, batch_size, max_spec_len, with_draft_probs=with_draft_probs)
        expected = rejection_sample(**case)
        on_device = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        output, num_output = TritonRejectionSampling.rejection_sample(**on_device)
        assert torch.equal(output.cpu(), expected[0]), f"B={batch_size} K={max_spec_len}"
        assert torch.equal(num_output.cpu(), expected[1])


def test_selector_keeps_torch_on_cpu_unless_forced(monkeypatch):
    from baryon.kernels import selector
    from baryon.kernels.triton_utils import INTERPRETED

    assert selector.select("rejection_sampling", CPU).name == "torch"
    if rejection_sampling_triton.triton is None or not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    monkeypatch.setenv("BARYON_KERNEL_REJECTION_SAMPLING", "triton")
    assert selector.select("rejection_sampling", CPU).name == "triton"


# -- the RejectionSampler: helpers -----------------------------------------------------------------

def make_batch(num_requests: int, greedy=None, temperature=None, top_k=None, top_p=None, min_p=None,
               generators=None, penalties=None, banned=None, num_logprobs=None) -> SamplingBatch:
    """A SamplingBatch of one entry per request; unset fields are off (sampling at temperature 1)."""
    greedy = torch.zeros(num_requests, dtype=torch.bool) if greedy is None else torch.as_tensor(greedy)
    temperature = torch.ones(num_requests) if temperature is None else torch.as_tensor(temperature).float()
    return SamplingBatch(
        temperature=torch.where(greedy, 1.0, temperature), greedy=greedy, all_greedy=bool(greedy.all()),
        top_k=None if top_k is None else torch.as_tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.as_tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.as_tensor(min_p, dtype=torch.float32),
        generators=generators or {}, penalties=penalties, banned=banned, num_logprobs=num_logprobs)


def cumulative(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0] + counts).cumsum(0).to(torch.int32)


def run(sampler: RejectionSampler, logits: torch.Tensor, drafts: torch.Tensor, counts: list[int],
        draft_probs: torch.Tensor | None, batch: SamplingBatch):
    cu = cumulative(counts)
    return sampler(logits, drafts, cu, cu.tolist(), draft_probs, batch)


def processed_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                           min_p: float = 0.0) -> torch.Tensor:
    """float64 reference of the distribution a sampling row draws from: [V] -> [V]."""
    x = logits.double() / temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        probs = x.masked_fill(~keep, float("-inf")).softmax(0)[order]
        mass_before = probs.cumsum(0) - probs
        keep[order[mass_before >= top_p]] = False
    probs = x.masked_fill(~keep, float("-inf")).softmax(0)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def boundaries(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The values where top-p or min-p would change the kept set of any row of logits [rows, V]:
    prefix masses of the top-k survivors and probability ratios to the row's top probability."""
    values = []
    for row in logits:
        probs = processed_distribution(row, temperature, top_k).sort(descending=True).values
        values += [probs.cumsum(0), probs / probs[0]]
    return torch.cat(values)


def safe_value(gen: torch.Generator, low: float, high: float, avoid: torch.Tensor) -> float:
    """A uniform draw from [low, high) at least 1e-3 away from every value in `avoid`, where float32
    rounding cannot move a top-p or min-p boundary."""
    while True:
        value = float(torch.empty(1, dtype=torch.float64).uniform_(low, high, generator=gen))
        if (avoid - value).abs().min() > 1e-3:
            return value


def chi_square_check(tokens: torch.Tensor, dist: torch.Tensor, label: str) -> None:
    """tokens: samples; dist: [V] float64 expected distribution. Tokens expected fewer than 5
    times are pooled into one bin (with the least likely other token if still under 5), so the
    chi-square approximation holds."""
    counts = torch.bincount(tokens, minlength=dist.numel()).double()
    support = dist > 0
    assert counts[~support].sum() == 0, f"{label}: tokens outside the support {torch.nonzero(counts * ~support)}"
    expected, observed = tokens.numel() * dist[support], counts[support]
    order = expected.argsort()
    expected, observed = expected[order], observed[order]
    pooled = int((expected < 5).sum())
    if 0 < pooled < expected.numel() and expected[:pooled].sum() < 5:
        pooled += 1
    if pooled > 1:
        expected = torch.cat((expected[:pooled].sum().view(1), expected[pooled:]))
        observed = torch.cat((observed[:pooled].sum().view(1), observed[pooled:]))
    if expected.numel() < 2:
        return
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = expected.numel() - 1
    assert stat < CHI2_CRIT[df], (f"{label}: chi2={stat:.1f} (df={df}, n={tokens.numel()}); "
                                  f"counts={observed.long().tolist()} expected={expected.round().tolist()}")


# -- the RejectionSampler: distribution ------------------------------------------------------------

@pytest.mark.parametrize("num_drafts", [1, 2, 3])
@pytest.mark.parametrize("draft_kind", ["probs", "deterministic"])
def test_emitted_tokens_follow_the_target_distribution(seed, num_drafts, draft_kind):
    """Many identical requests (one vectorised batch): the rows' target distributions p_j and draft
    distributions q_j are fixed, drafts are drawn from q_j. Then the first emitted token follows
    p_0 (the processed target distribution), and the second, given the first was the accepted
    draft 0 (num_output >= 2), follows p_1: draft 1 and the randomness after it are independent of
    draft 0's acceptance. With deterministic drafts (draft_probs None, an n-gram say) the same
    holds whatever distribution picked the drafts."""
    gen = torch.Generator().manual_seed(seed)
    vocab, copies = 12, 12000
    rows = num_drafts + 1
    logits = torch.empty(rows, vocab).uniform_(-1.5, 1.5, generator=gen)  # [rows, V], one request's rows
    temperature = float(torch.empty(1).uniform_(0.6, 1.4, generator=gen))
    settings = [dict(), dict(temperature=temperature, top_k=8,
                             top_p=safe_value(gen, 0.5, 0.95, boundaries(logits, temperature, 8))),
                dict(temperature=temperature, min_p=safe_value(gen, 0.1, 0.6, boundaries(logits, temperature, 0)))]
    sampler = RejectionSampler(CPU, seed)
    for setting in settings:
        targets = [processed_distribution(logits[j], **setting) for j in range(rows)]
        # Draft distributions: near the target, with mass on tokens p drops (top-k, top-p, min-p)
        # and a hole (a token q never drafts), so acceptance, rejection and the residual all matter.
        q = 0.7 * torch.stack(targets).float() + 0.3 * torch.rand(rows, vocab, generator=gen).softmax(-1)
        holes = [t for t in range(vocab) if t not in {int(p.argmax()) for p in targets}]  # every row keeps its top
        q[:, holes[int(torch.randint(0, len(holes), (1,), generator=gen))]] = 0.0
        q = q / q.sum(-1, keepdim=True)
        drafts = torch.multinomial(q[:num_drafts], copies, replacement=True, generator=gen).T.reshape(-1)
        batch = make_batch(copies, temperature=[setting.get("temperature", 1.0)] * copies,
                           top_k=[setting["top_k"]] * copies if "top_k" in setting else None,
                           top_p=[setting["top_p"]] * copies if "top_p" in setting else None,
                           min_p=[setting["min_p"]] * copies if "min_p" in setting else None)
        draft_probs = q[:num_drafts].repeat(copies, 1) if draft_kind == "probs" else None
        out = run(sampler, logits.repeat(copies, 1), drafts, [num_drafts] * copies, draft_probs, batch)
        label = f"{draft_kind} drafts, k={num_drafts}, {setting}"
        chi_square_check(out.output_token_ids[:, 0], targets[0], f"first token, {label}")
        accepted_first = out.num_output >= 2
        assert torch.equal(out.output_token_ids[accepted_first, 0], drafts.view(copies, num_drafts)[accepted_first, 0])
        assert accepted_first.sum() > copies // 50, f"{label}: too few acceptances to test the second token"
        chi_square_check(out.output_token_ids[accepted_first, 1], targets[1], f"second token, {label}")


# -- the RejectionSampler: greedy, no drafts, seeds, logprobs --------------------------------------

def random_drafts(gen: torch.Generator, logits: torch.Tensor, counts: list[int], agree: float = 0.75) -> torch.Tensor:
    """Drafts that equal their row's argmax with probability `agree` (so greedy prefixes of every
    length occur), else a random token: [sum(counts)] int64."""
    rows = torch.cat([torch.arange(n) + start for n, start in zip(counts, cumulative(counts).tolist())]) \
        + torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    argmax = logits[rows].argmax(-1) if len(rows) else torch.empty(0, dtype=torch.int64)
    other = torch.randint(0, logits.shape[1], (len(rows),), generator=gen)
    return torch.where(torch.rand(len(rows), generator=gen) < agree, argmax, other)


def test_greedy_keeps_the_longest_matching_prefix_then_the_target_argmax(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 50
    counts = torch.randint(0, 6, (24,), generator=gen).tolist()
    counts[0] = 0
    greedy = torch.rand(24, generator=gen) < 0.6
    greedy[:2] = True
    logits = torch.randn(sum(counts) + 24, vocab, generator=gen) * 3  # [num_rows, V]
    drafts = random_drafts(gen, logits, counts)
    banned = torch.zeros(24, vocab, dtype=torch.bool)
    banned[0, logits[0].argmax()] = True  # request 0 (no drafts) may not emit its top token
    for all_greedy in (False, True):  # alone, and beside sampling requests
        mask = torch.ones(24, dtype=torch.bool) if all_greedy else greedy
        out = run(RejectionSampler(CPU, seed), logits, drafts, counts, None,
                  make_batch(24, greedy=mask, temperature=[0.8] * 24, top_k=[5] * 24, banned=banned))
        start = 0
        for i, n in enumerate(counts):
            if mask[i]:
                rows = logits[start + i:start + i + n + 1].masked_fill(banned[i], float("-inf"))
                expected = []
                for j in range(n + 1):
                    target = int(rows[j].argmax())
                    expected.append(drafts[start + j].item() if j < n and drafts[start + j] == target else target)
                    if j == n or drafts[start + j] != target:
                        break
                assert out.output_token_ids[i, :len(expected)].tolist() == expected, f"request {i}"
                assert int(out.num_output[i]) == len(expected)
            start += n
        width = out.output_token_ids.shape[1]  # the most drafts in this batch, plus one
        assert (out.output_token_ids[torch.arange(width) >= out.num_output.unsqueeze(1)] == -1).all()


def mixed_batch(gen: torch.Generator, num_requests: int, vocab: int, num_logprobs: int | None,
                generators: dict[int, torch.Generator]) -> SamplingBatch:
    """Every feature on some request: greedy, temperature, top-k, top-p, min-p, penalties, banned."""
    greedy = torch.rand(num_requests, generator=gen) < 0.3
    penalties = PenaltyInputs(
        prompt_mask=torch.rand(num_requests, vocab, generator=gen) < 0.2,
        output_counts=torch.randint(0, 3, (num_requests, vocab), generator=gen).float(),
        presence=torch.rand(num_requests, generator=gen), frequency=torch.rand(num_requests, generator=gen) * 0.5,
        repetition=1 + torch.rand(num_requests, generator=gen))
    return make_batch(
        num_requests, greedy=greedy, temperature=torch.empty(num_requests).uniform_(0.5, 1.5, generator=gen),
        top_k=torch.randint(0, vocab, (num_requests,), generator=gen),
        top_p=torch.where(torch.rand(num_requests, generator=gen) < 0.5, 1.0, 0.8),
        min_p=torch.where(torch.rand(num_requests, generator=gen) < 0.5, 0.0, 0.1),
        generators=generators, penalties=penalties, banned=torch.rand(num_requests, vocab, generator=gen) < 0.05,
        num_logprobs=num_logprobs)


def test_requests_without_drafts_sample_exactly_as_the_sampler(seed):
    gen = torch.Generator().manual_seed(seed)
    num_requests, vocab = 16, 40
    logits = torch.randn(num_requests, vocab, generator=gen) * 2

    def seeded() -> dict[int, torch.Generator]:  # requests 1, 4, 9 bring their own seeds
        return {i: torch.Generator().manual_seed(seed + i) for i in (1, 4, 9)}

    batch = mixed_batch(gen, num_requests, vocab, 3, seeded())
    expected = Sampler(CPU, seed)(logits.clone(), batch)
    batch.generators = seeded()
    out = run(RejectionSampler(CPU, seed), logits.clone(), torch.empty(0, dtype=torch.int64), [0] * num_requests,
              None, batch)
    assert out.num_output.tolist() == [1] * num_requests
    assert torch.equal(out.output_token_ids[:, 0], expected.sampled)
    assert not batch.greedy.all() and len(set(expected.sampled.tolist())) > 3
    for name in ("logprob_token_ids", "logprobs", "sampled_rank"):
        assert torch.equal(getattr(out, name), getattr(expected, name)), name


def seeded_outputs(target_seed: int, position: int, others: list[tuple[int, bool, bool]], noise_seed: int,
                   target_logits: torch.Tensor, target_drafts: list[torch.Tensor], target_q: torch.Tensor) -> list:
    """Four steps of one seeded request (3 drafts, top-k 6) placed at `position` among `others`
    ((num_drafts, greedy, seeded) each; random logits and drafts) -> its tokens per step."""
    gen = torch.Generator().manual_seed(noise_seed)
    vocab = target_logits.shape[-1]
    sampler = RejectionSampler(CPU, noise_seed)
    target_generator = torch.Generator().manual_seed(target_seed)
    other_generators = [torch.Generator().manual_seed(noise_seed + i) for i in range(len(others))]
    tokens = []
    for step in range(len(target_drafts)):
        specs = others[:position] + [(3, False, True)] + others[position:]
        counts = [n for n, _, _ in specs]
        logits = torch.randn(sum(counts) + len(specs), vocab, generator=gen)
        start = sum(counts[:position]) + position
        logits[start:start + 4] = target_logits[step]
        drafts = random_drafts(gen, logits, counts, agree=0.5)
        drafts[start - position:start - position + 3] = target_drafts[step]
        q = torch.rand(sum(counts), vocab, generator=gen)
        q[start - position:start - position + 3] = target_q[step]
        q = q / q.sum(-1, keepdim=True)
        generators = {i: other_generators[i if i < position else i - 1] if i != position else target_generator
                      for i, s in enumerate(specs) if s[2]}
        batch = make_batch(len(specs), greedy=[s[1] for s in specs], top_k=[6] * len(specs), generators=generators)
        out = run(sampler, logits, drafts, counts, q, batch)
        tokens.append(out.output_token_ids[position, :int(out.num_output[position])].tolist())
    return tokens


def test_seeded_request_is_reproducible_and_independent_of_the_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, steps = 16, 4
    target_logits = torch.randn(steps, 4, vocab, generator=gen) * 0.5  # flat-ish: many outcomes
    target_drafts = [torch.randint(0, vocab, (3,), generator=gen) for _ in range(steps)]
    target_q = torch.rand(steps, 3, vocab, generator=gen)
    args = (target_logits, target_drafts, target_q)
    alone = seeded_outputs(seed, 0, [], seed + 1, *args)
    assert seeded_outputs(seed, 0, [], seed + 2, *args) == alone
    compositions = [(1, [(2, False, False)]), (2, [(0, True, False), (4, False, True), (1, False, False)]),
                    (3, [(3, False, True)] * 3 + [(0, False, False)] * 2)]
    for n, (position, others) in enumerate(compositions):
        assert seeded_outputs(seed, position, others, seed + 10 + n, *args) == alone, f"composition {n}"
    different = [seeded_outputs(seed + 1 + s, 0, [], seed + 1, *args) for s in range(3)]
    assert any(d != alone for d in different)  # the seed matters (all equal by chance: ~never)


def test_logprobs_are_those_of_the_raw_logits_at_the_emitted_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    num_requests, vocab, num_logprobs = 10, 30, 4
    counts = torch.randint(0, 5, (num_requests,), generator=gen).tolist()
    logits = torch.randn(sum(counts) + num_requests, vocab, generator=gen) * 2
    drafts = random_drafts(gen, logits, counts)
    batch = mixed_batch(gen, num_requests, vocab, num_logprobs, {2: torch.Generator().manual_seed(seed)})
    # Requests with drafts keep neutral penalties and bans (the caller's guarantee).
    with_drafts = torch.tensor(counts) > 0
    batch.banned[with_drafts] = False
    batch.penalties.prompt_mask[with_drafts] = False
    batch.penalties.output_counts[with_drafts] = 0
    out = run(RejectionSampler(CPU, seed), logits, drafts, counts, None, batch)
    raw = logits.double().log_softmax(-1)
    start = 0
    for i, n in enumerate(counts):
        for j in range(int(out.num_output[i])):
            row, token = start + i + j, int(out.output_token_ids[i, j])
            assert int(out.logprob_token_ids[row, 0]) == token
            torch.testing.assert_close(out.logprobs[row, 0].double(), raw[row, token], atol=1e-5, rtol=0)
            top = raw[row].topk(num_logprobs)
            assert out.logprob_token_ids[row, 1:].tolist() == top.indices.tolist()
            torch.testing.assert_close(out.logprobs[row, 1:].double(), top.values, atol=1e-5, rtol=0)
            assert int(out.sampled_rank[row]) == int((raw[row] > raw[row, token]).sum()) + 1
        start += n
    assert out.logprobs.shape == (sum(counts) + num_requests, 1 + num_logprobs)
