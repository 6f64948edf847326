"""GPT-OSS experts: the MXFP4 format (against transformers' own dequantization), expert biases
and the clamped SwiGLU in the Triton expert kernels (float and MXFP4 weights) against their torch
references, in every layout. Triton runs on CUDA when present, else in the interpreter."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.moe import experts_triton
from baryon.kernels.moe.expert_activation import SILU, ExpertActivation
from baryon.kernels.moe.experts_torch import fused_experts_mxfp4_reference, fused_experts_reference
from baryon.kernels.moe.routing import RoutingConfig, route_reference
from baryon.kernels.moe.tile_configs import MoETiles, TileConfig
from baryon.kernels.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(experts_triton.triton is None, reason="triton is not installed")
CLAMPED = ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.6)  # a limit the test values cross


def _random_mxfp4(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes [..., K / 2] and scales [..., K / 32] around 2^-3 (every code and sign)."""
    *rows, k = shape
    blocks = torch.randint(0, 256, (*rows, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(120, 127, (*rows, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers(seed):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(seed)
    blocks, scales = _random_mxfp4(gen, 3, 40, 96)  # [E, N, K / 2], [E, N, K / 32]
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [E, N, K]
    # transformers reads the published layout ([E, N, K / 32, 16] bytes) and returns [E, K, N]
    theirs = convert_moe_packed_tensors(blocks.view(3, 40, 3, 16), scales, dtype=torch.bfloat16)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_quantize_round_trips_representable_values(seed):
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = _random_mxfp4(gen, 5, 64)
    values = dequantize_mxfp4(blocks, scales)
    # each group's largest magnitude decides its scale: groups whose largest code is 4 or 6 round-trip
    again = dequantize_mxfp4(*quantize_mxfp4(values))
    group_max = values.abs().unflatten(-1, (-1, 32)).amax(-1) / torch.exp2(scales.float() - 127)
    exact = (group_max >= 4).repeat_interleave(32, dim=-1)
    assert exact.any()
    assert torch.equal(again[exact], values[exact])
    # and any tensor lands within half a step of the nearest code (relative to its group's scale)
    w = torch.randn(4, 96, generator=gen)
    err = (dequantize_mxfp4(*quantize_mxfp4(w)) - w).abs()
    step = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 4  # the group's scale is at most this
    assert (err.unflatten(-1, (-1, 32)) <= step).all()


def _case(gen, tokens, experts, top_k, hidden, inter, dtype):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route_reference(logits, RoutingConfig(experts, top_k, renormalize=True))
    w13_bias = (torch.randn(experts, 2 * inter, generator=gen) * 0.3).to(dtype)
    w2_bias = (torch.randn(experts, hidden, generator=gen) * 0.3).to(dtype)
    return x, weights, ids, w13_bias, w2_bias


LAYOUTS = {
    "pairs": ("pairs", TileConfig(1, 16, 64), TileConfig(1, 32, 64)),
    "scan": ("scan", TileConfig(16, 32, 64, scan=16), TileConfig(16, 16, 32, scan=32)),
    "sorted": ("sorted", TileConfig(16, 32, 64), TileConfig(32, 16, 32)),
    # the tile asks for a separate activation kernel: the clamped SwiGLU is fused anyway
    "sorted-separate-act": ("sorted", TileConfig(16, 16, 32, fuse_act=False), TileConfig(16, 32, 64)),
}
CASES = [  # (id, tokens, experts, top_k, hidden, inter)
    ("one-token", 1, 4, 2, 64, 32),
    ("uneven-k-tiles", 7, 6, 3, 96, 160),
]


@needs_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,tokens,experts,top_k,hidden,inter", CASES, ids=[c[0] for c in CASES])
def test_triton_biased_clamped_experts_match_reference(seed, monkeypatch, layout, name, tokens, experts, top_k,
                                                        hidden, inter):
    monkeypatch.setattr(experts_triton, "tile_configs", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    x, weights, ids, b13, b2 = _case(gen, tokens, experts, top_k, hidden, inter, torch.float32)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    for activation in (SILU, CLAMPED):
        expected = fused_experts_reference(x, w13, w2, weights, ids, 0, b13, b2, activation)
        got = experts_triton.TritonFusedExperts.forward(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)),
                                                        w13_bias=b13.to(DEVICE), w2_bias=b2.to(DEVICE),
                                                        activation=activation)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,tokens,experts,top_k,hidden,inter", CASES, ids=[c[0] for c in CASES])
# bf16 on CUDA only: the interpreter's bf16 tl.dot returns garbage (any kernel, Triton 3.6)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_triton_mxfp4_experts_match_reference(seed, monkeypatch, layout, name, tokens, experts, top_k, hidden,
                                              inter, dtype):
    monkeypatch.setattr(experts_triton, "_four_bit_tiles", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    x, weights, ids, b13, b2 = _case(gen, tokens, experts, top_k, hidden, inter, dtype)
    w13_blocks, w13_scales = _random_mxfp4(gen, experts, 2 * inter, hidden)
    w2_blocks, w2_scales = _random_mxfp4(gen, experts, hidden, inter)
    packed = (w13_blocks, w2_blocks, w13_scales, w2_scales)
    expected = fused_experts_mxfp4_reference(x.float(), *packed, weights, ids, 0, None, b13.float(), b2.float(),
                                             CLAMPED)
    got = experts_triton.TritonMxfp4FusedExperts.forward(
        *(t.to(DEVICE) for t in (x, *packed, weights, ids)), w13_bias=b13.to(DEVICE), w2_bias=b2.to(DEVICE),
        activation=CLAMPED)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: activations and intermediates rounded
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    # Expert parallelism: this rank holds the second half of the experts.
    half = experts // 2
    local = tuple(t[half:] for t in packed)
    expected = fused_experts_mxfp4_reference(x.float(), *local, weights, ids, half, experts, b13[half:].float(),
                                             b2[half:].float(), CLAMPED)
    got = experts_triton.TritonMxfp4FusedExperts.forward(
        *(t.to(DEVICE) for t in (x, *local, weights, ids)), expert_start=half, num_experts=experts,
        w13_bias=b13[half:].to(DEVICE), w2_bias=b2[half:].to(DEVICE), activation=CLAMPED)
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@needs_triton
def test_triton_dequantization_is_exact(seed):
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = _random_mxfp4(gen, 3, 24, 160)  # rows of 80 bytes: a partial chunk
    for dtype in (torch.float32, torch.bfloat16):
        got = experts_triton.dequantize_mxfp4_triton(blocks.to(DEVICE), scales.to(DEVICE), dtype)
        assert torch.equal(got.cpu(), dequantize_mxfp4(blocks, scales, dtype))


@needs_triton
def test_large_batches_take_the_dequantized_path(seed, monkeypatch):
    """From MXFP4_DEQUANTIZE_MIN_TOKENS tokens the experts are dequantized and the float kernels run."""
    monkeypatch.setattr(experts_triton, "MXFP4_DEQUANTIZE_MIN_TOKENS", 5)
    gen = torch.Generator().manual_seed(seed)
    x, weights, ids, b13, b2 = _case(gen, 9, 4, 2, 64, 32, torch.float32)
    packed = (*_random_mxfp4(gen, 4, 64, 64), *_random_mxfp4(gen, 4, 64, 32))
    packed = (packed[0], packed[2], packed[1], packed[3])  # w13_blocks, w2_blocks, w13_scales, w2_scales
    expected = fused_experts_mxfp4_reference(x, *packed, weights, ids, 0, None, b13, b2, CLAMPED)
    got = experts_triton.TritonMxfp4FusedExperts.forward(*(t.to(DEVICE) for t in (x, *packed, weights, ids)),
                                                         w13_bias=b13.to(DEVICE), w2_bias=b2.to(DEVICE),
                                                         activation=CLAMPED)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
