"""Greedy tokens from vocabulary slices (`vocab_argmax`): the Triton kernels (on CUDA when present,
else in Triton's interpreter, TRITON_INTERPRET=1 set by conftest) and the torch reference give
the first id of each row's largest logit, as an argmax over the whole row, from one slice or from
several ranks' slices stacked."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels import vocab_argmax
from baryon.kernels.vocab_argmax import TorchVocabArgmax

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = [TorchVocabArgmax]
if vocab_argmax.triton is not None:
    KERNELS.append(vocab_argmax.TritonVocabArgmax)


def tied_logits(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, vocab]: small integers (each row's maximum held by many ids, across chunks), one row
    all -inf (argmax: id 0), on DEVICE in dtype."""
    logits = torch.randint(-40, 40, (rows, vocab), generator=gen).to(dtype)
    logits[rows // 2] = float("-inf")
    return logits.to(DEVICE)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_slices_give_the_whole_rows_argmax(seed, kernel, dtype, ranks):
    gen = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(4500, 6500, (), generator=gen))  # several 2,048-wide chunks a slice
    full = tied_logits(gen, 5, vocab, dtype)
    per_rank = -(-vocab // ranks)
    slices = []
    for rank in range(ranks):
        start = rank * per_rank
        width = min(per_rank, vocab - start)
        local = torch.full((5, per_rank), 1000.0, dtype=dtype, device=DEVICE)  # padding beats every logit
        local[:, :width] = full[:, start:start + width]
        slices.append(kernel.candidates(local, width, start))
    got = kernel.pick(torch.stack(slices))  # [ranks, n, C, 4] -> [n]
    expected = full.float().argmax(dim=-1)
    if ranks == 1:
        assert kernel.argmax(local, width).tolist() == expected.tolist()
    assert got.dtype == torch.int64
    assert got.tolist() == expected.tolist()
    top = full == full.max(dim=-1, keepdim=True).values
    assert (top.sum(dim=-1) > 1).all()  # every row has ties: the first id is what was checked


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_ids_past_two_digits_and_one_row_per_chunk(seed, kernel):
    """Ids past 65,535 (the third digit) from a slice that starts there; one logit each row whose
    largest value sits in a random chunk; a strided row view (the decode graph's slice)."""
    gen = torch.Generator().manual_seed(seed)
    rows, width, start = 3, 3000, 70000
    buffer = torch.randn(rows, width + 17, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, width, (rows,), generator=gen)
    buffer[torch.arange(rows), positions] = 50.0
    local = buffer.to(DEVICE)[:, :width + 5]  # row stride width + 17
    got = kernel.pick(kernel.candidates(local, width, start).unsqueeze(0))
    assert got.tolist() == (positions + start).tolist()


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_bad_shapes_are_refused(kernel):
    local = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="width"):
        kernel.candidates(local, 9, 0)
    with pytest.raises(ValueError, match="base-256"):
        kernel.candidates(local, 8, vocab_argmax.MAX_VOCAB - 4)


def test_lm_head_argmax_reads_the_soft_capped_logits(seed):
    """Gemma 2's final soft-cap in bf16 maps neighbouring logits to one value: the greedy argmax
    (the path without logprobs) takes the lowest id of the capped tie, as the gathered logits'
    argmax and transformers do, not the larger raw logit; Granite's divisor too."""
    from baryon.layers.embedding import ParallelLMHead

    gen = torch.Generator().manual_seed(seed)
    head = ParallelLMHead(64, 8)
    head.final_logit_softcap = 30.0
    raw = torch.randn(4, 64, generator=gen).to(torch.bfloat16) * 3
    raw[:, 10], raw[:, 11] = 25.375, 25.5  # equal once capped in bf16; 11 is larger before the cap
    assert torch.equal(head.finished_logits(raw[:, 10:11]), head.finished_logits(raw[:, 11:12]))
    assert head.argmax(raw).tolist() == head.gather_logits(raw).argmax(dim=-1).tolist() == [10] * 4
    head.final_logit_softcap, head.final_logit_divisor = None, 8.0
    assert head.argmax(raw).tolist() == head.gather_logits(raw).argmax(dim=-1).tolist()
