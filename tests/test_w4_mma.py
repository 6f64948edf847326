"""The tensor-core W4A16 decode GEMM (`w4_mma`) against the float32 reference: its layout, every
group and zero-point mode, batches of one to MAX_M rows, K split over programs (in-kernel ordered
reduction), float16 and bfloat16 on CUDA, float32 in Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.quant import w4_mma
from baryon.kernels.quant.w4a16 import TritonW4A16Linear, dequantize_reference, w4a16_linear_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cpu" else [torch.bfloat16, torch.float16]
pytestmark = pytest.mark.skipif(w4_mma.triton is None, reason="triton is not installed")


def _case(gen, n, k, group_size, zero_mode, scale_dtype=torch.float32):
    """codes [N, K], scales [N, G], zeros [N, G]: zero_mode "sym" (8), "shared" (one other value)
    or "per-group"."""
    groups = 1 if group_size <= 0 or group_size >= k else -(-k // group_size)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    if zero_mode == "per-group":
        zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    else:
        value = 8 if zero_mode == "sym" else int(torch.randint(0, 16, (1,), generator=gen))
        zeros = torch.full((n, groups), value, dtype=torch.uint8)
    return codes, scales, zeros


@pytest.mark.parametrize("n,k", [(16, 128), (70, 300), (130, 77)])
def test_pack_roundtrip_and_layout(seed, n, k):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    q = w4_mma.pack(codes)
    kp, np_ = -(-k // 128) * 128, -(-n // 64) * 64
    assert q.dtype == torch.int16 and q.shape == (kp // 128, np_, 32)
    assert torch.equal(w4_mma.unpack(q, n, k), codes)
    # element e of block b holds column 128 b + 32 j + e in nibble j
    b, row, e, j = k // 128, n - 1, 5, 2
    col = min(128 * b + 32 * j + e, k - 1)
    b, j, e = col // 128, col % 128 // 32, col % 32
    assert (int(q[b, row, e]) >> (4 * j)) & 15 == int(codes[row, col])


@pytest.mark.parametrize("kind, dtype", [("bf16x2", torch.bfloat16), ("f16x2", torch.float16)])
def test_nibble_asm_gives_code_minus_center(seed, kind, dtype):
    """The GPU's inline PTX for nibble j of a 16-bit element (w4_mma._asm, which the interpreter
    never runs), executed on the host by tests/ptx_lanes.py over 1,024 random elements and the
    extremes: exactly ((h >> 4 j) & 15) - 8."""
    import ptx_lanes

    gen = torch.Generator().manual_seed(seed)
    h = torch.cat([torch.tensor([-32768, -1, 0, 32767]),
                   torch.randint(-32768, 32768, (1020,), generator=gen)]).to(torch.int16)
    words = ptx_lanes.pack(h)
    for j in range(4):
        asm = w4_mma._asm(j, kind)
        got = ptx_lanes.unpack([ptx_lanes.run(asm, [w], 1)[0] for w in words], dtype)
        expected = (((h.to(torch.int32) >> (4 * j)) & 15) - w4_mma.CENTER).to(dtype)
        assert torch.equal(got, expected), f"nibble {j}"


def test_supports():
    assert w4_mma.supports(4, 128, 4096) and w4_mma.supports(4, 32, 4096) and w4_mma.supports(4, 64, 4096)
    assert w4_mma.supports(4, 256, 4096) and w4_mma.supports(4, -1, 4096) and w4_mma.supports(4, 5000, 4096)
    assert not w4_mma.supports(8, 128, 4096)  # 8-bit codes do not fit a bf16 mantissa
    assert not w4_mma.supports(4, 16, 4096) and not w4_mma.supports(4, 40, 4096) and not w4_mma.supports(4, 192, 4096)


CASES = [  # (n, k, group_size, zero_mode, m)
    (64, 256, 128, "sym", 1),
    (70, 300, 32, "per-group", 3),     # padded N and K, groups of one dot
    (128, 384, 64, "shared", 20),      # groups of two dots, 32-row token tile
    (40, 512, 256, "per-group", 17),   # groups of two blocks
    (33, 200, -1, "per-group", 5),     # channel strategy, K not a multiple of the block
    (64, 256, 300, "shared", 1),       # one group per row given as a group larger than K
    (96, 256, 128, "sym", 100),        # two token tiles of 64
]


@pytest.mark.parametrize("n,k,group_size,zero_mode,m", CASES)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_matmul_matches_reference(seed, n, k, group_size, zero_mode, m, split_k):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[(n + m + split_k) % len(DTYPES)]
    codes, scales, zeros = _case(gen, n, k, group_size, zero_mode, torch.float16 if dtype == torch.float16
                                 else torch.float32)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if split_k != 2 else None
    weights = TritonW4A16Linear.prepare(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 4, group_size)
    assert weights.layout == "triton-mma" and (weights.zeros is None) == (zero_mode != "per-group")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = w4_mma.MmaTiles(block_m, 64, split_k)
    out = TritonW4A16Linear.forward(x.to(DEVICE), weights, None if bias is None else bias.to(DEVICE), tiles=tiles)
    ref = w4a16_linear_reference(x.float(), codes, scales, zeros, group_size, None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.cpu().float() / scale, ref / scale, atol=tol, rtol=0)
    again = TritonW4A16Linear.forward(x.to(DEVICE), weights, None if bias is None else bias.to(DEVICE), tiles=tiles)
    assert torch.equal(out, again)  # the slices are added in order


def test_default_tiles_and_dequantized_path(seed, monkeypatch):
    """forward's own choices: the kernel up to MAX_M rows, past it the weight dequantized to x's
    dtype (float32 (code - zero) * scale rounded once) and cuBLAS."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[0]
    codes, scales, zeros = _case(gen, 72, 256, 64, "per-group")
    weights = TritonW4A16Linear.prepare(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 4, 64)
    w = TritonW4A16Linear.dequantize_to(weights, dtype)
    assert torch.equal(w.cpu(), dequantize_reference(codes, scales, zeros, 64).to(dtype))
    monkeypatch.setattr(w4_mma, "MAX_M", 4)
    for m in (1, 4, 9):  # the last one past the (lowered) MAX_M
        x = torch.randn(m, 256, generator=gen).to(dtype)
        out = TritonW4A16Linear.forward(x.to(DEVICE), weights)
        ref = w4a16_linear_reference(x.float(), codes, scales, zeros, 64, None)
        torch.testing.assert_close(out.cpu().float() / ref.abs().max(), ref / ref.abs().max(),
                                   atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


def test_tiles_for_an_h100():
    cpu = torch.device("cpu")

    def cfg(m, n, k):
        return w4_mma.tiles_for(m, n, k, cpu, num_sms=132)

    assert cfg(1, 4096, 4096) == w4_mma.MmaTiles(16, 64, split_k=8, num_warps=4, num_stages=3)
    assert cfg(1, 24576, 4096) == w4_mma.MmaTiles(16, 128, split_k=2, num_warps=8, num_stages=3)
    assert cfg(2, 24576, 4096) == w4_mma.MmaTiles(16, 64, split_k=1, num_warps=4, num_stages=3)
    assert cfg(1, 6144, 4096).split_k == 4
    assert cfg(64, 4096, 12288) == w4_mma.MmaTiles(64, 128, split_k=8, num_warps=8, num_stages=3)
    assert cfg(1, 64, 256).split_k == 1  # too little K to split
    assert cfg(64, 4160, 4096).block_n == 64  # 128-row tiles do not divide 4,160 rows
    for m, block_m in ((1, 16), (16, 16), (17, 32), (33, 64), (128, 64)):
        assert cfg(m, 4096, 4096).block_m == block_m


def test_refusals(seed):
    gen = torch.Generator().manual_seed(seed)
    with pytest.raises(ValueError, match="triton-mma layout takes 4-bit codes"):
        TritonW4A16Linear.prepare(*_case(gen, 64, 256, 16, "sym"), 4, 16, layout="triton-mma")
    codes, scales, zeros = _case(gen, 64, 256, 128, "sym")
    weights = TritonW4A16Linear.prepare(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 4, 128)
    x = torch.randn(1, 256).to(DTYPES[0]).to(DEVICE)
    with pytest.raises(ValueError, match="block_n=128 does not divide"):
        TritonW4A16Linear.forward(x, weights, tiles=w4_mma.MmaTiles(16, 128))
    from baryon.kernels.quant.w4a16 import GemvTiles
    with pytest.raises(ValueError, match="GemvTiles are not tiles of the triton-mma"):
        TritonW4A16Linear.forward(x, weights, tiles=GemvTiles(1, 1))
    with pytest.raises(ValueError, match="at most"):
        w4_mma.matmul(torch.zeros(w4_mma.MAX_M + 1, 256, dtype=DTYPES[0], device=DEVICE), weights.qweight,
                      weights.scales, None, 8, 128, 64)
