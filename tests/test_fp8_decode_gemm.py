"""The FP8 decode GEMM (swap AB, family fp8_decode_linear) against the float32 reference: on CUDA
when present, else in Triton's interpreter (which handles float8_e4m3fn loads and tl.dot on them)."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.quant import fp8_decode_gemm
from baryon.kernels.quant.act_quant import FP8, FP8_MAX, quantize_per_token_reference
from baryon.kernels.quant.fp8_decode_gemm import (MAX_M, DecodeTiles, TorchFp8DecodeLinear,
                                                  TritonFp8DecodeLinear)
from baryon.kernels.quant.fp8_gemm import fp8_linear_reference
from baryon.kernels.triton_utils import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed")


def _case(gen, m, n, k):
    x_q, x_scale = quantize_per_token_reference(torch.randn(m, k, generator=gen), FP8)  # [M, K], [M, 1]
    w_q, w_scale = quantize_per_token_reference(torch.randn(n, k, generator=gen) * 0.05, FP8)
    return x_q, x_scale, w_q, w_scale.reshape(-1)


def _assert_matches(out, ref):
    """Interpreted float32: only the summation order differs; on a GPU the tensor cores sum FP8
    products in reduced precision within a K tile and bf16 outputs round."""
    tol = 1e-5 if DEVICE == "cpu" and out.dtype == torch.float32 else 2e-2
    top = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.float().cpu() / top, ref.float().cpu() / top, atol=tol, rtol=0)


@needs_triton
@pytest.mark.parametrize("n,k", [(150, 200), (64, 512), (70, 300)])
@pytest.mark.parametrize("m", [2, 16, 17, 65, MAX_M])
def test_triton_matches_reference(seed, m, n, k):
    """Odd N (wrapped row tiles), K not a multiple of BLOCK_K (masked last tile) and a multiple
    (the unmasked loop), token counts at and between the tile sizes (past 64: several token tiles,
    the last one wrapped), with and without a bias."""
    gen = torch.Generator().manual_seed(seed)
    x_q, x_scale, w_q, w_scale = _case(gen, m, n, k)
    bias = torch.randn(n, generator=gen) if (m + n) % 2 else None
    out_dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    args = [t.to(DEVICE) if t is not None else None for t in (x_q, x_scale, w_q, w_scale)]
    out = TritonFp8DecodeLinear.forward(*args, out_dtype, bias.to(DEVICE) if bias is not None else None)
    assert out.shape == (m, n) and out.dtype == out_dtype
    ref = fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, None)
    _assert_matches(out, ref)
    torch.testing.assert_close(TorchFp8DecodeLinear.forward(x_q, x_scale, w_q, w_scale, torch.float32, bias), ref)


@needs_triton
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("m,with_bias", [(5, True), (64, False), (MAX_M, True)])
def test_split_k_matches_reference(seed, split, m, with_bias):
    """K sliced over programs (float32 partial sums, added in order with the scales and the bias
    by the second kernel), a short last slice included; the same inputs give the same bits."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 70, 5 * fp8_decode_gemm.tile_config(m, 70, 1).block_k + 40
    x_q, x_scale, w_q, w_scale = _case(gen, m, n, k)
    bias = torch.randn(n, generator=gen) if with_bias else None
    out_dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    args = [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale)]
    b = bias.to(DEVICE) if with_bias else None
    out = TritonFp8DecodeLinear.forward(*args, out_dtype, b, split=split)
    _assert_matches(out, fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, None))
    assert torch.equal(out, TritonFp8DecodeLinear.forward(*args, out_dtype, b, split=split))


def test_split_k_choice(monkeypatch):
    """Slices only past 32 tokens, while the row tiles leave SMs idle (an H100: 132) and each
    keeps 4 K tiles."""
    monkeypatch.setattr(fp8_decode_gemm, "multiprocessor_count", lambda device, off_gpu=4: 132)
    cuda = torch.device("cuda", 0)
    one_tile = DecodeTiles(64, 64, 256, 4, 4)
    assert fp8_decode_gemm.split_k(64, 4096, 4096, cuda, one_tile) == 2  # 64 tiles
    assert fp8_decode_gemm.split_k(64, 4096, 4096, cuda) == 1  # o: two token tiles of 32, 128 tiles
    assert fp8_decode_gemm.split_k(33, 4096, 12288, cuda) == 1  # down: two token tiles of 32
    assert fp8_decode_gemm.split_k(33, 4096, 12288, cuda, one_tile) == 2  # one token tile: 64 tiles
    assert fp8_decode_gemm.split_k(32, 4096, 12288, cuda) == 1  # the smaller token tiles never split
    assert fp8_decode_gemm.split_k(64, 6144, 4096, cuda) == 1  # qkv: 96 tiles
    assert fp8_decode_gemm.split_k(64, 24576, 4096, cuda) == 1
    assert fp8_decode_gemm.split_k(64, 1024, 4096, cuda, one_tile) == 4  # 16 tiles, 16 K tiles: 4 slices of 4
    assert fp8_decode_gemm.split_k(64, 1024, 512, cuda, one_tile) == 1  # too little K
    assert fp8_decode_gemm.split_k(128, 4096, 12288, cuda) == 2  # down: 2 token tiles x 32 of 128 rows
    assert fp8_decode_gemm.split_k(128, 4096, 4096, cuda) == 1  # o: 2 token tiles x 64 of 64 rows
    assert fp8_decode_gemm.split_k(128, 4096, 4096, cuda, DecodeTiles(128, 64, 128, 4, 4)) == 2


@needs_triton
@pytest.mark.parametrize("tiles", [DecodeTiles(32, 64, 64, 4, 2), DecodeTiles(64, 128, 128, 8, 3)])
def test_given_tiles_match_reference(seed, tiles):
    """Tiles other than the table's (the tuning sweep's): token tiles smaller than the batch, 128
    weight rows on two warpgroups, split K on top."""
    gen = torch.Generator().manual_seed(seed)
    m, n, k = 90, 200, 3 * tiles.block_k + 24
    x_q, x_scale, w_q, w_scale = _case(gen, m, n, k)
    out_dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    args = [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale)]
    ref = fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, None, None)
    for split in (1, 2):
        _assert_matches(TritonFp8DecodeLinear.forward(*args, out_dtype, split=split, tiles=tiles), ref)


@needs_triton
def test_static_scale_and_empty_batch(seed):
    """A static per-tensor activation scale expanded to [M, 1] (stride 0) reads one value for every
    token; M = 0 returns an empty [0, N]."""
    gen = torch.Generator().manual_seed(seed)
    _, _, w_q, w_scale = _case(gen, 1, 96, 160)
    x_q = (torch.randn(9, 160, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    static = torch.tensor([0.013]).expand(9, 1)
    out = TritonFp8DecodeLinear.forward(x_q.to(DEVICE), static.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE),
                                        torch.float32)
    _assert_matches(out, fp8_linear_reference(x_q, static, w_q, w_scale, torch.float32))
    empty = TritonFp8DecodeLinear.forward(x_q[:0].to(DEVICE), static[:0].to(DEVICE), w_q.to(DEVICE),
                                          w_scale.to(DEVICE), torch.bfloat16)
    assert empty.shape == (0, 96) and empty.dtype == torch.bfloat16


def test_bad_inputs_are_named():
    gen = torch.Generator().manual_seed(0)
    x_q, x_scale, w_q, w_scale = _case(gen, MAX_M + 1, 32, 64)
    with pytest.raises(ValueError, match=f"at most {MAX_M} tokens"):
        TorchFp8DecodeLinear.forward(x_q, x_scale, w_q, w_scale, torch.float32)
    with pytest.raises(ValueError, match="rowwise scales"):
        TorchFp8DecodeLinear.forward(x_q[:4], x_scale[:4], w_q, torch.ones(2, 2), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        TorchFp8DecodeLinear.forward(x_q[:4].float(), x_scale[:4], w_q, w_scale, torch.float32)
    assert "block scales" in TritonFp8DecodeLinear.cannot_implement_reason(block=(128, 128))
    assert TritonFp8DecodeLinear.cannot_implement_reason() is None
