"""The 16-bit decode GEMM (swap AB, family `dense_decode_linear`) against the float32 reference:
on CUDA when present (bfloat16), else in Triton's interpreter (float16: the interpreter's bfloat16
dot is wrong); and dense layers sending decode batches to it where its table has tiles."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels import dense_decode_gemm
from baryon.kernels.dense_decode_gemm import (MAX_M, TILE_TABLE, DecodeTiles, TorchDenseDecodeLinear,
                                              TritonDenseDecodeLinear, plan)
from baryon.kernels.dense_gemv import dense_gemv_reference
from baryon.kernels.triton_utils import INTERPRETED, triton
from conftest import random_dense_layer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
needs_triton = pytest.mark.skipif(triton is None or not (DEVICE == "cuda" or INTERPRETED),
                                  reason="triton (on a GPU or interpreted) is not available")


def _assert_close(out, ref):
    """Only the summation order differs (float32 sums either way); the output rounds to 16 bits."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    top = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.cpu().float() / top, ref.cpu().float() / top, atol=8e-3, rtol=0)


def _case(gen, m, n, k):
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DTYPE)
    return x, w, torch.randn(n, generator=gen).to(DTYPE)


@needs_triton
@pytest.mark.parametrize("n,k", [(150, 200), (64, 512), (70, 300)])
@pytest.mark.parametrize("m", [2, 9, 16, 17, 40, MAX_M])
def test_triton_matches_reference(seed, m, n, k):
    """Odd N (the last weight tile wrapped), K not a multiple of BLOCK_K (masked last tile) and a
    multiple, row counts at and between the token tiles, with and without a bias."""
    gen = torch.Generator().manual_seed(seed)
    x, w, bias = _case(gen, m, n, k)
    b = bias if (m + n) % 2 else None
    out = TritonDenseDecodeLinear.forward(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE))
    _assert_close(out, dense_gemv_reference(x, w, b))


@needs_triton
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("tiles", [DecodeTiles(16, 64, 64, 4, 2), DecodeTiles(32, 128, 64, 8, 3),
                                   DecodeTiles(64, 64, 128, 4, 3)])
def test_split_k_and_given_tiles_match_reference(seed, split, tiles):
    """K sliced over programs (float32 partial sums added in order with the bias by the second
    kernel; a short last slice), token tiles smaller than the batch; the same inputs give the same
    bits."""
    gen = torch.Generator().manual_seed(seed)
    m, n, k = 45, 100, 5 * tiles.block_k + 24
    x, w, bias = _case(gen, m, n, k)
    args = (x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE))
    out = TritonDenseDecodeLinear.forward(*args, split=split, tiles=tiles)
    _assert_close(out, dense_gemv_reference(x, w, bias))
    assert torch.equal(out, TritonDenseDecodeLinear.forward(*args, split=split, tiles=tiles))


@needs_triton
def test_strided_rows_and_empty_batch(seed):
    """x and the weight as views with a row stride wider than K (slices of wider tensors) read the
    right columns; M = 0 returns an empty [0, N]."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(7, 96 + 16, generator=gen).to(DTYPE)
    _, w, _ = _case(gen, 1, 80, 96)
    out = TritonDenseDecodeLinear.forward(wide[:, 8:104].to(DEVICE), w.to(DEVICE))
    _assert_close(out, dense_gemv_reference(wide[:, 8:104], w))
    empty = TritonDenseDecodeLinear.forward(wide[:0, :96].to(DEVICE), w.to(DEVICE))
    assert empty.shape == (0, 80) and empty.dtype == DTYPE
    # the weight as a view whose rows are wider than K (a slice of a wider matrix)
    wide_w = torch.randn(80, 96 + 32, generator=gen).to(DTYPE) * 0.05
    x = wide[:, 8:104]
    out = TritonDenseDecodeLinear.forward(x.to(DEVICE), wide_w[:, 16:112].to(DEVICE))
    _assert_close(out, dense_gemv_reference(x, wide_w[:, 16:112]))


def test_bad_inputs_are_named(seed):
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(gen, 3, 16, 32)
    with pytest.raises(ValueError, match=r"must be \[M, 32\]"):
        TorchDenseDecodeLinear.forward(x[:, :16], w)
    with pytest.raises(ValueError, match="bfloat16 / float16 weight"):
        TorchDenseDecodeLinear.forward(x, w.float())
    with pytest.raises(ValueError, match="at most"):
        TorchDenseDecodeLinear.forward(torch.randn(MAX_M + 1, 32).to(DTYPE), w)
    torch.testing.assert_close(TorchDenseDecodeLinear.forward(x, w), dense_gemv_reference(x, w))
    if triton is not None and (DEVICE == "cuda" or INTERPRETED):
        with pytest.raises(ValueError, match="contiguous"):
            TritonDenseDecodeLinear.forward(x.to(DEVICE), torch.randn(32, 16).to(DEVICE, DTYPE).t())
        with pytest.raises(ValueError, match="x is"):
            TritonDenseDecodeLinear.forward(x.to(DEVICE).float(), w.to(DEVICE))
    assert "float32" in TritonDenseDecodeLinear.cannot_implement_reason(dtype=torch.float32)
    assert TritonDenseDecodeLinear.cannot_implement_reason(dtype=torch.float16) is None


def test_table_and_split_rules(monkeypatch):
    """Every table row is a valid launch or cuBLAS; each row count up to MAX_M finds a row for any
    shape; the kernel serves 2..MAX_M rows where the table has tiles; K slices double while the
    tiles leave an H100's 132 SMs idle and each slice keeps 4 K tiles."""
    for max_m, min_n, min_k, tiles, split in TILE_TABLE:
        assert 1 < max_m <= MAX_M and split in (0, 1, 2, 4, 8)
        if tiles is not None:
            assert tiles.block_m in (16, 32, 64) and tiles.block_n in (64, 128)
            assert tiles.block_k & (tiles.block_k - 1) == 0 and tiles.num_warps in (4, 8)
        assert plan(max_m, max(min_n, 1), max(min_k, 1)) == (tiles, split)  # no row above shadows it
    assert TILE_TABLE[-1][1:3] == (0, 0) and TILE_TABLE[-1][0] == MAX_M
    assert not TritonDenseDecodeLinear.serves(1, 96, 96) and not TritonDenseDecodeLinear.serves(MAX_M + 1, 96, 96)
    for m in range(2, MAX_M + 1):
        for n, k in ((96, 96), (3072, 4096), (4096, 2048), (12288, 4096), (4096, 12288)):
            assert TritonDenseDecodeLinear.serves(m, n, k) == (plan(m, n, k)[0] is not None)
    assert TritonDenseDecodeLinear.serves(32, 12288, 4096) and not TritonDenseDecodeLinear.serves(33, 12288, 4096)
    monkeypatch.setattr(dense_decode_gemm, "multiprocessor_count", lambda device, off_gpu=4: 132)
    cuda = torch.device("cuda", 0)
    tiles = DecodeTiles(64, 64, 128, 4, 4)
    assert dense_decode_gemm.split_k(64, 3072, 4096, cuda, tiles) == 2  # 48 tiles, 32 K tiles
    assert dense_decode_gemm.split_k(64, 4096, 2048, cuda, tiles) == 2  # 64 tiles
    assert dense_decode_gemm.split_k(64, 12288, 4096, cuda, tiles) == 1  # 192 tiles: one wave already
    assert dense_decode_gemm.split_k(64, 1024, 4096, cuda, tiles) == 8  # 16 tiles, 32 K tiles: 8 slices of 4
    assert dense_decode_gemm.split_k(64, 1024, 512, cuda, tiles) == 1  # 4 K tiles: too few to slice
    assert dense_decode_gemm.split_k(40, 1024, 4096, cuda, DecodeTiles(32, 64, 128, 4, 3)) == 4  # 2 x 16 tiles


@needs_triton
def test_dense_layers_take_it_for_decode_batches(seed, monkeypatch):
    """A dense projection sends 2..MAX_M rows to the decode GEMM where the table has tiles, one row
    to the GEMV's path and larger batches to F.linear; every path follows the float32 product."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 200
    layer = random_dense_layer(gen, k, n, DTYPE, DEVICE)
    if DEVICE == "cpu":  # the selector picks it for CUDA weights only; the interpreter stands in
        layer.dense_decode = TritonDenseDecodeLinear
    assert layer.dense_decode is TritonDenseDecodeLinear
    calls = []
    original = TritonDenseDecodeLinear.forward
    monkeypatch.setattr(TritonDenseDecodeLinear, "forward", staticmethod(
        lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw)))
    for m in (1, 2, 5, MAX_M, MAX_M + 3):
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        out = layer(x.to(DEVICE))
        ref = (x.float() @ layer.weight.float().cpu().t() + layer.bias.float().cpu()).to(DTYPE)
        _assert_close(out, ref)
    assert calls == [m for m in (2, 5, MAX_M) if plan(m, n, k)[0] is not None] and calls
