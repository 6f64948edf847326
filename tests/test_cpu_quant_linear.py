"""W8A8 and W4A16 layers on CPU through the packed block kernels (kernels/quant/cpu_block_linear.py):
the repacked blocks hold exactly the reference's weights, the exact kernel multiplies like F.linear
on them, the integer-dot kernel stays within its activation rounding."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.block_quant import CpuInt8BlockQuantLinear
from baryon.kernels.cpu import load_error
from baryon.kernels.quant.cpu_block_linear import CpuBlockInt8Linear, CpuBlockW4A16Linear
from baryon.kernels.quant.w4a16 import dequantize_reference
from baryon.quantization.int8 import quantize_int8_per_channel

pytestmark = pytest.mark.skipif(load_error() is not None, reason=f"C++ CPU kernels unavailable: {load_error()}")
CPU = torch.device("cpu")
BLOCK_KERNELS = ["cpu_float32", "cpu_int8"]


def block_kernel(monkeypatch, name: str) -> None:
    if name == "cpu_int8" and CpuInt8BlockQuantLinear.unsupported_reason(CPU):
        pytest.skip(CpuInt8BlockQuantLinear.unsupported_reason(CPU))
    monkeypatch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", name)


def check_output(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias, kernel: str) -> None:
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == exact.shape and got.dtype == x.dtype
    if kernel == "cpu_float32":
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    else:  # each activation rounded to int8 per 32 values: off by at most max|x_block| / 254
        x_blocks = x.double().reshape(x.shape[0], -1, 32)  # [M, B, 32]
        w_blocks = weight.double().abs().reshape(weight.shape[0], -1, 32).sum(-1)  # [N, B]
        bound = (x_blocks.abs().amax(-1) / 254) @ w_blocks.T  # [M, N]
        assert ((got.double() - exact).abs() <= bound * 1.001 + 1e-4).all()


@pytest.mark.parametrize("kernel", BLOCK_KERNELS)
def test_w8a8_blocks(monkeypatch, seed, kernel):
    block_kernel(monkeypatch, kernel)
    gen = torch.Generator().manual_seed(seed)
    for m, k, n, bias in [(1, 32, 1, False), (3, 96, 17, True), (16, 256, 64, False), (5, 576, 40, True)]:
        w_q, w_scale = quantize_int8_per_channel(torch.randn(n, k, generator=gen))
        weights = CpuBlockInt8Linear.prepare(w_q, w_scale.reshape(n, 1))  # compressed-tensors stores [N, 1]
        weight = w_q.float() * w_scale[:, None]
        assert torch.equal(CpuBlockInt8Linear.dequantize(weights), weight)
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        check_output(CpuBlockInt8Linear.forward_float(x, weights, b), x, weight, b, kernel)


CASES = [  # (bits, group_size, symmetric, k)
    (4, 32, True, 64), (4, 128, True, 256), (4, 128, False, 256), (4, 64, False, 192),
    (4, 256, True, 256),  # one group per row (the channel strategy)
    (8, 32, True, 96), (8, 128, False, 256),
]


@pytest.mark.parametrize("kernel", BLOCK_KERNELS)
@pytest.mark.parametrize("bits,group,symmetric,k", CASES)
def test_w4a16_blocks(monkeypatch, seed, kernel, bits, group, symmetric, k):
    block_kernel(monkeypatch, kernel)
    gen = torch.Generator().manual_seed(seed)
    n, groups = 24, k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    # Checkpoints keep scales in half precision; bfloat16 values widened to float32 here.
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16).float()
    zeros = (torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8) if symmetric
             else torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.uint8))
    weights = CpuBlockW4A16Linear.prepare(codes, scales, zeros, bits, group)
    weight = dequantize_reference(codes, scales, zeros, group)
    assert torch.equal(CpuBlockW4A16Linear.dequantize(weights), weight)
    assert weights.bits == (4 if bits == 4 and symmetric else 8)  # asymmetric 4-bit: codes minus zeros
    for m, bias in [(1, False), (7, True), (33, False)]:
        x = torch.randn(2, m, k, generator=gen)  # leading dimensions are kept
        b = torch.randn(n, generator=gen) if bias else None
        got = CpuBlockW4A16Linear.forward(x, weights, b)
        assert got.shape == (2, m, n)
        check_output(got.reshape(-1, n), x.reshape(-1, k), weight, b, kernel)


def test_shapes_the_blocks_cannot_hold_are_declined():
    assert "multiple of 32" in CpuBlockW4A16Linear.cannot_implement_reason(in_features=256, group_size=48)
    assert "multiple of 32" in CpuBlockInt8Linear.cannot_implement_reason(in_features=100)
    assert "float32" in CpuBlockW4A16Linear.cannot_implement_reason(in_features=256, dtype=torch.bfloat16)
    assert "bits" in CpuBlockW4A16Linear.cannot_implement_reason(in_features=256, bits=3)
