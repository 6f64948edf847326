"""baryon's C++ CPU kernels (kernels/cpu/*.cpp) against their torch references on fresh random
inputs: the block-quantized linear (and baryon's packed layout from GGUF blocks), RMSNorm and the QKV
prologue. Paged attention is tested beside the torch backend in tests/test_kernels.py."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from baryon.kernels import selector
from baryon.kernels.block_quant import (CpuBlockQuantLinear, CpuInt8BlockQuantLinear, TorchBlockQuantLinear,
                                        block_quant_linear_int8_reference, code_bytes, dequantize_rows, pack_rows,
                                        quantize_activation_blocks, row_bytes)
from baryon.kernels.cpu import load_error
from baryon.loader.gguf import PACKABLE_BITS, _block_codes, packed_format
from test_gguf import quantized

pytestmark = pytest.mark.skipif(load_error() is not None, reason=f"C++ CPU kernels unavailable: {load_error()}")
CPU = torch.device("cpu")


def random_codes(rng: np.random.Generator, rows: int, in_features: int, bits: int) -> np.ndarray:
    """Codes over the whole range of `bits`: 0..15, Q6_K's -32..31, or int8."""
    low, high = {4: (0, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
    return rng.integers(low, high, (rows, in_features))


def random_packed(rng: np.random.Generator, rows: int, in_features: int, bits: int,
                  pair_bytes: int = 8) -> torch.Tensor:
    """pair_bytes 4: float16 pairs (the scales and offsets drawn as float16 values)."""
    dtype = np.float16 if pair_bytes == 4 else np.float32
    codes = random_codes(rng, rows, in_features, bits)
    if bits == 6:  # a scale per 16 elements, of either sign (Q6_K's int8 sub-block scales), no offset
        scale = rng.uniform(1e-3, 2e-2, (rows, in_features // 16)) * rng.choice([-1, 1], (rows, in_features // 16))
        return pack_rows(codes, scale.astype(dtype).astype(np.float32), None, bits, pair_bytes)
    scale = rng.uniform(1e-3, 2e-2, (rows, in_features // 32)).astype(dtype).astype(np.float32)
    minimum = rng.uniform(-0.2, 0.2, (rows, in_features // 32)).astype(dtype).astype(np.float32)
    return pack_rows(codes, scale, minimum, bits, pair_bytes)


def test_packed_layout_round_trips(seed):
    rng = np.random.default_rng(seed)
    for bits in (4, 6, 8):
        codes = random_codes(rng, 5, 64, bits)
        if bits == 6:
            scale = rng.standard_normal((5, 4)).astype(np.float32)  # one per 16 elements
            packed = pack_rows(codes, scale, None, bits)
            expected = codes.reshape(5, 4, 16) * scale[..., None]
        else:
            scale, minimum = rng.random((5, 2), dtype=np.float32), rng.standard_normal((5, 2)).astype(np.float32)
            packed = pack_rows(codes, scale, minimum, bits)
            expected = codes.reshape(5, 2, 32) * scale[..., None] + minimum[..., None]
        assert packed.dtype == torch.uint8 and packed.shape == (5, row_bytes(64, bits))
        torch.testing.assert_close(dequantize_rows(packed, 64, bits), torch.from_numpy(expected.reshape(5, 64)).float())


def test_float16_pairs_hold_only_float16_values_and_are_read_from_the_row_length(seed):
    rng = np.random.default_rng(seed)
    codes = random_codes(rng, 3, 64, 4)
    scale = rng.uniform(1e-3, 2e-2, (3, 2)).astype(np.float16).astype(np.float32)
    minimum = np.full((3, 2), -0.1, dtype=np.float32)  # 0.1 has no float16 value
    with pytest.raises(ValueError, match="not all float16 values"):
        pack_rows(codes, scale, minimum, 4, pair_bytes=4)
    minimum = minimum.astype(np.float16).astype(np.float32)
    half, full = pack_rows(codes, scale, minimum, 4, pair_bytes=4), pack_rows(codes, scale, minimum, 4)
    assert half.shape == (3, 32 + 2 * 4) and full.shape == (3, 32 + 2 * 8)
    assert torch.equal(dequantize_rows(half, 64, 4), dequantize_rows(full, 64, 4))
    with pytest.raises(ValueError, match="fit neither pair width"):
        dequantize_rows(half[:, :-1], 64, 4)


@pytest.mark.parametrize("type_name", sorted(PACKABLE_BITS))
def test_gguf_blocks_pack_to_exactly_what_gguf_dequantizes(seed, type_name):
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    weight = rng.standard_normal((6, 512)).astype(np.float32)
    raw = quantized(weight, qtype, rng)  # uint8 [6, bytes per row] (random blocks for Q4_K and Q5_K)
    expected = gguf.quants.dequantize(raw, qtype)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    codes, scale, minimum = _block_codes(type_name, raw.reshape(6, -1, type_size))
    bits, pair_bytes = packed_format(type_name)
    packed = pack_rows(codes, scale, minimum, bits, pair_bytes)  # float16 pairs where GGUF stores float16
    assert packed.shape == (6, row_bytes(512, bits, pair_bytes))
    got = dequantize_rows(packed, 512, bits).numpy()
    if type_name == "Q6_K":  # scale * code, rounded once in both: the very same values
        np.testing.assert_array_equal(got, expected)
    # Same float32 values, up to the one rounding the reference's separate multiply and add may differ by.
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pair_bytes", [8, 4])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_cpp_dequantize_matches_reference(seed, bits, pair_bytes):
    """The C++ dequantization (the float32 kernel's prefill path) gives the reference's values."""
    rng = np.random.default_rng(seed)
    packed = random_packed(rng, int(rng.integers(1, 40)), 800, bits, pair_bytes)
    got = torch.ops.baryon_cpu.block_quant_dequantize(packed, bits, 800)
    torch.testing.assert_close(got, dequantize_rows(packed, 800, bits), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("in_features", [32, 96, 800])  # 800: more than one 768-wide chunk of K
@pytest.mark.parametrize("rows_of_x", [1, 3, 8, 17, 50])  # 50: the dequantize-then-BLAS path
@pytest.mark.parametrize("pair_bytes", [8, 4])
def test_block_quant_linear_matches_reference(seed, bits, in_features, rows_of_x, pair_bytes):
    rng = np.random.default_rng(seed)
    out_features = int(rng.integers(1, 40))
    packed = random_packed(rng, out_features, in_features, bits, pair_bytes)
    x = torch.from_numpy(rng.standard_normal((rows_of_x, in_features)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32)) if seed % 2 else None
    got = CpuBlockQuantLinear.forward(x, packed, bits, in_features, bias)
    expected = x.double() @ dequantize_rows(packed, in_features, bits).double().T
    if bias is not None:
        expected += bias.double()
    assert got.shape == (rows_of_x, out_features)
    torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(TorchBlockQuantLinear.forward(x, packed, bits, in_features, bias), got,
                               rtol=1e-4, atol=1e-4)


INT8_REASON = CpuInt8BlockQuantLinear.unsupported_reason(CPU)


@pytest.mark.skipif(INT8_REASON is not None, reason=f"no integer-dot kernel: {INT8_REASON}")
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("in_features", [32, 96, 160, 576, 800])  # 1, 3, 5, 18, 25 blocks: every partial group
# 5+ rows: sixteen weight rows across the lanes on AVX-512 VNNI (passes of up to 16 rows of x)
@pytest.mark.parametrize("rows_of_x", [1, 2, 3, 4, 5, 17, 31, 64])
@pytest.mark.parametrize("pair_bytes", [8, 4])
def test_block_quant_int8_kernel_matches_its_reference(seed, bits, in_features, rows_of_x, pair_bytes):
    """The C++ integer-dot kernel computes exactly the reference's numerics (integer dot products per
    block, then float scales), up to float32 summation order; float32 or float16 pairs."""
    rng = np.random.default_rng(seed)
    out_features = int(rng.integers(1, 40))
    packed = random_packed(rng, out_features, in_features, bits, pair_bytes)
    x = torch.from_numpy(rng.standard_normal((rows_of_x, in_features)).astype(np.float32))
    x[0, :32] = 0  # an all-zero block: scale 0, nothing divided by it
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32)) if seed % 2 else None
    got = CpuInt8BlockQuantLinear.forward(x, packed, bits, in_features, bias)
    assert got.shape == (rows_of_x, out_features)
    torch.testing.assert_close(got, block_quant_linear_int8_reference(x, packed, bits, in_features, bias),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(INT8_REASON is not None, reason=f"no integer-dot kernel: {INT8_REASON}")
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("in_features", [96, 576, 800])  # 3, 18, 25 blocks: partial groups
@pytest.mark.parametrize("pair_bytes", [8, 4])
def test_block_quant_int8_kernel_is_batch_invariant(seed, bits, in_features, pair_bytes):
    """A row of x gives the same bits alone as among 1-20 other rows (AVX-512 VNNI computes 1-4 rows
    and 5+ rows of x with different loops: prefix caching, chunked prefill and batching change how
    many rows a call has, and must not change a token)."""
    rng = np.random.default_rng(seed)
    out_features = int(rng.integers(17, 70))  # a whole 16-row tile and a partial one
    packed = random_packed(rng, out_features, in_features, bits, pair_bytes)
    x = torch.from_numpy(rng.standard_normal((21, in_features)).astype(np.float32))
    together = CpuInt8BlockQuantLinear.forward(x, packed, bits, in_features)
    start = 0
    for size in (1, 2, 3, 4, 5, 6):  # 21 rows in calls of every size around the switch
        part = CpuInt8BlockQuantLinear.forward(x[start:start + size], packed, bits, in_features)
        assert torch.equal(part, together[start:start + size]), size
        start += size
    for row in (0, 20):
        assert torch.equal(CpuInt8BlockQuantLinear.forward(x[row:row + 1], packed, bits, in_features), together[row:row + 1])


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_int8_reference_error_is_the_activation_rounding(seed, bits):
    """Against exact float64: each block's error is at most sum|scale * code| * d / 2 (q rounds to
    the nearest integer); in practice far less, ~0.5% of the output's scale."""
    rng = np.random.default_rng(seed)
    in_features, out_features = 256, 24
    packed = random_packed(rng, out_features, in_features, bits)
    x = torch.from_numpy(rng.standard_normal((7, in_features)).astype(np.float32))
    exact = x.double() @ dequantize_rows(packed, in_features, bits).double().T
    got = block_quant_linear_int8_reference(x, packed, bits, in_features).double()
    q, d, _ = quantize_activation_blocks(x)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    pairs = packed[:, code_bytes(in_features, bits):].contiguous().view(torch.float32).reshape(out_features, -1, 2)
    minimum = torch.zeros_like(pairs[..., 1:]) if bits == 6 else pairs[..., 1:]  # bits 6: no offset
    weight = dequantize_rows(packed, in_features, bits).double()  # bound with |w - min| = |scale * code|
    code_sums = ((weight.reshape(out_features, -1, 32) - minimum.double()).abs().sum(-1))  # [N, B]
    bound = (code_sums[None] * d[..., 0].double()[:, None, :] / 2).sum(-1)  # [M, N]
    assert ((got - exact).abs() <= bound + 1e-6).all()
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


def test_block_quant_linear_rejects_bad_shapes():
    packed = torch.zeros(4, row_bytes(64, 4), dtype=torch.uint8)
    for kernel in (CpuBlockQuantLinear, CpuInt8BlockQuantLinear):
        with pytest.raises(RuntimeError, match="x must be float32"):
            kernel.forward(torch.zeros(2, 32), packed, 4, 64)
        with pytest.raises(RuntimeError, match="packed must be contiguous uint8"):
            kernel.forward(torch.zeros(2, 64), packed[:, :-1], 4, 64)
        with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8"):
            kernel.forward(torch.zeros(2, 64), packed, 5, 64)
    assert "multiple of 32" in CpuBlockQuantLinear.cannot_implement_reason(in_features=48, bits=4, dtype=torch.float32)
    assert "bits=5" in CpuBlockQuantLinear.cannot_implement_reason(in_features=64, bits=5, dtype=torch.float32)
    for bits in (6, 8):
        assert TorchBlockQuantLinear.cannot_implement_reason(in_features=64, bits=bits, dtype=torch.float32) is None


def test_cpu_kernels_are_chosen_on_cpu_and_torch_can_be_forced(monkeypatch):
    default = "cpu_int8" if INT8_REASON is None else "cpu_float32"
    assert selector.select("block_quant_linear", CPU, in_features=64, bits=4, dtype=torch.float32).name == default
    monkeypatch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", "cpu_float32")
    assert selector.select("block_quant_linear", CPU, in_features=64, bits=4, dtype=torch.float32).name == "cpu_float32"
    for family in ("attention", "rms_norm", "qkv_prologue"):
        assert selector.select(family, CPU, head_dim=64).name == "cpu"
    monkeypatch.setenv("BARYON_KERNEL_RMS_NORM", "torch")
    assert selector.select("rms_norm", CPU).name == "torch"


@pytest.mark.parametrize("hidden", [48, 576, 1000])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_torch(seed, hidden, with_residual):
    from baryon.kernels.norm import CpuRMSNorm, TorchRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, hidden + 7, generator=gen)[:, :hidden]  # strided rows, as a slice of a wider buffer
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(9, hidden, generator=gen) if with_residual else None
    out, res = CpuRMSNorm.forward(x, weight, 1e-6, residual)
    ref_out, ref_res = TorchRMSNorm.forward(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    if with_residual:
        torch.testing.assert_close(res, ref_res)
    else:
        assert res is None


@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim,qk_norm", [
    (4, 2, 64, 64, True), (8, 1, 64, 32, False), (3, 3, 8, 8, False), (9, 3, 64, 64, False)])
def test_qkv_prologue_matches_torch(seed, heads, kv_heads, head_dim, rotary_dim, qk_norm):
    from baryon.kernels.qkv_prologue import CpuQKVPrologue, TorchQKVPrologue

    gen = torch.Generator().manual_seed(seed)
    tokens, num_blocks, block_size = 11, 4, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 60, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    weights = [torch.randn(head_dim, generator=gen) if qk_norm else None for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:2]] = -1  # padding rows are not stored
    results = []
    for kernel in (TorchQKVPrologue, CpuQKVPrologue):
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
        q = kernel.forward(qkv.clone(), positions, cos_sin, weights[0], weights[1], 1e-6, cache, slots,
                           heads, kv_heads, head_dim)
        results.append((q.clone(), cache))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
    assert int((results[1][1].flatten(1, 2).abs().sum((0, 2, 3)) > 0).sum()) == int((slots >= 0).sum())


def test_a_killed_build_does_not_hang_later_loads():
    """torch's build lock left by a build that was killed (Ctrl-C during the first run) made every
    later process wait forever; now it is removed under baryon's own flock."""
    import os
    import subprocess
    import sys

    from torch.utils import cpp_extension

    from baryon.kernels.cpu import _cpu_fingerprint

    build_dir = cpp_extension._get_build_directory(f"baryon_cpu_{_cpu_fingerprint()}", verbose=False)
    leftover = os.path.join(build_dir, "lock")
    open(leftover, "w").close()
    proc = subprocess.run([sys.executable, "-c", "from baryon.kernels.cpu import load_error; print(load_error())"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    assert not os.path.exists(leftover)
