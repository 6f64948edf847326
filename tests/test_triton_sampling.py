"""The Triton sampling kernels against the torch reference (baryon/kernels/sampling.py): on CUDA
at a real vocabulary when present, else in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest) on small shapes.

Logits are tie-free (a random permutation of Gaussian quantiles) and every top_p sits midway
between two prefix masses: the kernels sum probability mass in another order than the
reference's cumsum, so only a top_p within float rounding of a prefix mass (or an exact tie at
the top-p threshold, see sampling_triton.py) could tell them apart.
"""

from __future__ import annotations

import pytest
import torch

from baryon.kernels import sampling_triton
from baryon.kernels.sampling import TorchSampling

if sampling_triton.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from baryon.kernels.sampling_triton import TritonSampling  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The interpreter runs a program per row in Python: a few rows of a small vocabulary there.
ROWS, VOCAB = (64, 151936) if CUDA else (6, 300)


def tie_free_logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 on DEVICE: each row a random permutation of Gaussian quantiles at a
    random scale (0.3 to 4), so no two logits of a row are equal."""
    quantiles = torch.special.ndtri((torch.arange(vocab, dtype=torch.float64) + 0.5) / vocab)
    scale = torch.empty(rows, 1, dtype=torch.float64).uniform_(0.3, 4.0, generator=gen)
    order = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])
    return (quantiles[order] * scale).float().to(DEVICE)


def safe_top_p(row: torch.Tensor, top_k: int, gen: torch.Generator) -> float:
    """A top_p for one row of logits (after top_k, 0 = all) midway between two prefix masses of
    the reference's ranking, where float32 rounding cannot move the boundary."""
    ranked = row.double().sort(descending=True).values
    if 0 < top_k < ranked.numel():
        ranked = ranked[ranked >= ranked[top_k - 1]]
    probs = ranked.softmax(dim=0)
    mass = probs.cumsum(dim=0)
    wide = torch.nonzero(probs >= 1e-4 * mass).flatten()  # boundary token carries >= 1e-4 of the mass
    pick = wide[int(torch.randint(0, wide.numel(), (1,), generator=gen))]
    return float(mass[pick] - probs[pick] / 2)


def mixed_top_k(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """[rows] int64: off (0), 1, vocab, beyond vocab, vocab - 1, then random ks."""
    special = [0, 1, vocab, vocab + 7, vocab - 1]
    random_ks = torch.randint(2, vocab, (rows,), generator=gen).tolist()
    return torch.tensor((special + random_ks)[:rows], device=DEVICE)


def mixed_top_p(gen: torch.Generator, logits: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    """[rows] float32: off (1.0), tiny (1e-6), then safe random ps."""
    ps = []
    for r in range(logits.shape[0]):
        if r % 4 == 0:
            ps.append(1.0)
        elif r % 4 == 1:
            ps.append(1e-6)
        else:
            ps.append(safe_top_p(logits[r], 0 if top_k is None else int(top_k[r]), gen))
    return torch.tensor(ps, device=DEVICE)


def assert_same_truncation(out: torch.Tensor, ref: torch.Tensor) -> None:
    kept, ref_kept = torch.isfinite(out), torch.isfinite(ref)
    for r in range(out.shape[0]):
        assert torch.equal(kept[r], ref_kept[r]), (
            f"row {r}: kept {int(kept[r].sum())} tokens, the reference {int(ref_kept[r].sum())}")
    assert torch.equal(out, ref)  # survivors untouched, the rest -inf


# -- top-k / top-p ---------------------------------------------------------------------------------

def test_top_k_matches_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = tie_free_logits(gen, ROWS, VOCAB)
    top_k = mixed_top_k(gen, ROWS, VOCAB)
    assert_same_truncation(TritonSampling.apply_top_k_top_p(logits, top_k, None),
                           TorchSampling.apply_top_k_top_p(logits, top_k, None))


def test_top_p_matches_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = tie_free_logits(gen, ROWS, VOCAB)
    top_p = mixed_top_p(gen, logits, None)
    assert_same_truncation(TritonSampling.apply_top_k_top_p(logits, None, top_p),
                           TorchSampling.apply_top_k_top_p(logits, None, top_p))


def test_top_k_then_top_p_matches_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = tie_free_logits(gen, ROWS, VOCAB)
    top_k = mixed_top_k(gen, ROWS, VOCAB)[torch.randperm(ROWS, generator=gen).to(DEVICE)]
    top_p = mixed_top_p(gen, logits, top_k)
    assert_same_truncation(TritonSampling.apply_top_k_top_p(logits, top_k, top_p),
                           TorchSampling.apply_top_k_top_p(logits, top_k, top_p))


def test_top_k_keeps_ties_like_the_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 4, 97
    logits = torch.randint(-4, 5, (rows, vocab), generator=gen).float().to(DEVICE)  # many exact ties
    top_k = torch.randint(1, vocab, (rows,), generator=gen).to(DEVICE)
    assert_same_truncation(TritonSampling.apply_top_k_top_p(logits, top_k, None),
                           TorchSampling.apply_top_k_top_p(logits, top_k, None))


def test_top_p_keeps_every_token_tied_with_the_last_kept():
    # Probabilities 1/2, 1/4, 1/4 (exact in float32): top_p 0.7 needs one of the tied tokens; the
    # kernel keeps both (the reference keeps whichever its sort ranks first).
    logits = torch.tensor([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]], device=DEVICE).log()
    out = TritonSampling.apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.4], device=DEVICE))
    assert torch.isfinite(out).tolist() == [[True, True, True], [False, True, False]]


def test_banned_tokens_and_rows_of_minus_inf(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 6, 120
    logits = tie_free_logits(gen, rows, vocab)
    logits[torch.rand(rows, vocab, generator=gen).to(DEVICE) < 0.4] = float("-inf")  # banned tokens
    logits[1] = float("-inf")
    logits[2, :-3] = float("-inf")  # three finite logits, top-k asks for more
    logits[2, -3:] = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    top_k = torch.tensor([5, 3, 10, 0, 1, 40], device=DEVICE)
    top_p_alone, top_p_after_k = (
        torch.tensor([safe_top_p(logits[r], k, gen) if r != 1 else 0.5 for r, k in enumerate(ks)], device=DEVICE)
        for ks in ([0] * rows, top_k.tolist()))
    for k, p in [(top_k, None), (None, top_p_alone), (top_k, top_p_after_k)]:
        assert_same_truncation(TritonSampling.apply_top_k_top_p(logits, k, p),
                               TorchSampling.apply_top_k_top_p(logits, k, p))


def test_no_truncation_returns_the_logits():
    logits = torch.randn(2, 10, device=DEVICE)
    assert TritonSampling.apply_top_k_top_p(logits, None, None) is logits


# -- penalties and min-p ---------------------------------------------------------------------------

def test_penalties_match_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = (ROWS, VOCAB) if CUDA else (5, 1500)  # 1500: more than one block per row
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
    prompt_mask = (torch.rand(rows, vocab, generator=gen) < 0.1).to(DEVICE)
    counts = torch.randint(0, 4, (rows, vocab), generator=gen) * (torch.rand(rows, vocab, generator=gen) < 0.1)
    output_counts = counts.float().to(DEVICE)
    presence, frequency = ((torch.rand(2, rows, generator=gen) * 4 - 2).to(DEVICE))
    repetition = torch.empty(rows).uniform_(0.3, 3.0, generator=gen).to(DEVICE)
    presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0  # a row without penalties
    args = (logits, prompt_mask, output_counts, presence, frequency, repetition)
    out = TritonSampling.apply_penalties(*args)
    torch.testing.assert_close(out, TorchSampling.apply_penalties(*args), rtol=0, atol=0)
    assert torch.equal(out[0], logits[0])


def test_min_p_matches_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = (ROWS, VOCAB) if CUDA else (6, 5000)  # 5000: more than one block per row
    probs = tie_free_logits(gen, rows, vocab).softmax(dim=-1)
    min_p = torch.rand(rows, generator=gen).to(DEVICE)
    min_p[0], min_p[1] = 0.0, 1.0
    out = TritonSampling.apply_min_p(probs, min_p)
    assert torch.equal(out, TorchSampling.apply_min_p(probs, min_p))
    assert int((out[1] > 0).sum()) == 1 and torch.equal(out[0], probs[0])


# -- selection and the sampler ---------------------------------------------------------------------

def test_selector_keeps_triton_off_cpu_unless_forced(monkeypatch):
    from baryon.kernels import selector
    from baryon.kernels.triton_utils import INTERPRETED

    assert selector.select("sampling", torch.device("cpu")).name == "cpu"  # kernels/sampling_cpu.py
    if CUDA:
        assert selector.select("sampling", DEVICE) is TritonSampling
    if not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    monkeypatch.setenv("BARYON_KERNEL_SAMPLING", "triton")
    assert selector.select("sampling", torch.device("cpu")) is TritonSampling


def _sampler_step(kernel: str, logits: torch.Tensor, configs: list, step_seed: int, monkeypatch):
    from baryon.layers.sampler import Sampler
    from baryon.runner.sampling_inputs import build_sampling_batch
    from test_sampler import make_request

    monkeypatch.setenv("BARYON_KERNEL_SAMPLING", kernel)
    sampler = Sampler(DEVICE, step_seed)
    assert sampler.kernel.name == kernel
    requests = []
    for i, (params, prompt, output) in enumerate(configs):
        generator = torch.Generator(DEVICE).manual_seed(step_seed + i) if params.seed is not None else None
        requests.append(make_request(params, prompt=prompt, output=output, eos=[0], generator=generator,
                                     rid=str(i)))
    return sampler(logits.clone(), build_sampling_batch(requests, logits.shape[1], DEVICE)).sampled


def test_sampler_gives_the_same_tokens_with_either_kernel(seed, monkeypatch):
    """Greedy, seeded and unseeded rows with every logit processor: the Triton kernels keep the
    same tokens as torch, so the same race (the reference's on both sides: the Triton race draws
    from Philox streams of its own, tested below) picks the same ones."""
    from baryon.kernels.sampling import sample_rows
    from baryon.kernels.triton_utils import INTERPRETED
    from baryon.sampling_params import SamplingParams

    if not CUDA and not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    monkeypatch.setattr(TritonSampling, "sample_rows", staticmethod(sample_rows))
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = (ROWS, VOCAB) if CUDA else (10, 200)
    for step in range(2 if CUDA else 1):
        logits = tie_free_logits(gen, rows, vocab)
        configs = []
        for i in range(rows):
            kind, temperature = i % 10, float(torch.empty(1).uniform_(0.5, 1.5, generator=gen))
            seeded = dict(seed=seed + i) if i % 3 == 0 else {}
            prompt, output = torch.randint(0, vocab, (2, 6), generator=gen).tolist()
            top_k = int(torch.randint(1, vocab, (1,), generator=gen))
            scaled = logits[i] / temperature
            params = [
                dict(temperature=0),
                dict(temperature=temperature),
                dict(temperature=temperature, top_k=top_k),
                dict(temperature=temperature, top_p=safe_top_p(scaled, 0, gen)),
                dict(temperature=temperature, top_k=top_k, top_p=safe_top_p(scaled, top_k, gen)),
                dict(temperature=temperature, top_k=top_k, min_p=0.3),
                dict(temperature=temperature, top_k=top_k, presence_penalty=1.0, repetition_penalty=1.5),
                dict(temperature=0, frequency_penalty=0.5, repetition_penalty=1.3),
                dict(temperature=temperature, top_k=1),
                dict(temperature=temperature, top_k=top_k, min_tokens=3),  # eos banned
            ][kind]
            configs.append((SamplingParams(**params, **seeded), prompt, output))
        torch_tokens = _sampler_step("torch", logits, configs, seed + step, monkeypatch)
        triton_tokens = _sampler_step("triton", logits, configs, seed + step, monkeypatch)
        differing = (triton_tokens != torch_tokens).nonzero().flatten().tolist()
        assert not differing, f"step {step}: rows {differing} sampled other tokens"


def test_race_greedy_rows_take_the_argmax_and_draws_follow_their_seeds(seed, monkeypatch):
    """The Triton race has the seeds' and greedy rows' properties (tests/test_sampler.py), and
    another split layout (more, shorter splits) draws the same tokens."""
    from test_sampler import assert_draws_follow_their_seeds

    inputs, drawn = assert_draws_follow_their_seeds(TritonSampling.sample_rows, seed, rows=12, vocab=700,
                                                    device=DEVICE)
    monkeypatch.setattr(sampling_triton, "_split_layout", lambda r, v, d: (64, 128, -(-v // 128)))
    assert torch.equal(TritonSampling.sample_rows(*inputs), drawn)


def test_race_draws_follow_the_softmax(seed):
    """Many rows of one distribution, each with its own seed: the kernel's tokens follow
    softmax(logits / temperature) (tests/test_sampler.py checks the CPU implementations so)."""
    from test_sampler import assert_draws_follow_the_softmax

    assert_draws_follow_the_softmax(TritonSampling.sample_rows, seed, rows=800, device=DEVICE)
