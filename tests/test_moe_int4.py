"""Packed int4 experts (GPTQ / AWQ / compressed-tensors W4A16 MoE checkpoints): the packing and
its dequantization against the canonical (code - zero) * scale, and the Triton expert kernels
(family fused_moe_int4) against the float reference in every tile layout, on CUDA when present,
else in Triton's interpreter (float32)."""

from __future__ import annotations

import pytest
import torch

from baryon.kernels.moe import experts_triton
from baryon.kernels.moe.experts_torch import TorchInt4FusedExperts, fused_experts_int4_reference
from baryon.kernels.moe.routing import RoutingConfig, route_reference
from baryon.kernels.moe.tile_configs import MoETiles, TileConfig
from baryon.kernels.quant.int4_experts import dequantize_int4_experts, pack_int4_experts
from conftest import cpu_engine_with_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(experts_triton.triton is None, reason="triton is not installed")


def _random_int4(gen: torch.Generator, *shape: int, group: int, dtype=torch.float32):
    """Canonical codes [..., K], scales and zero codes [..., K / group] (asymmetric: any zero)."""
    *rows, k = shape
    codes = torch.randint(0, 16, (*rows, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(*rows, k // group, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (*rows, k // group), generator=gen, dtype=torch.int32).to(torch.uint8)
    return codes, scales, zeros


@pytest.mark.parametrize("group", [32, 64, 128])
def test_packing_keeps_every_value(seed, group):
    gen = torch.Generator().manual_seed(seed)
    codes, scales, zeros = _random_int4(gen, 3, 5, 256, group=group, dtype=torch.bfloat16)
    blocks, pairs = pack_int4_experts(codes, scales, zeros, torch.bfloat16)
    assert blocks.shape == (3, 5, 128) and blocks.dtype == torch.uint8
    assert pairs.shape == (3, 5, 256 // 32, 2) and pairs.dtype == torch.bfloat16
    g = torch.arange(256) // group
    expected = (codes.float() - zeros[..., g].float()) * scales[..., g].float()
    assert torch.equal(dequantize_int4_experts(blocks, pairs), expected)
    assert torch.equal(dequantize_int4_experts(blocks, pairs, torch.bfloat16), expected.to(torch.bfloat16))


def test_packing_refuses_what_it_cannot_hold(seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scales, zeros = _random_int4(gen, 2, 64, group=16)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4_experts(codes, scales, zeros, torch.float32)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4_experts(codes + 16, *_random_int4(gen, 2, 64, group=32)[1:], torch.float32)
    blocks, pairs = pack_int4_experts(*_random_int4(gen, 2, 64, group=32), torch.float32)
    with pytest.raises(ValueError, match="disagree"):
        dequantize_int4_experts(blocks[:, :16], pairs)


@pytest.mark.parametrize("kind, dtype, magic", [("bf16x2", torch.bfloat16, 128.0), ("f16x2", torch.float16, 1024.0)])
@pytest.mark.parametrize("high", [False, True], ids=["low-nibble", "high-nibble"])
def test_lane_decode_asm_gives_the_float32_values(seed, kind, dtype, magic, high):
    """The inline PTX of the GPU's int4 decode (experts_triton._int4_lanes_asm, which the
    interpreter never runs), executed by tests/ptx_lanes.py on every byte value with random
    (scale, zero) pairs: bit for bit the float32 (code - zero) * scale rounded once to the dtype."""
    import ptx_lanes

    gen = torch.Generator().manual_seed(seed)
    packed = torch.randperm(256, generator=gen).to(torch.uint8)  # every byte once
    zero = torch.randint(0, 16, (256,), generator=gen).float()
    scale = (torch.rand(256, generator=gen) * 0.02 + 1e-4).to(dtype)
    neg = (-(magic + zero)).to(dtype)  # what the kernel hands the asm: -(magic + zero), exact
    asm = experts_triton._int4_lanes_asm(high, kind)
    words = []
    for i in range(0, 256, 4):  # four bytes an invocation (pack=4): two 16-bit lanes per register
        inputs = [*ptx_lanes.pack(packed[i:i + 4]), *ptx_lanes.pack(neg[i:i + 4]), *ptx_lanes.pack(scale[i:i + 4])]
        words += ptx_lanes.run(asm, inputs, num_outputs=2)
    got = ptx_lanes.unpack(words, dtype)
    code = (packed >> 4 if high else packed & 0xF).float()
    expected = ((code - zero) * scale.float()).to(dtype)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


LAYOUTS = {
    "pairs": ("pairs", TileConfig(1, 16, 64), TileConfig(1, 32, 64)),
    "scan": ("scan", TileConfig(16, 32, 64, scan=16), TileConfig(16, 16, 32, scan=32)),
    "sorted": ("sorted", TileConfig(16, 32, 64), TileConfig(32, 16, 32)),
    "sorted-separate-act": ("sorted", TileConfig(16, 16, 32, fuse_act=False), TileConfig(16, 32, 64)),
}
CASES = [  # (id, tokens, experts, top_k, hidden, inter, group)
    ("one-token", 1, 4, 2, 64, 32, 32),
    ("uneven-k-tiles-g64", 7, 6, 3, 192, 128, 64),
    ("k-tail-g32", 5, 4, 2, 96, 96, 32),  # K = 96: the last K tile of 64 half outside (masked loads)
]


@needs_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,tokens,experts,top_k,hidden,inter,group", CASES, ids=[c[0] for c in CASES])
# bf16 on CUDA only: the interpreter's bf16 tl.dot returns garbage
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_triton_int4_experts_match_reference(seed, monkeypatch, layout, name, tokens, experts, top_k, hidden,
                                             inter, group, dtype):
    monkeypatch.setattr(experts_triton, "_four_bit_tiles", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = route_reference(torch.randn(tokens, experts, generator=gen),
                                   RoutingConfig(experts, top_k, renormalize=True))
    w13 = pack_int4_experts(*_random_int4(gen, experts, 2 * inter, hidden, group=group), dtype)
    w2 = pack_int4_experts(*_random_int4(gen, experts, hidden, inter, group=group), dtype)
    packed = (w13[0], w2[0], w13[1], w2[1])
    expected = fused_experts_int4_reference(x.float(), *(t if t.dtype == torch.uint8 else t.float() for t in packed),
                                            weights, ids)
    got = experts_triton.TritonInt4FusedExperts.forward(*(t.to(DEVICE) for t in (x, *packed, weights, ids)))
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: activations and intermediates rounded
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    # Expert parallelism: this rank holds the second half of the experts.
    half = experts // 2
    local = tuple(t[half:] for t in packed)
    expected = fused_experts_int4_reference(x.float(), *(t if t.dtype == torch.uint8 else t.float() for t in local),
                                            weights, ids, half, experts)
    got = experts_triton.TritonInt4FusedExperts.forward(*(t.to(DEVICE) for t in (x, *local, weights, ids)),
                                                        expert_start=half, num_experts=experts)
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    torch.testing.assert_close(TorchInt4FusedExperts.forward(x.float(), *(t if t.dtype == torch.uint8 else t.float()
                                                                          for t in local), weights, ids, half, experts),
                               expected)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dequantization_equals_the_reference(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    blocks, pairs = pack_int4_experts(*_random_int4(gen, 3, 5, 96 * 2, group=64), dtype)
    got = experts_triton.dequantize_int4_triton(blocks.to(DEVICE), pairs.to(DEVICE), dtype)
    assert got.dtype == dtype and torch.equal(got.cpu(), dequantize_int4_experts(blocks, pairs, dtype))


@needs_triton
def test_large_batches_take_the_dequantized_path(seed, monkeypatch):
    """From INT4_DEQUANTIZE_MIN_TOKENS tokens the experts are dequantized once and the float
    kernels run: the same result."""
    monkeypatch.setattr(experts_triton, "INT4_DEQUANTIZE_MIN_TOKENS", 4)
    monkeypatch.setattr(experts_triton, "tile_configs", lambda *args: MoETiles(*LAYOUTS["sorted"]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 64, generator=gen)
    weights, ids = route_reference(torch.randn(6, 4, generator=gen), RoutingConfig(4, 2, renormalize=True))
    w13 = pack_int4_experts(*_random_int4(gen, 4, 64, 64, group=32), torch.float32)
    w2 = pack_int4_experts(*_random_int4(gen, 4, 64, 32, group=32), torch.float32)
    packed = (w13[0], w2[0], w13[1], w2[1])
    calls = []
    original = experts_triton.TritonFusedExperts.forward
    monkeypatch.setattr(experts_triton.TritonFusedExperts, "forward",
                        staticmethod(lambda *a, **kw: calls.append(1) or original(*a, **kw)))
    got = experts_triton.TritonInt4FusedExperts.forward(*(t.to(DEVICE) for t in (x, *packed, weights, ids)))
    assert calls == [1]
    expected = fused_experts_int4_reference(x, *packed, weights, ids)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


# -- checkpoints: the experts kept packed ---------------------------------------------------------

MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _checkpoints():
    import quant_checkpoints as qc

    return {
        "gptq-g32": lambda s, d, seed: qc.gptq(s, d, 4, 32, sym=False, seed=seed),
        "awq-g32": lambda s, d, seed: qc.awq(s, d, 32),
        "ct-w4a16-channel": lambda s, d, seed: qc.compressed_tensors(
            s, d, qc.ct_scheme("W4A16_ASYM", strategy="channel", group_size=None),
            ignore=["lm_head", "re:.*mlp.gate$"], seed=seed),
    }


@cpu_engine_with_triton
@pytest.mark.usefixtures("exact_packed_kernels")
@pytest.mark.parametrize("fmt", ["gptq-g32", "awq-g32", "ct-w4a16-channel"])
def test_int4_moe_checkpoints_keep_their_experts_packed(tmp_path, seed, monkeypatch, fmt):
    """GPTQ / AWQ / compressed-tensors W4A16 experts load packed (5 bits a value) where the int4
    expert kernel runs (here the interpreter stands in for a GPU): each layer holds exactly the
    checkpoint's dequantized experts, and greedy tokens and logprobs follow the float checkpoint
    of those weights. Where only the torch kernel runs (plain CPU) they are held dequantized."""
    import quant_checkpoints as qc
    from baryon import LLM, SamplingParams
    from conftest import make_checkpoint, random_prompts

    src = make_checkpoint(tmp_path / "float", "qwen3_moe", seed=seed, **MOE)
    checkpoint = _checkpoints()[fmt](src, tmp_path / "quantized", seed)
    reference = qc.write_reference(checkpoint, tmp_path / "dequantized")
    engine = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 128, 3, 8, seed)]

    def run(path):
        with LLM(str(path), **engine) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            experts = llm.engine.core.runner.model.model.layers[0].mlp.experts
            held = [w.clone() for w in experts.method.dequantize(experts)]
            return experts, held, [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in
                                                             zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                                   for o in outs]

    float_experts, float_held, float_outs = run(reference)
    monkeypatch.setenv("BARYON_KERNEL_FUSED_MOE_INT4", "triton")
    experts, held, outs = run(checkpoint.path)
    assert experts.method.packed and not experts.method.holds_dequantized
    assert experts.w13_blocks.dtype == torch.uint8 and experts.w13_blocks.shape == (4, 2 * 64, 64 // 2)
    assert not hasattr(experts, "w13_weight")
    assert all(torch.equal(a, b) for a, b in zip(held, float_held))  # exactly the checkpoint's experts
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(outs, float_outs):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
    monkeypatch.delenv("BARYON_KERNEL_FUSED_MOE_INT4")
    with LLM(str(checkpoint.path), **engine) as llm:  # the torch kernel: dequantized once at load
        experts = llm.engine.core.runner.model.model.layers[0].mlp.experts
        assert not experts.method.packed and experts.method.holds_dequantized and hasattr(experts, "w13_weight")


@cpu_engine_with_triton
def test_online_w4a16_packs_the_experts_it_quantizes(tmp_path, seed, monkeypatch):
    """quantization="w4a16" on a float MoE checkpoint: the experts rounded to int4 at load are
    held packed where the int4 kernel runs (the interpreter here), exactly the weights the CPU
    path holds dequantized, and the engine gives the same greedy tokens either way."""
    from baryon import LLM, SamplingParams
    from conftest import make_checkpoint, random_prompts

    src = make_checkpoint(tmp_path / "float", "qwen3_moe", seed=seed, **MOE)
    engine = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.01,
                  quantization="w4a16")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 128, 3, 8, seed)]
    results = []
    for kernel in ("torch", "triton"):
        monkeypatch.setenv("BARYON_KERNEL_FUSED_MOE_INT4", kernel)
        with LLM(str(src), **engine) as llm:
            experts = llm.engine.core.runner.model.model.layers[1].mlp.experts
            assert experts.method.packed == (kernel == "triton")
            held = [w.clone() for w in experts.method.dequantize(experts)]
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            results.append((held, tokens))
    (held_cpu, tokens_cpu), (held_packed, tokens_packed) = results
    assert all(torch.equal(a, b) for a, b in zip(held_cpu, held_packed))
    assert tokens_cpu == tokens_packed
