"""A float16 KV cache for float32 models on CPU (kv_cache_dtype="float16", llama.cpp's default
cache type): keys and values are rounded to float16 when the C++ prologue stores them (as torch's
.to(torch.float16) rounds) and converted back in registers when the C++ attention reads them, so
an engine with it is exactly the float32 engine with its stored keys and values rounded; it holds
twice the blocks in the same memory. Anywhere nothing reads such a cache it is refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from test_fp8_kv_cache import _llm, _teacher_forced, assert_mostly_within
from test_kernels import SHAPES, _case, dense_attention

HALF = torch.float16


def _cpu_reason() -> str | None:
    from baryon.kernels.attention.cpu_paged import CpuPagedAttention

    return CpuPagedAttention.unsupported_reason(torch.device("cpu"))


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", SHAPES)  # head_dim 8 / 16 / 32 / 64
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_cpu_attention_over_a_float16_cache_matches_dense_on_the_rounded_values(seed, heads, kv_heads, head_dim,
                                                                               block_size, window, kind):
    """The C++ attention stores this step's keys and values into a float16 cache and attends over
    the whole cache; the reference is float64 attention over the keys and values rounded to float16."""
    if _cpu_reason() is not None:
        pytest.skip(_cpu_reason())
    from baryon.kernels.attention.cpu_paged import CpuPagedAttention

    gen = torch.Generator().manual_seed(seed)
    if kind == "decode":
        seqs = [(int(torch.randint(0, 40, (1,), generator=gen)), 1) for _ in range(5)]
    else:
        seqs = [(0, 9), (7, 1), (12, 5), (0, 1), (3, 1), (20, 13)]
    cache, metadata, q, k, v, full_k, full_v = _case(gen, seqs, heads, kv_heads, head_dim, block_size)
    cache = cache.to(HALF)
    scale = 1 / math.sqrt(head_dim)
    out = CpuPagedAttention(heads, head_dim, kv_heads, scale, window).forward(q, k, v, cache, metadata)
    assert cache.dtype == HALF
    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start:start + new], fk.to(HALF).float(), fv.to(HALF).float(), scale, window)
        torch.testing.assert_close(out[start:start + new], expected, atol=1e-5, rtol=1e-5)
        start += new


def test_cpu_prologue_rounds_keys_and_values_as_torch_does(seed):
    """The C++ prologue's float16 store (F16C, eight at a time, then one at a time) gives exactly
    the bits of torch's .to(float16) of what it stores into a float32 cache, ties and overflow
    (to inf) included, and returns the same queries."""
    if _cpu_reason() is not None:
        pytest.skip(_cpu_reason())
    from baryon.kernels.qkv_prologue import CpuQKVPrologue

    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, tokens, num_blocks, block_size = 4, 3, 20, 9, 4, 4  # 60 values a row: a tail of 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    v_start = (heads + kv_heads) * head_dim
    qkv[0, v_start:v_start + 3] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 70000.0])  # two ties, an overflow
    positions = torch.randint(0, 60, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[2] = -1
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    plain, half = torch.zeros(shape), torch.zeros(shape, dtype=HALF)
    q_plain = CpuQKVPrologue.forward(qkv.clone(), positions, cos_sin, None, None, 1e-6, plain, slots, heads, kv_heads,
                                     head_dim)
    q_half = CpuQKVPrologue.forward(qkv.clone(), positions, cos_sin, None, None, 1e-6, half, slots, heads, kv_heads,
                                    head_dim)
    assert torch.equal(q_plain, q_half)
    assert torch.equal(half.view(torch.int16), plain.to(HALF).view(torch.int16))
    stored = half[1].reshape(-1, kv_heads * head_dim)[slots[0]][:3]
    assert stored.tolist() == [1.0, 1 + 2 ** -9, math.inf]  # ties to even; past 65504: inf, as torch rounds


def test_float16_engine_is_the_float_engine_with_rounded_kv(tmp_path, seed, monkeypatch):
    """An engine with kv_cache_dtype="float16" (the C++ prologue, attention and fused decoder
    layers, as CPU engines run) gives what a float32 cache gives when every stored key and value is
    rounded to float16 first (the torch prologue, its store patched), in twice the blocks."""
    if _cpu_reason() is not None:
        pytest.skip(_cpu_reason())
    from conftest import make_checkpoint, random_prompts

    from baryon.kernels import qkv_prologue
    from baryon.kernels.attention import torch_paged

    path = make_checkpoint(tmp_path / "llama", "llama", seed=seed)
    prompts = random_prompts(3, 128, 16, 32, seed)
    half = _llm(path, dtype="float32", kv_cache_dtype="float16", max_logprobs=1)
    runner = half.engine.core.runner
    assert all(layer.kv_cache.dtype == HALF for layer in runner.attention_layers)
    assert runner.attention_layers[0].prologue.name == "cpu"
    got_top, got_logprobs = _teacher_forced(half, prompts)

    def rounded_store(key, value, kv_cache, slot_mapping, k_scale, v_scale):
        assert kv_cache.dtype == torch.float32
        torch_paged.store_kv(key.to(HALF).float(), value.to(HALF).float(), kv_cache, slot_mapping)

    monkeypatch.setenv("BARYON_KERNEL_ATTENTION", "torch")
    monkeypatch.setenv("BARYON_KERNEL_QKV_PROLOGUE", "torch")
    monkeypatch.setattr(qkv_prologue, "store_kv", rounded_store)
    emulated = _llm(path, dtype="float32", max_logprobs=1)
    reference_runner = emulated.engine.core.runner
    assert reference_runner.attention_layers[0].prologue.name == "torch"
    assert runner.kv_bytes_per_block() * 2 == reference_runner.kv_bytes_per_block()
    assert 0 <= runner.num_blocks - 2 * reference_runner.num_blocks < 2
    top, logprobs = _teacher_forced(emulated, prompts)
    assert sum(a == b for a, b in zip(top, got_top)) >= len(top) - 1  # at most one near-tie apart
    # A key the two prologues compute an ulp apart can round to the neighbouring float16 value (a
    # step is 2^-11 of the value), which every later position of that sequence attends to: those
    # move by up to ~1e-4 (seen: 1.3e-4); the rest agree to float32 summation order.
    assert_mostly_within(got_logprobs, logprobs, most=1e-4, every=1e-3)


def test_fused_decoder_layers_equal_the_modules_on_a_float16_cache(tmp_path, seed, monkeypatch):
    """The one-call decoder layer takes a float16 cache and stays bit-identical to the module path."""
    if _cpu_reason() is not None:
        pytest.skip(_cpu_reason())
    from conftest import make_checkpoint, random_prompts

    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=seed)
    prompts = random_prompts(3, 128, 16, 32, seed)
    fused = _llm(path, dtype="float32", kv_cache_dtype="float16", max_logprobs=1)
    assert fused.engine.core.runner.model.model.layers[0].fused is not None
    expected = _teacher_forced(fused, prompts)
    monkeypatch.setenv("BARYON_KERNEL_DECODER_LAYER", "modules")
    modules = _llm(path, dtype="float32", kv_cache_dtype="float16", max_logprobs=1)
    assert modules.engine.core.runner.model.model.layers[0].fused is None
    assert _teacher_forced(modules, prompts) == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float16_cache_for_other_model_dtypes(tmp_path, dtype):
    """float16 is refused, naming what is accepted, where no kernel would read it (a bfloat16 model);
    for a float16 model it is the model dtype, as 'auto' gives."""
    from conftest import make_checkpoint

    path = make_checkpoint(tmp_path / "llama", "llama", seed=0)
    if dtype == "bfloat16":
        with pytest.raises(ValueError, match=r"kv_cache_dtype='float16' is for float32 models on CPU.*'auto' or 'fp8'"):
            _llm(path, dtype=dtype, kv_cache_dtype="float16")
        return
    llm = _llm(path, dtype=dtype, kv_cache_dtype="float16")
    assert llm.engine.core.runner.attention_layers[0].kv_cache.dtype == HALF
