"""Weight-only quantized GEMMs (W4A16 / W8A16) against the float32 reference: the torch kernel
exactly on CPU, the Triton kernel on CUDA when present, else in Triton's interpreter (small shapes)."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.quant import w4a16
from baryon.kernels.quant.w4a16 import (GemvTiles, TileConfig, TorchW4A16Linear, TritonW4A16Linear,
                                        dequantize_reference, gemv_tiles, w4a16_linear_reference)
from baryon.kernels.triton_utils import INTERPRETED

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(w4a16.triton is None, reason="triton is not installed")
# float32 activations run only in the interpreter; on a GPU the kernel takes float16 / bfloat16.
TRITON_DTYPES = ([torch.float32, torch.float16, torch.bfloat16] if DEVICE == "cpu"
                 else [torch.float16, torch.bfloat16])


def _canonical(gen, n, k, bits, group_size, symmetric, scale_dtype=torch.float32):
    """Random canonical inputs: codes uint8 [N, K], scales [N, G], zeros uint8 [N, G]."""
    groups = 1 if group_size <= 0 or group_size >= k else -(-k // group_size)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    if symmetric:
        zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8)
    else:
        zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    return codes, scales, zeros


DEQUANT_CASES = [  # (bits, n, k, group_size, symmetric)
    (4, 24, 256, 128, False), (4, 8, 72, 16, False), (4, 8, 77, 32, True), (4, 5, 300, 1000, False),
    (4, 6, 131, -1, True), (4, 4, 90, 40, False), (8, 8, 256, 128, True), (8, 7, 77, 16, False),
    (8, 3, 200, 200, False), (8, 4, 130, 64, False),
]


@pytest.mark.parametrize("kernel", ["torch", "triton", "triton-default"])
@pytest.mark.parametrize("bits,n,k,group_size,symmetric", DEQUANT_CASES)
def test_dequantize_is_exact(seed, kernel, bits, n, k, group_size, symmetric):
    """dequantize(prepare(...)) gives the reference's float32 weight bit for bit (including the
    bfloat16 scales a checkpoint may carry). triton: the interleaved layout; triton-default: the
    layout prepare picks (triton-mma for 4-bit codes in aligned groups)."""
    cls = TorchW4A16Linear if kernel == "torch" else TritonW4A16Linear
    layout = {"triton": dict(layout="triton"), "triton-default": {}}.get(kernel, {})
    gen = torch.Generator().manual_seed(seed)
    for scale_dtype in (torch.float32, torch.bfloat16):
        codes, scales, zeros = _canonical(gen, n, k, bits, group_size, symmetric, scale_dtype)
        weights = cls.prepare(codes, scales, zeros, bits, group_size, **layout)
        if kernel == "triton-default":
            assert weights.layout == ("triton-mma" if w4a16.w4_mma.supports(bits, group_size, k) else "triton")
        ref = dequantize_reference(codes, scales, zeros, group_size)
        assert ref.dtype == torch.float32 and ref.shape == (n, k)
        assert torch.equal(cls.dequantize(weights), ref)
        assert (weights.zeros is None) == symmetric  # a shared zero point is not stored per group


def test_dequantize_reference_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scales, zeros = _canonical(gen, 3, 10, 4, 4, False)
    ref = dequantize_reference(codes, scales, zeros, 4)
    for n in range(3):
        for k in range(10):
            expected = (float(codes[n, k]) - float(zeros[n, k // 4])) * float(scales[n, k // 4])
            assert ref[n, k].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bits,k", [(4, 256), (4, 77), (8, 256), (8, 77)])
def test_torch_kernel_keeps_codes_packed(seed, bits, k):
    gen = torch.Generator().manual_seed(seed)
    n = 16
    codes, scales, zeros = _canonical(gen, n, k, bits, 32, False)
    weights = TorchW4A16Linear.prepare(codes, scales, zeros, bits, 32)
    q = weights.qweight
    assert q.numel() * q.element_size() == n * -(-k * bits // 8)
    kp = -(-k // 128) * 128  # the Triton layouts pad K to their block
    triton_weights = TritonW4A16Linear.prepare(codes, scales, zeros, bits, 32, layout="triton")
    assert triton_weights.qweight.numel() * triton_weights.qweight.element_size() == n * kp * bits // 8
    if bits == 4:  # the triton-mma layout also pads N to 64 rows
        mma = TritonW4A16Linear.prepare(codes, scales, zeros, bits, 32)
        assert mma.layout == "triton-mma" and mma.qweight.numel() * mma.qweight.element_size() == 64 * kp * bits // 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 128, -1])
@pytest.mark.parametrize("m", [1, 37])
def test_torch_kernel_equals_reference(seed, bits, group_size, m):
    gen = torch.Generator().manual_seed(seed)
    n, k = 40, 264
    codes, scales, zeros = _canonical(gen, n, k, bits, group_size, m == 1)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    weights = TorchW4A16Linear.prepare(codes, scales, zeros, bits, group_size)
    for b in (None, bias):
        out = TorchW4A16Linear.forward(x, weights, b)
        assert out.shape == (m, n) and out.dtype == x.dtype
        assert torch.equal(out, w4a16_linear_reference(x, codes, scales, zeros, group_size, b))


def test_torch_kernel_half_precision(seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scales, zeros = _canonical(gen, 24, 96, 4, 32, False, torch.float16)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    weights = TorchW4A16Linear.prepare(codes, scales, zeros, 4, 32)
    out = TorchW4A16Linear.forward(x, weights)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), w4a16_linear_reference(x, codes, scales, zeros, 32).float(),
                               atol=2e-2, rtol=2e-2)


def test_prepare_rejects_bad_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scales, zeros = _canonical(gen, 4, 64, 4, 32, False)
    for cls in (TorchW4A16Linear, TritonW4A16Linear):
        with pytest.raises(ValueError, match="bits"):
            cls.prepare(codes, scales, zeros, 3, 32)
        with pytest.raises(ValueError, match="scales"):
            cls.prepare(codes, scales, zeros, 4, 16)  # G does not match the group size
        with pytest.raises(ValueError, match="4 bits"):
            cls.prepare(codes | 16, scales, zeros, 4, 32)
    weights = TorchW4A16Linear.prepare(codes, scales, zeros, 4, 32)
    with pytest.raises(ValueError, match="prepared for the torch kernel"):
        TritonW4A16Linear.dequantize(weights)


# ------------------------------------------------------------------------------------- Triton

TRITON_CASES = [  # (bits, n, k, group_size, symmetric, m)
    (4, 80, 256, 128, False, 1),     # decode, groups of a whole block, two row tiles
    (4, 40, 264, 16, False, 3),      # a group per chunk of 16
    (4, 33, 300, 32, True, 1),       # odd N, K not a multiple of the block
    (4, 24, 77, 77, False, 5),       # channel strategy, K not a multiple of 8
    (4, 16, 200, 40, False, 2),      # ragged groups: one scale per code
    (4, 64, 136, 64, True, 130),     # prefill tiles, M larger than the tile
    (8, 48, 256, 128, True, 1),
    (8, 40, 264, 16, False, 4),      # groups smaller than a chunk of 32
    (8, 24, 72, -1, False, 17),      # channel, K = 72
    (8, 32, 130, 32, False, 130),
]


def _triton_case(gen, bits, n, k, group_size, symmetric, m, dtype, layout=None):
    codes, scales, zeros = _canonical(gen, n, k, bits, group_size, symmetric,
                                      torch.float16 if dtype == torch.float16 else torch.float32)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    weights = TritonW4A16Linear.prepare(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), bits, group_size,
                                        layout)
    return codes, scales, zeros, x, bias, weights


def _check(out, x, codes, scales, zeros, group_size, bias):
    ref = w4a16_linear_reference(x.float(), codes, scales, zeros, group_size, None if bias is None else bias.float())
    assert out.shape == ref.shape and out.dtype == x.dtype
    tol = 1e-4 if x.dtype == torch.float32 else 2e-2  # the half-precision weight is rounded for the dot
    scale = ref.abs().max().item() + 1e-6
    torch.testing.assert_close(out.cpu().float() / scale, ref / scale, atol=tol, rtol=0)


@needs_triton
@pytest.mark.parametrize("bits,n,k,group_size,symmetric,m", TRITON_CASES)
@pytest.mark.parametrize("layout", ["triton", None])
def test_triton_matches_reference(seed, bits, n, k, group_size, symmetric, m, layout):
    """Both layouts (None: the one prepare picks) through forward's own choice of kernel."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TRITON_DTYPES[TRITON_CASES.index((bits, n, k, group_size, symmetric, m)) % len(TRITON_DTYPES)]
    codes, scales, zeros, x, bias, weights = _triton_case(gen, bits, n, k, group_size, symmetric, m, dtype, layout)
    with_bias = (n + m) % 2 == 0
    b = bias.to(DEVICE) if with_bias else None
    out = TritonW4A16Linear.forward(x.to(DEVICE), weights, b)
    _check(out, x, codes, scales, zeros, group_size, bias if with_bias else None)


GEMV_CASES = [  # (bits, n, k, group_size, symmetric)
    (4, 80, 256, 128, False),    # groups of a whole block
    (4, 33, 300, 32, True),      # a group per chunk; odd N; K not a multiple of the block
    (4, 24, 77, 77, False),      # channel strategy
    (4, 16, 200, 40, False),     # ragged groups
    (4, 20, 1000, 256, False),   # groups of two blocks; the last step overhangs the row
    (8, 40, 264, 16, False),     # groups smaller than a chunk
    (8, 24, 600, -1, False),
]


@needs_triton
@pytest.mark.parametrize("bits,n,k,group_size,symmetric", GEMV_CASES)
@pytest.mark.parametrize("tiles", [GemvTiles(2, 2), GemvTiles(4, 1, 2, prefetch=False), None],
                         ids=["2x2", "4x1-no-prefetch", "table"])
def test_triton_gemv_matches_reference(seed, bits, n, k, group_size, symmetric, tiles):
    """The decode GEMV (no tl.dot; whole K per program) for every group layout, against the
    reference and against the tiled GEMM on the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TRITON_DTYPES[GEMV_CASES.index((bits, n, k, group_size, symmetric)) % len(TRITON_DTYPES)]
    for m in (1, 4):  # the table runs up to four rows
        codes, scales, zeros, x, bias, weights = _triton_case(gen, bits, n, k, group_size, symmetric, m, dtype,
                                                              "triton")
        with_bias = m == 1
        b = bias.to(DEVICE) if with_bias else None
        out = TritonW4A16Linear.forward(x.to(DEVICE), weights, b, tiles=tiles or gemv_tiles(n, k, bits))
        _check(out, x, codes, scales, zeros, group_size, bias if with_bias else None)
        gemm = TritonW4A16Linear.forward(x.to(DEVICE), weights, b, tiles=TileConfig(16, 32))
        _check(gemm, x, codes, scales, zeros, group_size, bias if with_bias else None)


@needs_triton
@pytest.mark.parametrize("bits,n,k,group_size,symmetric", DEQUANT_CASES)
def test_triton_dequantize_to_gives_the_gemm_weight(seed, monkeypatch, bits, n, k, group_size, symmetric):
    """Prefill-sized batches dequantize once (one kernel) and call cuBLAS: the weight equals the
    exact float32 weight rounded once to x's dtype, and the product matches the reference."""
    gen = torch.Generator().manual_seed(seed)
    for dtype in TRITON_DTYPES:
        codes, scales, zeros, x, bias, weights = _triton_case(gen, bits, n, k, group_size, symmetric, 5, dtype)
        w = TritonW4A16Linear.dequantize_to(weights, dtype)
        assert w.dtype == dtype and w.shape == (n, k)
        ref = dequantize_reference(codes, scales, zeros, group_size).to(dtype)
        if INTERPRETED and dtype == torch.bfloat16:  # the interpreter truncates to bfloat16: one ulp
            torch.testing.assert_close(w.cpu(), ref, rtol=2**-7, atol=0)
        else:
            assert torch.equal(w.cpu(), ref)
        monkeypatch.setattr(w4a16, "DEQUANTIZE_MIN_M", 5)
        out = TritonW4A16Linear.forward(x.to(DEVICE), weights, bias.to(DEVICE))
        _check(out, x, codes, scales, zeros, group_size, bias)
        monkeypatch.undo()


@needs_triton
@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_split_k(seed, split_k, with_bias):
    """The decode path with K split over programs: partial sums added by the second pass."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TRITON_DTYPES[0]
    codes, scales, zeros, x, bias, weights = _triton_case(gen, 4, 40, 520, 32, False, 2, dtype, "triton")
    b = bias.to(DEVICE) if with_bias else None
    out = TritonW4A16Linear.forward(x.to(DEVICE), weights, b, tiles=TileConfig(16, 32, split_k=split_k))
    _check(out, x, codes, scales, zeros, 32, bias if with_bias else None)
    again = TritonW4A16Linear.forward(x.to(DEVICE), weights, b, tiles=TileConfig(16, 32, split_k=split_k))
    assert torch.equal(out, again)  # the ordered reduction is deterministic


@needs_triton
def test_triton_leading_dims_and_empty(seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scales, zeros, x, bias, weights = _triton_case(gen, 4, 16, 64, 32, True, 6, TRITON_DTYPES[0])
    out = TritonW4A16Linear.forward(x.view(2, 3, 64).to(DEVICE), weights)
    assert out.shape == (2, 3, 16)
    _check(out.reshape(6, 16), x, codes, scales, zeros, 32, None)
    assert TritonW4A16Linear.forward(x[:0].to(DEVICE), weights).shape == (0, 16)


def test_tile_config_table():
    if w4a16.triton is None:
        pytest.skip("triton is not installed")
    cpu = torch.device("cpu")

    def cfg(m, n, k):
        return w4a16.tile_config(m, n, k, cpu, num_sms=132)  # an H100

    assert cfg(1, 4096, 4096) == TileConfig(16, 64, split_k=4, num_warps=4, num_stages=4)
    assert cfg(1, 12288, 4096).split_k == 2
    assert cfg(1, 1024, 4096).split_k == 8  # 16 row tiles, 4 blocks of K per split
    assert cfg(1, 64, 256).split_k == 1  # too little K to split
    assert cfg(8192, 4096, 4096) == TileConfig(128, 128, split_k=1, num_warps=8, num_stages=3)
    assert cfg(512, 1024, 4096).split_k == 1  # prefill never splits
    for m in (1, 16, 17, 33, 64, 65, 128, 129):
        c = cfg(m, 12288, 4096)
        assert c.block_m >= min(m, 128) and c.block_m // 2 < m or c.block_m == 16


def test_cannot_implement_reasons():
    config = dict(in_features=4096, out_features=4096, group_size=128)
    assert TorchW4A16Linear.cannot_implement_reason(bits=4, dtype=torch.float32, **config) is None
    assert "bits" in TorchW4A16Linear.cannot_implement_reason(bits=3, dtype=torch.float32, **config)
    if w4a16.triton is None:
        return
    for dtype in (torch.float16, torch.bfloat16):
        for bits in (4, 8):
            assert TritonW4A16Linear.cannot_implement_reason(bits=bits, dtype=dtype, **config) is None
    assert "bits" in TritonW4A16Linear.cannot_implement_reason(bits=2, dtype=torch.float16, **config)
    fp32 = TritonW4A16Linear.cannot_implement_reason(bits=4, dtype=torch.float32, **config)
    assert (fp32 is None) == INTERPRETED


def test_selector_picks_the_packed_cpu_kernel_unless_forced(monkeypatch):
    from baryon.kernels import selector
    from baryon.kernels.cpu import load_error

    cpu = torch.device("cpu")
    config = dict(in_features=256, out_features=64, bits=4, group_size=128, dtype=torch.float32)
    expected = "cpu" if load_error() is None else "torch"  # the block kernels need the C++ build
    assert selector.select("w4a16_linear", cpu, **config).name == expected
    assert selector.select("w4a16_linear", cpu, **{**config, "group_size": 48}) is TorchW4A16Linear
    assert selector.select("w4a16_linear", cpu, **{**config, "dtype": torch.bfloat16}) is TorchW4A16Linear
    if w4a16.triton is None or not INTERPRETED:
        pytest.skip("forcing Triton on CPU needs the interpreter")
    monkeypatch.setenv("BARYON_KERNEL_W4A16_LINEAR", "triton")
    assert selector.select("w4a16_linear", cpu, **config) is TritonW4A16Linear
