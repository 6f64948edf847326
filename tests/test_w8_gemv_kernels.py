"""The weight-only GEMV of 8-bit weights (FP8 e4m3 / INT8, rowwise or block scales) against its
float32 reference: on CUDA when present, else in Triton's interpreter (small shapes); and the FP8 /
INT8 linear methods taking it at decode batches."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.quant import w8_gemv
from baryon.kernels.quant.act_quant import FP8
from baryon.kernels.quant.fp8_decode_gemm import MAX_M as DECODE_GEMM_MAX_M
from baryon.kernels.quant.fp8_decode_gemm import TritonFp8DecodeLinear
from baryon.kernels.quant.w8_gemv import (DECODE_MAX_M, MAX_M, TorchW8Gemv, TritonW8Gemv, tile_config,
                                          w8_gemv_reference)
from baryon.kernels.triton_utils import INTERPRETED

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(w8_gemv.triton is None, reason="triton is not installed")
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def _case(gen, n, k, weight_dtype, block):
    if weight_dtype == FP8:
        w_q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    else:
        w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(shape, generator=gen) * 0.01 + 1e-3
    return w_q, scale


def _assert_close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 if out.dtype == torch.float32 else 1e-2
    top = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.cpu().float() / top, ref.cpu().float() / top, atol=tol, rtol=0)


CASES = [  # (n, k, block, tiles)
    (40, 256, None, (8, 128, 4)),        # rowwise, K a multiple of the tile
    (33, 300, None, (4, 64, 4)),         # odd N, K not a multiple of the tile
    (72, 260, (32, 64), (8, 128, 4)),    # block scales: two sub-blocks of 64 per step, partial last blocks
    (24, 200, (16, 128), (4, 64, 4)),    # block scales wider than the step
    (128, 384, (128, 128), None),        # the table's tiles, DeepSeek's blocks
    (20, 100, (16, 16), (16, 64, 2)),
]


@needs_triton
@pytest.mark.parametrize("weight_dtype", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("n,k,block,tiles", CASES)
def test_triton_gemv_matches_reference(seed, weight_dtype, n, k, block, tiles):
    gen = torch.Generator().manual_seed(seed)
    w_q, scale = _case(gen, n, k, weight_dtype, block)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    for m in range(1, MAX_M + 1):
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        with_bias = (m + n) % 2 == 0
        b = bias if with_bias else None
        out = TritonW8Gemv.forward(x.to(DEVICE), w_q.to(DEVICE), scale.to(DEVICE), block,
                                   b.to(DEVICE) if with_bias else None, tiles=tiles)
        _assert_close(out, w8_gemv_reference(x, w_q, scale, block, b))


def test_reference_is_the_dequantized_product(seed):
    gen = torch.Generator().manual_seed(seed)
    w_q, scale = _case(gen, 6, 10, FP8, (4, 4))
    x = torch.randn(2, 10, generator=gen)
    w = w_q.float() * scale.repeat_interleave(4, 0)[:6].repeat_interleave(4, 1)[:, :10]
    torch.testing.assert_close(w8_gemv_reference(x, w_q, scale, (4, 4)), x @ w.t())
    torch.testing.assert_close(TorchW8Gemv.forward(x, w_q, scale, (4, 4)), x @ w.t())


def test_bad_inputs_are_named(seed):
    gen = torch.Generator().manual_seed(seed)
    w_q, scale = _case(gen, 8, 32, FP8, None)
    x = torch.randn(1, 32, generator=gen)
    with pytest.raises(ValueError, match="scale must be"):
        TorchW8Gemv.forward(x, w_q, scale[:4])
    with pytest.raises(ValueError, match="features"):
        TorchW8Gemv.forward(x[:, :16], w_q, scale)
    with pytest.raises(ValueError, match="fp8 or int8"):
        TorchW8Gemv.forward(x, w_q.float(), scale)
    if w8_gemv.triton is not None and (DEVICE == "cuda" or INTERPRETED):
        with pytest.raises(ValueError, match="at most"):
            TritonW8Gemv.forward(torch.randn(MAX_M + 1, 32).to(DEVICE, DTYPE), w_q.to(DEVICE), scale.to(DEVICE))


def test_tile_config_table_and_block_limits():
    for m in range(1, MAX_M + 1):
        for n in (1, 4096, 6144, 151936):
            block_n, block_k, warps = tile_config(m, n)
            assert block_n >= 1 and block_k >= 16 and block_k & (block_k - 1) == 0 and warps in (1, 2, 4, 8)
    assert tile_config(1, 4096, (2, 1024, 8)) == (2, 1024, 8)
    assert "bk=48" in TritonW8Gemv.cannot_implement_reason(block=(128, 48), dtype=torch.bfloat16)
    assert TritonW8Gemv.cannot_implement_reason(block=(128, 128), dtype=torch.bfloat16) is None


@needs_triton
def test_fp8_layers_use_the_gemv_for_decode_batches(seed, monkeypatch):
    """An FP8 layer with per-channel scales routes at most DECODE_MAX_M rows to the GEMV (the
    activations not quantized), up to fp8_decode_gemm.MAX_M rows to the decode GEMM and larger
    batches to its GEMM; all follow the float32 product of the dequantized weight. (Block-scaled
    FP8 and INT8 W8A8 layers keep their GEMMs at every batch: the GEMV measured no faster for
    them; block FP8 layers have neither decode kernel.)"""
    from baryon.layers.linear import ReplicatedLinear
    from baryon.loader.quantized import process_weights_after_loading
    from baryon.quantization.fp8 import Fp8LinearMethod

    if DEVICE == "cpu":  # the interpreter: ask for the Triton kernels by name
        for family in ("W8_GEMV", "FP8_LINEAR", "ACT_QUANT", "FP8_DECODE_LINEAR"):
            monkeypatch.setenv(f"BARYON_KERNEL_{family}", "triton")
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 256
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(DEVICE), torch.no_grad():
            layer = ReplicatedLinear(k, n, bias=True)
            method = Fp8LinearMethod("channel", False, online=True)
            layer.use_method(method)
            for name, param in layer.named_parameters():
                if name == "weight" and param.dtype == FP8:
                    param.copy_((torch.randn(param.shape, generator=gen, device="cpu") * 40).to(FP8))
                elif "scale" in name:
                    param.copy_(torch.rand(param.shape, generator=gen, device="cpu") * 0.01 + 1e-3)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen, device="cpu") * 0.05)
            process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(previous)
    assert method.gemv is TritonW8Gemv and method.decode_gemm is TritonFp8DecodeLinear
    weight = method.dequantize(layer).cpu()  # float32 [N, K]
    calls = []
    for kernel, name in ((TritonW8Gemv, "gemv"), (TritonFp8DecodeLinear, "decode"), (method.kernel, "gemm")):
        original = kernel.forward
        monkeypatch.setattr(kernel, "forward", staticmethod(
            lambda *a, _name=name, _original=original, **kw: calls.append(_name) or _original(*a, **kw)))
    for m in (1, DECODE_MAX_M, DECODE_MAX_M + 1, 7, DECODE_GEMM_MAX_M, DECODE_GEMM_MAX_M + 1):
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        out = layer(x.to(DEVICE))
        ref = (x.float() @ weight.t() + layer.bias.float().cpu()).to(DTYPE)
        top = ref.float().abs().max().item()
        # the GEMM quantizes the activations too (FP8: 3 mantissa bits): a looser bound
        tol = 5e-2 if m > DECODE_MAX_M else (1e-5 if DTYPE == torch.float32 else 1e-2)
        torch.testing.assert_close(out.cpu().float() / top, ref.float() / top, atol=tol, rtol=0)
    assert calls == ["gemv", "gemv", "decode", "decode", "decode", "gemm"]
    block = Fp8LinearMethod("block", False, (128, 128), scale_name="weight_scale_inv")
    with torch.device(DEVICE):
        block.create_weights(ReplicatedLinear(k, n, bias=False))
    assert block.gemv is None and block.decode_gemm is None
