"""Triton kernels against the references: on CUDA when present, else in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest) on small shapes."""

from __future__ import annotations

import math

import pytest
import torch

from test_kernels import _case, dense_attention

triton_paged = pytest.importorskip("baryon.kernels.attention.triton_paged")
if triton_paged.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # (heads, kv_heads, head_dim, block_size, window)
    (2, 2, 64, 16, None), (4, 2, 64, 8, None), (8, 2, 64, 16, 7), (4, 1, 128, 4, None), (16, 2, 64, 32, 3),
]


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", SHAPES)
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_triton_paged_attention_matches_dense(seed, heads, kv_heads, head_dim, block_size, window, kind):
    gen = torch.Generator().manual_seed(seed)
    if kind == "decode":
        seqs = [(int(torch.randint(0, 40, (1,), generator=gen)), 1) for _ in range(3)]
    else:  # prefill with and without cached prefix, decodes, a 1-token prompt, a chunk > BLOCK_Q
        seqs = [(0, 5), (9, 1), (17, 4), (0, 1), (3, 37)]
    cache, md, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    cache, q, k, v = _to(DEVICE, cache, q, k, v)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(DEVICE))
    scale = 1 / math.sqrt(head_dim)
    out = triton_paged.TritonPagedAttention(heads, head_dim, kv_heads, scale, window).forward(q, k, v, cache, md)
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new].cpu(), fk, fv, scale, window)
        torch.testing.assert_close(out[start:start + new].cpu(), expected, atol=2e-3, rtol=2e-3)
        start += new


def test_triton_store_kv_skips_padding(seed):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, 3, 4, 2, 64, device=DEVICE)
    key = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([6, -1, 0, 11], device=DEVICE)
    triton_paged.store_kv(key, value, cache, slots)
    flat = cache.view(2, 12, 2, 64)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat[0, slot], key[i])
            torch.testing.assert_close(flat[1, slot], value[i])
    assert int((flat.abs().sum((-1, -2)) > 0).sum()) == 6  # three slots, keys and values


def test_selector_keeps_torch_on_cpu_unless_forced(monkeypatch):
    from baryon.kernels import selector

    cpu = torch.device("cpu")
    assert selector.select("attention", cpu, head_dim=64).name == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("BARYON_KERNEL_ATTENTION", "triton")
    assert selector.select("attention", cpu, head_dim=64).name == "triton"
    with pytest.raises(ValueError, match="head_dim 8"):
        selector.select("attention", cpu, head_dim=8)
