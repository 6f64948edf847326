"""FP8 GEMMs (family fp8_linear) against the float32 reference, in both scale layouts (rowwise and
bn x bk blocks with partial last blocks): the torch kernel, the Triton kernel (on CUDA when present,
else in Triton's interpreter, which handles float8_e4m3fn loads and tl.dot on them) and
torch's scaled_mm (CUDA only; its scale layouts are also checked on CPU against torch's own shape
rules through meta tensors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baryon.kernels.quant import fp8_gemm
from baryon.kernels.quant.act_quant import FP8, FP8_MAX, quantize_per_group_reference, quantize_per_token_reference
from baryon.kernels.quant.fp8_gemm import (ScaledMMFp8Linear, TileConfig, TorchFp8Linear, TritonFp8Linear,
                                           dequantize_weight_reference, fp8_linear_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(fp8_gemm.triton is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's scaled_mm runs on CUDA only")

# (N, K, block): K and N not multiples of the block for the small blocks and for 128 x 128.
LAYOUTS = [(150, 200, None), (150, 200, (48, 32)), (100, 176, (32, 64)), (150, 200, (128, 128))]


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float32 -> (w_q fp8 [N, K], scale [N] or [ceil(N / bn), ceil(K / bk)]), w ~= w_q * scale."""
    if block is None:
        q, scale = quantize_per_token_reference(w, FP8)
        return q, scale.reshape(-1)
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX  # [nb, kb]
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def make_case(seed: int, m: int, n: int, k: int, block: tuple[int, int] | None, with_bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) if with_bias else None
    w_q, w_scale = quantize_weight(w, block)
    if block is None:
        x_q, x_scale = quantize_per_token_reference(x, FP8)  # [M, 1]
    else:
        x_q, x_scale = quantize_per_group_reference(x, block[1], FP8)  # [M, ceil(K / bk)]
    return x_q, x_scale, w_q, w_scale, bias


def to_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def assert_matches(out: torch.Tensor, ref: torch.Tensor, exact_device: bool) -> None:
    """Interpreted float32: only the summation order differs. On the GPU the tensor cores sum
    FP8 products in reduced precision within a K tile, and bf16 outputs round."""
    tight = exact_device and out.dtype == torch.float32
    tol = 1e-5 if tight else 2e-2
    scale = float(ref.float().abs().max()) + 1e-6
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol * scale, rtol=tol)


def test_reference_applies_each_block_scale(seed):
    """The reference's block expansion against indexing written out: w[n, k] = q * s[n // bn, k // bk]."""
    n, k, block = 37, 70, (16, 32)
    x_q, x_scale, w_q, w_scale, bias = make_case(seed, 3, n, k, block, True)
    rows, cols = torch.arange(n) // 16, torch.arange(k) // 32
    w = w_q.float() * w_scale[rows][:, cols]
    x = x_q.float() * x_scale[:, cols]
    torch.testing.assert_close(dequantize_weight_reference(w_q, w_scale, block), w, atol=0, rtol=0)
    expected = x @ w.t() + bias
    torch.testing.assert_close(fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, block),
                               expected, atol=1e-5, rtol=1e-5)
    # Rowwise: per-token activations, per-channel weights; one static value broadcasts.
    x_q, x_scale, w_q, w_scale, _ = make_case(seed, 3, n, k, None, False)
    ref = fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32)
    expected = (x_q.float() * x_scale) @ (w_q.float() * w_scale[:, None]).t()
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    static = torch.tensor(0.02)
    torch.testing.assert_close(fp8_linear_reference(x_q, static.expand(3, 1), w_q, w_scale, torch.float32),
                               fp8_linear_reference(x_q, static, w_q, w_scale, torch.float32), atol=0, rtol=0)


@pytest.mark.parametrize("n,k,block", LAYOUTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_kernel_is_the_reference(seed, n, k, block, with_bias):
    x_q, x_scale, w_q, w_scale, bias = make_case(seed, 5, n, k, block, with_bias)
    weights = TorchFp8Linear.prepare(w_q, w_scale, block)
    out = TorchFp8Linear.forward(x_q, x_scale, weights, torch.bfloat16, bias)
    assert out.shape == (5, n) and out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.bfloat16, bias, block))


@pytest.mark.parametrize("kernel", [TorchFp8Linear, TritonFp8Linear, ScaledMMFp8Linear])
@pytest.mark.parametrize("n,k,block", LAYOUTS + [(256, 384, (128, 128)), (256, 1024, (128, 128))])
def test_dequantize_is_exact(seed, kernel, n, k, block):
    if kernel is ScaledMMFp8Linear and block is not None and (block != (128, 128) or n % 128 or k % 128):
        pytest.skip("scaled_mm takes whole 128 x 128 blocks only")
    _, _, w_q, w_scale, _ = make_case(seed, 1, n, k, block, False)
    weights = kernel.prepare(w_q, w_scale, block)
    assert (weights.in_features, weights.out_features, weights.block) == (k, n, block)
    assert torch.equal(kernel.dequantize(weights), dequantize_weight_reference(w_q, w_scale, block))


@needs_triton
@pytest.mark.parametrize("n,k,block", LAYOUTS)
@pytest.mark.parametrize("m", [1, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_reference(seed, n, k, block, m, with_bias):
    x_q, x_scale, w_q, w_scale, bias = to_device(*make_case(seed, m, n, k, block, with_bias))
    weights = TritonFp8Linear.prepare(w_q, w_scale, block)
    out = TritonFp8Linear.forward(x_q, x_scale, weights, torch.float32, bias)
    ref = fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, block)
    assert_matches(out, ref, DEVICE == "cpu")


@needs_triton
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_triton_prefill_tiles_bf16(seed, block):
    """A prefill-sized tile (M > 512: 128 x 128 tiles, grouped order), bf16 out with a bf16 bias."""
    x_q, x_scale, w_q, w_scale, bias = to_device(*make_case(seed, 600, 150, 200, block, True))
    bias = bias.to(torch.bfloat16)
    weights = TritonFp8Linear.prepare(w_q, w_scale, block)
    out = TritonFp8Linear.forward(x_q, x_scale, weights, torch.bfloat16, bias)
    assert out.dtype == torch.bfloat16
    assert_matches(out, fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, block), False)


@needs_triton
@pytest.mark.parametrize("block", [None, (32, 64)])
def test_triton_small_tiles(seed, block):
    """Forced small tiles: several row tiles in one group and one across groups, many K tiles,
    BLOCK_K (32) smaller than bk (64) so two K tiles share each block's scale."""
    x_q, x_scale, w_q, w_scale, bias = to_device(*make_case(seed, 50, 100, 176, block, True))
    weights = TritonFp8Linear.prepare(w_q, w_scale, block)
    config = TileConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)
    out = TritonFp8Linear.forward(x_q, x_scale, weights, torch.float32, bias, config=config)
    ref = fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, block)
    assert_matches(out, ref, DEVICE == "cpu")


@needs_triton
def test_triton_static_scale_and_empty_batch(seed):
    """A static per-tensor activation scale expanded to [M, 1] (stride 0), and M = 0."""
    _, _, w_q, w_scale, _ = make_case(seed, 1, 64, 96, None, False)
    gen = torch.Generator().manual_seed(seed)
    x_q = (torch.randn(9, 96, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    x_q, w_q, w_scale = to_device(x_q, w_q, w_scale)
    static = torch.tensor([0.013], device=DEVICE).expand(9, 1)
    weights = TritonFp8Linear.prepare(w_q, w_scale, None)
    out = TritonFp8Linear.forward(x_q, static, weights, torch.float32)
    assert_matches(out, fp8_linear_reference(x_q, static, w_q, w_scale, torch.float32), DEVICE == "cpu")
    empty = TritonFp8Linear.forward(x_q[:0], static[:0], weights, torch.bfloat16)
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_layouts_pass_torch_shape_checks(m, block, with_bias):
    """The tensors scaled_mm hands to torch (on meta tensors: torch's own size / stride rules,
    no GPU): row-major a, column-major b, [M, 1] and [1, N] rowwise scales; M-major 1x128 scales
    and [L4, N/128] (1, L4)-strided 128x128 scales, with K/128 = 3 so L4 pads."""
    if block is not None and fp8_gemm._scaled_mm_api() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    n, k = 256, 384
    w_q = torch.zeros(n, k, dtype=FP8)
    w_scale = torch.ones(n // 128, k // 128) if block else torch.ones(n)
    weights = ScaledMMFp8Linear.prepare(w_q, w_scale, block)
    if block is not None:
        assert tuple(weights.scale.shape) == (4, 2) and weights.scale.stride() == (1, 4)
    weights.weight, weights.scale = weights.weight.to("meta"), weights.scale.to("meta")
    x_q = torch.empty(m, k, dtype=FP8, device="meta")
    x_scale = torch.empty(m, 1 if block is None else k // 128, device="meta")
    bias = torch.empty(n, dtype=torch.bfloat16, device="meta") if with_bias else None
    out = ScaledMMFp8Linear.forward(x_q, x_scale, weights, torch.bfloat16, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16


@needs_cuda
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 70, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_matches_reference(seed, block, m, with_bias):
    n, k = 256, 384
    reason = (ScaledMMFp8Linear.unsupported_reason(torch.device("cuda"))
              or ScaledMMFp8Linear.cannot_implement_reason(in_features=k, out_features=n, block=block,
                                                           dtype=torch.bfloat16))
    if reason:
        pytest.skip(reason)
    x_q, x_scale, w_q, w_scale, bias = to_device(*make_case(seed, m, n, k, block, with_bias))
    bias = None if bias is None else bias.to(torch.bfloat16)
    weights = ScaledMMFp8Linear.prepare(w_q, w_scale, block)
    out = ScaledMMFp8Linear.forward(x_q, x_scale, weights, torch.bfloat16, bias)
    assert out.dtype == torch.bfloat16
    assert_matches(out, fp8_linear_reference(x_q, x_scale, w_q, w_scale, torch.float32, bias, block), False)


def test_selector_and_reasons(monkeypatch):
    from baryon.kernels import selector
    from baryon.kernels.triton_utils import INTERPRETED

    cpu = torch.device("cpu")
    config = dict(in_features=4096, out_features=4096, block=(128, 128), dtype=torch.bfloat16)
    assert selector.select("fp8_linear", cpu, **config).name == "torch"
    assert "CUDA" in ScaledMMFp8Linear.unsupported_reason(cpu)
    assert "16" in ScaledMMFp8Linear.cannot_implement_reason(in_features=100, out_features=64, block=None,
                                                             dtype=torch.bfloat16)
    assert "block" in ScaledMMFp8Linear.cannot_implement_reason(in_features=4096, out_features=4096,
                                                                block=(64, 64), dtype=torch.bfloat16)
    assert "float32" in ScaledMMFp8Linear.cannot_implement_reason(in_features=4096, out_features=4096,
                                                                  block=None, dtype=torch.float32)
    assert "bk" in TritonFp8Linear.cannot_implement_reason(in_features=64, out_features=64, block=(16, 16),
                                                           dtype=torch.bfloat16)
    assert TritonFp8Linear.cannot_implement_reason(in_features=200, out_features=150, block=(48, 32),
                                                   dtype=torch.float32) is None
    if fp8_gemm.triton is None or not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter (TRITON_INTERPRET=1 before import)")
    monkeypatch.setenv("BARYON_KERNEL_FP8_LINEAR", "triton")
    assert selector.select("fp8_linear", cpu, **config).name == "triton"
