"""The token bitmask (constrained decoding, xgrammar's layout): the torch reference against
masks packed from a known allowed-token matrix, the Triton kernel against the reference (on CUDA
when present, else in Triton's interpreter, TRITON_INTERPRET=1 set by conftest, on small shapes),
and both against xgrammar's own apply on bitmasks a real GrammarMatcher fills."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.token_bitmask import TorchTokenBitmask

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
VOCABS = [1, 31, 32, 33, 1000, 32000 + 7]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed: [R, 32 * W] bool -> [R, W] int32, bit j of word w = allowed[:, 32 * w + j]."""
    num_rows = allowed.shape[0]
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)  # [32]
    words = (allowed.view(num_rows, -1, 32).long() * weights).sum(-1)  # [R, W] in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits


def random_case(gen: torch.Generator, vocab: int, mask_words: int, num_logits_rows: int, num_mask_rows: int,
                dtype: torch.dtype):
    """Logits [B, vocab], an allowed matrix [R, 32 * mask_words] (rows of every density: none,
    some, all allowed), its bitmask, and R distinct logits rows in random order."""
    logits = torch.randn(num_logits_rows, vocab, generator=gen).to(dtype)
    density = torch.rand(num_mask_rows, 1, generator=gen)
    density[0] = 0.0  # nothing allowed
    density[-1] = 1.0 if num_mask_rows > 1 else density[-1]  # everything the mask reaches allowed
    allowed = torch.rand(num_mask_rows, 32 * mask_words, generator=gen) < density  # [R, 32 * W]
    rows = torch.randperm(num_logits_rows, generator=gen)[:num_mask_rows]  # [R] int64
    return logits, allowed, pack_bitmask(allowed), rows


def expected_logits(logits: torch.Tensor, allowed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The obvious construction: -inf wherever the allowed matrix (False past its width) says no."""
    vocab = logits.shape[1]
    allowed_full = torch.zeros(allowed.shape[0], vocab, dtype=torch.bool)
    width = min(vocab, allowed.shape[1])
    allowed_full[:, :width] = allowed[:, :width]
    expected = logits.clone()
    for r, row in enumerate(rows.tolist()):
        expected[row] = expected[row].masked_fill(~allowed_full[r], float("-inf"))
    return expected


def mask_widths(vocab: int) -> list[int]:
    """Bitmask widths in words: narrower than the vocabulary, exact, wider."""
    exact = -(-vocab // 32)
    return sorted({max(exact - 1, 0), exact, exact + 2})


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_reference_matches_the_allowed_matrix(seed, vocab, dtype):
    gen = torch.Generator().manual_seed(seed)
    for mask_words in mask_widths(vocab):
        logits, allowed, bitmask, rows = random_case(gen, vocab, mask_words, 7, 4, dtype)
        out = logits.clone()
        TorchTokenBitmask.apply(out, bitmask, rows)
        assert torch.equal(out, expected_logits(logits, allowed, rows)), f"mask_words={mask_words}"


@pytest.mark.parametrize("vocab", [1, 33, 100])
def test_bit_order_is_xgrammar_s(seed, vocab):
    """Each bit read with plain Python integers: token 32 * w + j is allowed iff (word >> j) & 1."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31, (3, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.zeros(3, vocab)
    TorchTokenBitmask.apply(logits, bitmask, torch.arange(3))
    for r in range(3):
        for token in range(vocab):
            allowed = (int(bitmask[r, token // 32]) >> (token % 32)) & 1
            assert (logits[r, token] == 0) == bool(allowed), (r, token)


def test_reference_edge_cases():
    logits = torch.randn(3, 40)
    before = logits.clone()
    TorchTokenBitmask.apply(logits, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, before)  # no bitmask rows: nothing changes
    full = torch.full((2, 2), -1, dtype=torch.int32)  # every bit set
    TorchTokenBitmask.apply(logits, full, torch.tensor([2, 0]))
    assert torch.equal(logits, before)
    # A row named twice: a token is disallowed if either bitmask row disallows it.
    first, second = torch.tensor([[0b0110, 0]], dtype=torch.int32), torch.tensor([[0b1100, 0]], dtype=torch.int32)
    TorchTokenBitmask.apply(logits, torch.cat([first, second]), torch.tensor([1, 1]))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [2]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])


# -- the Triton kernel ----------------------------------------------------------------------------

def _triton_kernel():
    module = pytest.importorskip("baryon.kernels.token_bitmask_triton")
    from baryon.kernels.triton_utils import INTERPRETED

    if module.triton is None:
        pytest.skip("triton is not installed")
    if not CUDA and not INTERPRETED:
        pytest.skip("Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    return module.TritonTokenBitmask


@pytest.mark.parametrize("vocab", VOCABS if CUDA else [1, 31, 33, 1000, 4096 + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch(seed, vocab, dtype):
    kernel = _triton_kernel()
    gen = torch.Generator().manual_seed(seed)
    for mask_words in mask_widths(vocab):
        logits, _, bitmask, rows = random_case(gen, vocab, mask_words, 6, 4, dtype)
        logits, bitmask, rows = logits.to(DEVICE), bitmask.to(DEVICE), rows.to(DEVICE)
        out, ref = logits.clone(), logits.clone()
        kernel.apply(out, bitmask, rows)
        TorchTokenBitmask.apply(ref, bitmask, rows)
        assert torch.equal(out, ref), f"mask_words={mask_words}"


def test_triton_on_strided_rows_and_repeated_rows(seed):
    """Logits rows of a wider buffer (row stride > V), a bitmask slice, and a logits row named twice."""
    kernel = _triton_kernel()
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(5, 130, generator=gen).to(DEVICE)
    bitmask = torch.randint(-2**31, 2**31, (4, 6), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    rows = torch.tensor([3, 0, 3], device=DEVICE)
    out, ref = buffer.clone(), buffer.clone()
    kernel.apply(out[:, :100], bitmask[1:, :4], rows)
    TorchTokenBitmask.apply(ref[:, :100], bitmask[1:, :4], rows)
    assert torch.equal(out, ref)
    assert torch.equal(out[:, 100:], buffer[:, 100:])


def _cpu_kernel():
    from baryon.kernels.token_bitmask import CpuTokenBitmask

    reason = CpuTokenBitmask.unsupported_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    return CpuTokenBitmask


@pytest.mark.parametrize("vocab", VOCABS)
def test_cpu_kernel_matches_torch(seed, vocab):
    """The C++ kernel: every mask width, distinct rows in random order, then a row named twice and
    rows of a wider buffer (row stride > V)."""
    kernel = _cpu_kernel()
    gen = torch.Generator().manual_seed(seed)
    for mask_words in mask_widths(vocab):
        logits, _, bitmask, rows = random_case(gen, vocab, mask_words, 7, 4, torch.float32)
        out, ref = logits.clone(), logits.clone()
        kernel.apply(out, bitmask, rows)
        TorchTokenBitmask.apply(ref, bitmask, rows)
        assert torch.equal(out, ref), f"mask_words={mask_words}"
    buffer = torch.randn(5, vocab + 9, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (3, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 0, 3])
    out, ref = buffer.clone(), buffer.clone()
    kernel.apply(out[:, :vocab], bitmask, rows)
    TorchTokenBitmask.apply(ref[:, :vocab], bitmask, rows)
    assert torch.equal(out, ref) and torch.equal(out[:, vocab:], buffer[:, vocab:])


def test_selector_keeps_triton_off_cpu_unless_forced(monkeypatch):
    from baryon.kernels import selector
    from baryon.kernels.cpu import unsupported_reason
    from baryon.kernels.triton_utils import INTERPRETED, triton

    chosen = selector.select("token_bitmask", torch.device("cpu"))
    assert chosen.name == ("cpu" if unsupported_reason(torch.device("cpu")) is None else "torch")
    if triton is None or not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    monkeypatch.setenv("BARYON_KERNEL_TOKEN_BITMASK", "triton")
    assert selector.select("token_bitmask", torch.device("cpu")).name == "triton"


# -- against xgrammar ------------------------------------------------------------------------------

def test_matches_xgrammar_on_a_real_grammar(seed):
    """Bitmasks filled by GrammarMatchers at different states of a JSON schema, applied by us and by
    xgrammar.apply_token_bitmask_inplace (its indices: bitmask row i applies to logits row i)."""
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(c) for c in range(32, 127)] + ['{"', '":', '"}', "true", "false", "12", "</s>"]
    vocab_size = len(vocab) + 5  # the model's padded vocabulary: the padding is never allowed
    info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=[len(vocab) - 1])
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}'
    grammar = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    prefixes = {0: "", 2: '{"a":1', 3: '{"a":12,"b":', 5: '{"a":3,"b":true}'}
    bitmask = xgr.allocate_token_bitmask(6, vocab_size)  # [6, ceil(vocab_size / 32)]
    for index, text in prefixes.items():
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(text)
        matcher.fill_next_token_bitmask(bitmask, index)
    indices = list(prefixes)
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(seed))
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=indices)
    assert torch.isinf(expected[2]).any() and torch.isfinite(expected[2]).any()
    rows = torch.tensor(indices)
    out = logits.clone()
    TorchTokenBitmask.apply(out, bitmask[rows], rows)
    assert torch.equal(out, expected)
    if CUDA or _interpreter_available():
        kernel = _triton_kernel()
        out = logits.to(DEVICE)
        kernel.apply(out, bitmask[rows].to(DEVICE), rows.to(DEVICE))
        assert torch.equal(out.cpu(), expected)


def _interpreter_available() -> bool:
    from baryon.kernels.triton_utils import INTERPRETED, triton

    return triton is not None and INTERPRETED
