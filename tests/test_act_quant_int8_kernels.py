"""Activation quantization (Triton) and the W8A8 INT8 GEMM (Triton and torch) against the
references: on CUDA when present, else in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest) on small shapes.

Exactness: on CPU every result must equal the reference bit for bit (float32 GEMM outputs too).
On CUDA the reference divides amax by the Python scalar qmax as a multiply by its reciprocal
(torch's div by a CPU scalar), so its dynamic scales may be one ulp from the kernel's correctly
rounded quotient, and an element next to a rounding boundary may land one quantization step away;
the GPU tolerances below allow exactly that (and an FMA in the GEMM epilogue). The interpreter's
float32 -> bfloat16 cast truncates, so bf16 GEMM outputs get bf16 tolerances on both.
"""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.quant import act_quant as aq
from baryon.kernels.quant import int8_gemm as ig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
FP8 = torch.float8_e4m3fn
QDTYPES = [pytest.param(FP8, id="fp8"), pytest.param(torch.int8, id="int8")]
needs_triton = pytest.mark.skipif(aq.triton is None, reason="triton is not installed")


def _activations(gen: torch.Generator, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero, and an outlier."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]
    if m > 2:
        x[1] = 0.0
        x[2, k // 2] = 300.0
    return x.to(dtype).to(DEVICE)


def assert_scales(scale: torch.Tensor, ref: torch.Tensor) -> None:
    assert scale.dtype == torch.float32 and scale.shape == ref.shape
    assert torch.isfinite(scale).all()
    if ON_GPU:  # the reference multiplies by 1 / qmax there: one ulp apart at most
        torch.testing.assert_close(scale, ref, rtol=2.5e-7, atol=0)
    else:
        assert torch.equal(scale, ref)


def assert_quantized(q: torch.Tensor, ref: torch.Tensor, exact: bool = not ON_GPU) -> None:
    assert q.dtype == ref.dtype and q.shape == ref.shape and q.is_contiguous()
    qf, rf = q.float(), ref.float()
    assert not torch.isnan(qf).any()
    if exact:
        assert torch.equal(qf, rf), f"{int((qf != rf).sum())} of {qf.numel()} differ"
        return
    # One quantization step: 1 for int8; for e4m3 at most an eighth of the value (2**-9 subnormal).
    step = torch.ones_like(qf) if q.dtype == torch.int8 else torch.maximum(qf.abs(), rf.abs()) / 8 + 2.0**-9
    assert ((qf - rf).abs() <= step).all()
    assert int((qf != rf).sum()) <= max(1, qf.numel() // 100)


# -------------------------------------------------------------------------------------------------
# Activation quantization
# -------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 100, 256])
def test_triton_per_token_matches_reference(seed, dtype, x_dtype, k):
    x = _activations(torch.Generator().manual_seed(seed), 6, k, x_dtype)
    q, scale = aq.TritonActQuant.per_token(x, dtype)
    ref_q, ref_scale = aq.quantize_per_token_reference(x, dtype)
    assert scale.shape == (6, 1)
    assert_scales(scale, ref_scale)
    assert_quantized(q, ref_q)


@needs_triton
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size,k", [(128, 300), (128, 256), (32, 72), (16, 200)])
def test_triton_per_group_matches_reference(seed, dtype, x_dtype, group_size, k):
    """K not a multiple of the group: the last group is short."""
    x = _activations(torch.Generator().manual_seed(seed), 5, k, x_dtype)
    q, scale = aq.TritonActQuant.per_group(x, group_size, dtype)
    ref_q, ref_scale = aq.quantize_per_group_reference(x, group_size, dtype)
    assert scale.shape == (5, -(-k // group_size))
    assert_scales(scale, ref_scale)
    assert_quantized(q, ref_q)


@needs_triton
@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_long_rows_loop_over_chunks(seed, dtype, monkeypatch):
    """Rows or groups longer than a register tile take the chunked two-pass kernel (shrunk here
    so that small shapes reach it: several chunks and a short last one)."""
    monkeypatch.setattr(aq, "MAX_BLOCK", 64)
    monkeypatch.setattr(aq, "LONG_CHUNK", 32)
    x = _activations(torch.Generator().manual_seed(seed), 4, 300, torch.bfloat16)
    q, scale = aq.TritonActQuant.per_token(x, dtype)
    ref_q, ref_scale = aq.quantize_per_token_reference(x, dtype)
    assert_scales(scale, ref_scale)
    assert_quantized(q, ref_q)
    q, scale = aq.TritonActQuant.per_group(x, 100, dtype)
    ref_q, ref_scale = aq.quantize_per_group_reference(x, 100, dtype)
    assert_scales(scale, ref_scale)
    assert_quantized(q, ref_q)


@needs_triton
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_triton_static_matches_reference(seed, dtype, scale_shape):
    """One scale for the tensor; values past qmax * scale saturate. No scale is computed, so the
    GPU matches exactly too."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 77, generator=gen) * 3).to(DEVICE)
    scale = torch.full(scale_shape, 0.0123, device=DEVICE)
    x[0, :4] = torch.tensor([1e4, -1e4, 448 * 0.0123, -127.5 * 0.0123])
    q = aq.TritonActQuant.static(x, scale, dtype)
    assert_quantized(q, aq.quantize_static_reference(x, scale, dtype), exact=True)


@needs_triton
def test_triton_rounding_ties_and_every_fp8_value():
    """Static scale 1: every e4m3 value, the midpoints between neighbours (ties to even), just
    either side of them, subnormals; half-integers for int8 (round half to even)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    values = codes[torch.isfinite(codes)].unique()
    mids = (values[1:] + values[:-1]) / 2
    nudged = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    x = torch.cat([values, mids, nudged, torch.tensor([500.0, -1e6])]).reshape(1, -1).to(DEVICE)
    one = torch.ones((), device=DEVICE)
    assert_quantized(aq.TritonActQuant.static(x, one, FP8), aq.quantize_static_reference(x, one, FP8), exact=True)
    halves = (torch.arange(-300, 301, dtype=torch.float32) / 2).reshape(1, -1).to(DEVICE)
    assert_quantized(aq.TritonActQuant.static(halves, one, torch.int8),
                     aq.quantize_static_reference(halves, one, torch.int8), exact=True)


@needs_triton
@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_zero_rows_and_empty_batches(dtype):
    x = torch.zeros(3, 130, dtype=torch.bfloat16, device=DEVICE)
    for q, scale in (aq.TritonActQuant.per_token(x, dtype), aq.TritonActQuant.per_group(x, 128, dtype)):
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert not torch.isnan(q.float()).any() and (q.float() == 0).all()
    q, scale = aq.TritonActQuant.per_group(x[:0], 128, dtype)
    assert q.shape == (0, 130) and scale.shape == (0, 2)
    assert aq.TritonActQuant.per_token(x[:0], dtype)[1].shape == (0, 1)


@needs_triton
def test_triton_act_quant_strided_rows(seed):
    """A column slice (row stride > K) quantizes like its contiguous copy."""
    x = _activations(torch.Generator().manual_seed(seed), 4, 200, torch.bfloat16)[:, 30:158]
    for dtype in (FP8, torch.int8):
        q, scale = aq.TritonActQuant.per_token(x, dtype)
        ref_q, ref_scale = aq.quantize_per_token_reference(x.contiguous(), dtype)
        assert_scales(scale, ref_scale)
        assert_quantized(q, ref_q)


def test_selector_keeps_triton_off_the_cpu_unless_forced(monkeypatch):
    from baryon.kernels import selector
    from baryon.kernels.cpu import load_error
    from baryon.kernels.quant.int8_zentorch import ZentorchInt8Linear
    from baryon.kernels.triton_utils import INTERPRETED

    cpu = torch.device("cpu")
    assert selector.select("act_quant", cpu).name == "torch"
    expected = ("cpu" if load_error() is None
                else "zentorch" if ZentorchInt8Linear.unsupported_reason(cpu) is None else "torch")
    assert selector.select("int8_linear", cpu, in_features=64, out_features=32, dtype=torch.float32).name == expected
    assert selector.select("int8_linear", cpu, in_features=48, out_features=32, dtype=torch.bfloat16).name == "torch"
    if aq.triton is None or not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs triton and the interpreter")
    monkeypatch.setenv("BARYON_KERNEL_ACT_QUANT", "triton")
    assert selector.select("act_quant", cpu).name == "triton"
    monkeypatch.setenv("BARYON_KERNEL_INT8_LINEAR", "triton")
    assert selector.select("int8_linear", cpu, in_features=64, out_features=32, dtype=torch.bfloat16).name == "triton"
    with pytest.raises(ValueError, match="activation dtype"):
        selector.select("int8_linear", cpu, in_features=64, out_features=32, dtype=torch.int8)


# -------------------------------------------------------------------------------------------------
# INT8 GEMM
# -------------------------------------------------------------------------------------------------


def _int8_layer(gen: torch.Generator, m: int, n: int, k: int):
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    x_scale = torch.rand(m, 1, generator=gen) * 0.05 + 1e-3
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-4  # compressed-tensors stores [N, 1]
    bias = torch.randn(n, generator=gen)
    return [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale, bias)]


def assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> None:
    assert out.dtype == out_dtype and out.shape == ref.shape
    if out_dtype == torch.float32 and not ON_GPU:
        assert torch.equal(out, ref)  # K <= 1040 here: every partial sum is exact in float32
    elif out_dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # an FMA for the bias
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


GEMM_CASES = [  # (m, n, k, tile): tile None takes the heuristic
    pytest.param(1, 72, 100, None, id="decode-oddK"),
    pytest.param(3, 40, 64, None, id="decode-evenK"),
    pytest.param(50, 72, 100, ig.Int8Tile(16, 16, 32, group_m=2), id="M>tile-swizzle-oddK"),
    pytest.param(40, 48, 96, ig.Int8Tile(16, 16, 32, group_m=2, tma=True), id="M>tile-tma"),
    pytest.param(300, 96, 80, None, id="prefill-tma"),
    pytest.param(300, 40, 72, None, id="prefill-unaligned-K"),
]


@needs_triton
@pytest.mark.parametrize("m,n,k,tile", GEMM_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_int8_linear_matches_reference(seed, m, n, k, tile, with_bias, out_dtype):
    x_q, x_scale, w_q, w_scale, bias = _int8_layer(torch.Generator().manual_seed(seed), m, n, k)
    bias = bias if with_bias else None
    weights = ig.TritonInt8Linear.prepare(w_q, w_scale)
    out = ig.TritonInt8Linear.forward(x_q, x_scale, weights, out_dtype, bias, tile=tile)
    assert_gemm_close(out, ig.int8_linear_reference(x_q, x_scale, w_q, w_scale.view(-1), out_dtype, bias), out_dtype)


def test_int8_tiles_take_tma_only_on_aligned_rows():
    assert ig.int8_tile(300, 96, 80).tma and ig.int8_tile(300, 96, 72).tma  # the launch checks alignment
    if ig.TensorDescriptor is not None:
        assert ig._tma_ok(torch.zeros(4, 80, dtype=torch.int8))
        assert not ig._tma_ok(torch.zeros(4, 72, dtype=torch.int8))


@pytest.mark.parametrize("m,n,k", [(1, 72, 100), (37, 24, 72), (5, 16, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_int8_linear_matches_reference(seed, m, n, k, with_bias):
    x_q, x_scale, w_q, w_scale, bias = _int8_layer(torch.Generator().manual_seed(seed), m, n, k)
    bias = bias if with_bias else None
    weights = ig.TorchInt8Linear.prepare(w_q, w_scale)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = ig.TorchInt8Linear.forward(x_q, x_scale, weights, out_dtype, bias)
        ref = ig.int8_linear_reference(x_q, x_scale, w_q, w_scale.view(-1), out_dtype, bias)
        assert out.dtype == out_dtype and torch.equal(out, ref)


IMPLS = [pytest.param(ig.TorchInt8Linear, id="torch"),
         pytest.param(ig.TritonInt8Linear, id="triton", marks=needs_triton)]


@pytest.mark.parametrize("impl", IMPLS)
def test_int8_prepare_and_dequantize_exact(seed, impl):
    _, _, w_q, w_scale, _ = _int8_layer(torch.Generator().manual_seed(seed), 1, 24, 40)
    weights = impl.prepare(w_q.t().contiguous().t(), w_scale)  # a column-major view: repacked
    assert (weights.in_features, weights.out_features) == (40, 24)
    assert weights.w_q.is_contiguous() and weights.w_scale.shape == (24,) and weights.w_scale.dtype == torch.float32
    dq = impl.dequantize(weights)
    assert dq.dtype == torch.float32 and dq.shape == (24, 40)
    assert torch.equal(dq, (w_q.double() * w_scale.double()).float())  # one rounding of the exact product
    with pytest.raises(ValueError):
        impl.prepare(w_q.float(), w_scale)


@pytest.mark.parametrize("impl", IMPLS)
def test_int8_linear_batch_dims_static_scale_and_empty(seed, impl):
    x_q, _, w_q, w_scale, bias = _int8_layer(torch.Generator().manual_seed(seed), 6, 32, 64)
    weights = impl.prepare(w_q, w_scale)
    static = torch.tensor(0.02, device=DEVICE)  # one scale for the tensor
    out = impl.forward(x_q.view(2, 3, 64), static, weights, torch.float32, bias)
    ref = ig.int8_linear_reference(x_q, static, w_q, w_scale.view(-1), torch.float32, bias)
    assert out.shape == (2, 3, 32)
    assert_gemm_close(out.view(6, 32), ref, torch.float32)
    empty = impl.forward(x_q[:0], torch.ones(0, 1, device=DEVICE), weights, torch.bfloat16)
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16


@needs_triton
def test_triton_quantize_then_gemm_approximates_the_float_layer(seed):
    """End to end: bf16 activations -> int8 per token -> GEMM ~ x @ dequantized(w).T."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 128, generator=gen).to(DEVICE)
    w = torch.randn(48, 128, generator=gen)
    w_scale = w.abs().amax(1) / 127
    w_q = torch.round(w / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
    weights = ig.TritonInt8Linear.prepare(w_q.to(DEVICE), w_scale.to(DEVICE))
    x_q, x_scale = aq.TritonActQuant.per_token(x, torch.int8)
    out = ig.TritonInt8Linear.forward(x_q, x_scale, weights, torch.float32)
    expected = x @ ig.TritonInt8Linear.dequantize(weights).T
    assert (out - expected).abs().max() < 0.05 * expected.abs().max()


def test_int8_cannot_implement_reasons():
    reason = ig.TritonInt8Linear.cannot_implement_reason
    assert reason(in_features=4096, out_features=11008, dtype=torch.bfloat16) is None
    assert ig.TritonInt8Linear.cannot_implement_reason(in_features=100, out_features=3, dtype=torch.float32) is None
    assert "dtype" in ig.TritonInt8Linear.cannot_implement_reason(in_features=64, out_features=64, dtype=torch.int8)
    assert ig.TorchInt8Linear.cannot_implement_reason(in_features=64, out_features=64, dtype=torch.int8) is None


def test_int8_tile_heuristic():
    decode = ig.int8_tile(1, 4096, 4096)
    assert decode.block_m == 16 and decode.block_k == 256 and 4096 // decode.block_n >= 132
    assert ig.int8_tile(8, 28672, 4096).block_n == 64
    prefill = ig.int8_tile(4096, 4096, 4096)
    assert (prefill.block_m, prefill.block_n, prefill.block_k, prefill.group_m) == (128, 256, 128, 8)
    assert prefill.num_stages in (3, 4) and prefill.num_warps == 8
    assert (ig.int8_tile(8192, 1024, 4096).block_n, ig.int8_tile(1024, 1024, 4096).block_n) == (256, 128)
    assert ig.int8_tile(5, 3, 7) == ig.Int8Tile(16, 16, 32, group_m=1, num_warps=4, num_stages=4)
