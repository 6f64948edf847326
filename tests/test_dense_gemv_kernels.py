"""The 16-bit decode GEMV (`dense_gemv`) against its float32 reference: on CUDA when present, else
in Triton's interpreter (float32, small shapes); and dense linear layers taking it for one row."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels import dense_gemv
from baryon.kernels.dense_gemv import (DECODE_MAX_M, MAX_M, TILE_TABLE, TorchDenseGemv, TritonDenseGemv,
                                       dense_gemv_reference, tile_config)
from baryon.kernels.triton_utils import INTERPRETED
from conftest import random_dense_layer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(dense_gemv.triton is None, reason="triton is not installed")
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def _assert_close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 if out.dtype == torch.float32 else 1e-2
    top = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.cpu().float() / top, ref.cpu().float() / top, atol=tol, rtol=0)


CASES = [  # (n, k, tiles)
    (40, 256, (8, 128, 4)),     # K a multiple of the tile, N of the rows per program
    (33, 300, (4, 64, 4)),      # odd N, K not a multiple of the tile
    (20, 100, (16, 64, 2)),     # fewer rows than one program's
    (96, 1024, None),           # the table's tiles
    (7, 40, (2, 1024, 8)),      # one step wider than K
]


@needs_triton
@pytest.mark.parametrize("n,k,tiles", CASES)
def test_triton_gemv_matches_reference(seed, monkeypatch, n, k, tiles):
    monkeypatch.setenv("BARYON_KERNEL_DENSE_GEMV", "triton")
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    for m in range(1, MAX_M + 1):
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        b = bias if (m + n) % 2 == 0 else None
        out = TritonDenseGemv.forward(x.to(DEVICE), weight.to(DEVICE), None if b is None else b.to(DEVICE), tiles=tiles)
        _assert_close(out, dense_gemv_reference(x, weight, b))
    # a float32 weight against x in the model dtype, float32 out (DeepSeek's router)
    x = torch.randn(1, k, generator=gen).to(DTYPE)
    w32 = torch.randn(n, k, generator=gen)
    out = TritonDenseGemv.forward(x.to(DEVICE), w32.to(DEVICE), out_dtype=torch.float32, tiles=tiles)
    _assert_close(out, dense_gemv_reference(x, w32, out_dtype=torch.float32))
    # x as a strided view (a slice of a wider activation) reads the right columns
    wide = torch.randn(1, k + 8, generator=gen).to(DTYPE)
    out = TritonDenseGemv.forward(wide[:, 4:4 + k].to(DEVICE), weight.to(DEVICE), tiles=tiles)
    _assert_close(out, dense_gemv_reference(wide[:, 4:4 + k], weight))


def test_reference_is_the_float_product(seed):
    gen = torch.Generator().manual_seed(seed)
    weight, x, bias = torch.randn(6, 10, generator=gen), torch.randn(2, 10, generator=gen), torch.randn(6, generator=gen)
    torch.testing.assert_close(dense_gemv_reference(x, weight, bias), x @ weight.t() + bias)
    torch.testing.assert_close(TorchDenseGemv.forward(x, weight), x @ weight.t())
    half = dense_gemv_reference(x.bfloat16(), weight.bfloat16())
    assert half.dtype == torch.bfloat16


def test_bad_inputs_are_named(seed):
    gen = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(8, 32, generator=gen), torch.randn(1, 32, generator=gen)
    with pytest.raises(ValueError, match="features"):
        TorchDenseGemv.forward(x[:, :16], weight)
    with pytest.raises(ValueError, match="float weight"):
        TorchDenseGemv.forward(x, weight.to(torch.int8))
    if dense_gemv.triton is not None and (DEVICE == "cuda" or INTERPRETED):
        with pytest.raises(ValueError, match="at most"):
            TritonDenseGemv.forward(torch.randn(MAX_M + 1, 32).to(DEVICE, DTYPE), weight.to(DEVICE, DTYPE))
        with pytest.raises(ValueError, match="contiguous"):
            TritonDenseGemv.forward(x.to(DEVICE, DTYPE), torch.randn(32, 8).to(DEVICE, DTYPE).t())


def test_tile_table_covers_every_shape():
    assert TILE_TABLE[-1][1:3] == (0, 0)  # the last row of each M takes any shape
    for m in range(1, MAX_M + 1):
        for n in (1, 1024, 4096, 6144, 24576):
            for k in (1, 1024, 4096, 12288):
                block_n, block_k, warps = tile_config(m, n, k)
                assert block_n >= 1 and block_k >= 16 and block_k & (block_k - 1) == 0 and warps in (1, 2, 4, 8)
    assert tile_config(1, 4096, 4096, (2, 1024, 8)) == (2, 1024, 8)
    assert "float64" in TritonDenseGemv.cannot_implement_reason(dtype=torch.float64)
    assert TritonDenseGemv.cannot_implement_reason(dtype=torch.bfloat16) is None


@needs_triton
def test_dense_layers_take_the_gemv_for_one_row(seed, monkeypatch):
    """A dense projection sends a one-row batch to the GEMV and larger batches to F.linear; both
    follow the float32 product. The LM head keeps F.linear."""
    monkeypatch.setenv("BARYON_KERNEL_DENSE_GEMV", "triton")
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 200
    layer = random_dense_layer(gen, k, n, DTYPE, DEVICE)
    if DEVICE == "cpu":  # the selector picks the GEMV for CUDA weights only; the interpreter stands in
        layer.dense_gemv = TritonDenseGemv
    assert layer.dense_gemv is TritonDenseGemv
    calls = []
    original = TritonDenseGemv.forward
    monkeypatch.setattr(TritonDenseGemv, "forward", staticmethod(
        lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw)))
    for m in (1, DECODE_MAX_M + 1, 5):
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        out = layer(x.to(DEVICE))
        ref = (x.float() @ layer.weight.float().cpu().t() + layer.bias.float().cpu()).to(DTYPE)
        _assert_close(out, ref)
    assert calls == [1]


@needs_triton
def test_float32_router_takes_the_gemv_for_one_row(seed, monkeypatch):
    """A router that keeps float32 logits (DeepSeek's) computes one row's logits with the GEMV on
    its float32 weight, larger batches with F.linear; both give the float32 product's experts."""
    from baryon.kernels.moe.routing import RoutingConfig
    from baryon.layers.fused_moe.router import Router

    monkeypatch.setenv("BARYON_KERNEL_DENSE_GEMV", "triton")
    gen = torch.Generator().manual_seed(seed)
    hidden, experts = 96, 16
    with torch.device(DEVICE), torch.no_grad():
        router = Router(hidden, RoutingConfig(experts, 4, renormalize=True), float32_logits=True)
        router.weight.copy_(torch.randn(experts, hidden, generator=gen, device="cpu"))
        router.method.process_weights_after_loading(router)
    if DEVICE == "cpu":
        router.dense_gemv = TritonDenseGemv
    assert router.weight.dtype == torch.float32 and router.dense_gemv is TritonDenseGemv
    calls = []
    original = TritonDenseGemv.forward
    monkeypatch.setattr(TritonDenseGemv, "forward", staticmethod(
        lambda *a, **kw: calls.append(kw.get("out_dtype")) or original(*a, **kw)))
    for m in (1, 3):
        x = torch.randn(m, hidden, generator=gen).to(DTYPE)
        weights, ids = router(x.to(DEVICE))
        logits = x.float() @ router.weight.float().cpu().t()
        expected = torch.topk(logits, 4, dim=-1)
        assert torch.equal(ids.cpu().long().sort(-1).values, expected.indices.sort(-1).values)
        probs = torch.softmax(logits, -1).gather(-1, ids.cpu().long())
        torch.testing.assert_close(weights.cpu(), probs / probs.sum(-1, keepdim=True), atol=1e-5, rtol=1e-5)
    assert calls == [torch.float32]
