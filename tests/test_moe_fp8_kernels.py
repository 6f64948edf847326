"""FP8 experts with block weight scales (family fused_moe_fp8): the Triton kernels in every layout
against the w8a8 reference, the reference against the per-K-block definition, and the torch
kernel (weight-only dequantization, the CPU path) against float32 on the dequantized weights.
Triton runs on CUDA when present, else in the interpreter (Triton 3.9's interpreter loads float8
tensors and multiplies them with tl.dot exactly; its in-kernel float -> float8 cast rounds wrongly
near binade edges, which is why the activations are quantized by act_quant, outside the GEMMs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baryon.kernels.moe import experts_triton
from baryon.kernels.moe.experts_torch import (TorchFp8FusedExperts, TorchInt8FusedExperts, dequantize_block_fp8,
                                              fused_experts_fp8_reference,
                                              fused_experts_reference)
from baryon.kernels.moe.routing import RoutingConfig, route_reference
from baryon.kernels.moe.tile_configs import MoETiles, TileConfig, default_tiles, fp8_block_tiles
from baryon.kernels.quant.act_quant import FP8, quantize_per_group_reference
from baryon.kernels.selector import select
from conftest import cpu_engine_with_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# SiLU of a large negative gate: exp overflows to inf and the result is -0, as it should be.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
needs_triton = pytest.mark.skipif(experts_triton.triton is None, reason="triton is not installed")
if DEVICE == "cuda" and experts_triton.TritonFp8FusedExperts.unsupported_reason(torch.device("cuda")):
    needs_triton = pytest.mark.skip(reason="this GPU has no float8 tensor cores")


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] float32 -> (float8_e4m3fn [E, N, K], scale [E, ceil(N / bn), ceil(K / bk)]) with
    w ~= q * scale of its block (amax / 448 per block, as the FP8 checkpoints are made)."""
    experts, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    blocks = F.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(experts, nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-10) / 448.0
    q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(FP8)
    return q.view(experts, nb * bn, kb * bk)[:, :n, :k].contiguous(), scale


def _fp8_case(gen, tokens, experts, top_k, hidden, inter, block, skewed=False):
    """Routed tokens and FP8 experts whose blocks have scales spread over a few orders of
    magnitude (a scale applied to the wrong block shows)."""
    bn, bk = block

    def weight(n, k):
        w = torch.randn(experts, n, k, generator=gen) / k ** 0.5
        spread = torch.exp(torch.randn(experts, -(-n // bn), -(-k // bk), generator=gen))
        w = w * spread.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
        return _quantize_blocks(w, block)

    x = torch.randn(tokens, hidden, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen))
    w13, w13_scale = weight(2 * inter, hidden)
    w2, w2_scale = weight(hidden, inter)
    logits = torch.randn(tokens, experts, generator=gen)
    if skewed:  # most tokens to expert 0 (and a few experts receive nothing)
        logits[:, 0] += 5.0
        logits[:, experts // 2:] -= 5.0
    weights, ids = route_reference(logits, RoutingConfig(experts, top_k, renormalize=True))
    return x, w13, w2, w13_scale, w2_scale, weights, ids


CASES = [  # (id, tokens, experts, top_k, hidden, inter, block, skewed)
    # bn = 32 < inter = 48: a scale block straddles the gate and the up rows; inter a partial K group.
    ("one-token", 1, 8, 2, 64, 48, (32, 32), False),
    # hidden 80 = 2.5 groups of 32, bn = 24 not a power of two, 3 experts of 6 receive nothing.
    ("partial-blocks", 13, 6, 3, 80, 40, (24, 32), False),
    # The models' 128 x 128 blocks, larger than the matrices; most of 40 tokens on expert 0.
    ("block-128", 40, 4, 2, 96, 64, (128, 128), True),
    ("even-blocks", 12, 16, 4, 128, 64, (64, 64), False),
]

LAYOUTS = {  # (mode, gate/up tile, down tile); BLOCK_K is set to bk by fp8_block_tiles
    "pairs": ("pairs", TileConfig(1, 32, 0), TileConfig(1, 16, 0)),
    "scan": ("scan", TileConfig(16, 32, 0, scan=16), TileConfig(16, 16, 0, scan=32)),
    "sorted": ("sorted", TileConfig(16, 32, 0), TileConfig(32, 16, 0)),
    "sorted-separate-act": ("sorted", TileConfig(16, 16, 0, fuse_act=False), TileConfig(16, 32, 0)),
}


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12))


def _assert_matches_reference(got, expected, dtype):
    """The Triton kernel and the reference quantize the same values, but their float32 sums
    differ in order: now and then an intermediate element rounds to the neighbouring float8 value
    (1/16 of it). With one token and 48 intermediate features that one step moves the token's
    output norm by up to ~1% (CI saw 0.8%), so the bounds allow a few such steps; a wrong scale,
    block or expert is off by tens of percent."""
    got, expected = got.float().cpu(), expected.float()
    scale = expected.abs().max().clamp(min=1e-6)
    tight = 1e-3 if dtype == torch.float32 else 1e-2
    bound = 30 * tight if dtype == torch.float32 else 3 * tight  # 3% either way
    assert _relative_error(got, expected) < bound
    torch.testing.assert_close(got / scale, expected / scale, atol=5e-2, rtol=0)


@needs_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,tokens,experts,top_k,hidden,inter,block,skewed", CASES, ids=[c[0] for c in CASES])
def test_triton_fp8_experts_match_reference(seed, monkeypatch, layout, name, tokens, experts, top_k, hidden, inter,
                                            block, skewed):
    monkeypatch.setattr(experts_triton, "tile_configs", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, w13_s, w2_s, weights, ids = _fp8_case(gen, tokens, experts, top_k, hidden, inter, block, skewed)
    expected = fused_experts_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids)
    dev = [t.to(DEVICE) for t in (x, w13, w2, w13_s, w2_s)]
    got = experts_triton.TritonFp8FusedExperts.forward(*dev, block, weights.to(DEVICE), ids.to(DEVICE))
    assert got.dtype == x.dtype and got.shape == x.shape
    _assert_matches_reference(got, expected, x.dtype)
    # Expert parallelism: the second half of the experts on this rank, the rest contribute nothing.
    half = experts // 2
    local = [t[half:] for t in (w13, w2, w13_s, w2_s)]
    expected = fused_experts_fp8_reference(x, *local, block, weights, ids, expert_start=half, num_experts=experts)
    got = experts_triton.TritonFp8FusedExperts.forward(dev[0], *(t.to(DEVICE) for t in local), block,
                                                       weights.to(DEVICE), ids.to(DEVICE), expert_start=half,
                                                       num_experts=experts)
    _assert_matches_reference(got, expected, x.dtype)


# 16-bit activations: the intermediate and each pair's output are rounded where the kernel stores
# them, as in the reference. bfloat16 on the GPU; in the interpreter float16 (the same path):
# Triton 3.9's interpreter casts float32 to bfloat16 by truncation where the GPU rounds to nearest.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@needs_triton
@pytest.mark.parametrize("layout", ["pairs", "scan", "sorted"])
def test_triton_fp8_experts_16_bit_activations(seed, monkeypatch, layout):
    monkeypatch.setattr(experts_triton, "tile_configs", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, w13_s, w2_s, weights, ids = _fp8_case(gen, 24, 8, 2, 64, 48, (32, 32))
    x = (x / 16).to(HALF)  # intermediates well inside float16's range
    expected = fused_experts_fp8_reference(x, w13, w2, w13_s, w2_s, (32, 32), weights, ids)
    got = experts_triton.TritonFp8FusedExperts.forward(*(t.to(DEVICE) for t in (x, w13, w2, w13_s, w2_s)),
                                                       (32, 32), weights.to(DEVICE), ids.to(DEVICE))
    assert got.dtype == HALF
    _assert_matches_reference(got, expected, HALF)


@needs_triton
def test_triton_fp8_default_tiles(seed):
    """Without a tuned table: the default layouts with BLOCK_K = bk (decode: pairs; more: scan)."""
    gen = torch.Generator().manual_seed(seed)
    for tokens in (1, 20):
        x, w13, w2, w13_s, w2_s, weights, ids = _fp8_case(gen, tokens, 8, 2, 64, 48, (32, 32))
        expected = fused_experts_fp8_reference(x, w13, w2, w13_s, w2_s, (32, 32), weights, ids)
        got = experts_triton.TritonFp8FusedExperts.forward(*(t.to(DEVICE) for t in (x, w13, w2, w13_s, w2_s)),
                                                           (32, 32), weights.to(DEVICE), ids.to(DEVICE))
        _assert_matches_reference(got, expected, x.dtype)


def test_fp8_block_tiles():
    """BLOCK_K = bk everywhere; bf16 tiles' gated GEMM made to fit its registers; FP8-tuned tiles
    (BLOCK_K already bk) kept; grouped_mm replaced by the default."""
    tiles = fp8_block_tiles(MoETiles("sorted", TileConfig(64, 128, 64), TileConfig(64, 128, 64)), 8, 4096, 128)
    assert tiles.up.block_k == tiles.down.block_k == 128
    assert (tiles.up.block_m, tiles.up.block_n, tiles.up.num_warps) == (64, 128, 8)
    assert tiles.down == TileConfig(64, 128, 128)  # one accumulator: as it was
    tiles = fp8_block_tiles(MoETiles("sorted", TileConfig(128, 128, 64, num_warps=8), TileConfig(16, 64, 64)),
                            8, 4096, 128)
    assert (tiles.up.block_m, tiles.up.block_n, tiles.up.num_warps) == (128, 64, 8)
    tuned = MoETiles("sorted", TileConfig(64, 128, 128), TileConfig(64, 128, 128))
    assert fp8_block_tiles(tuned, 8, 4096, 128) == tuned
    unfused = MoETiles("sorted", TileConfig(64, 128, 64, fuse_act=False), TileConfig(64, 128, 64))
    assert fp8_block_tiles(unfused, 8, 4096, 128).up == TileConfig(64, 128, 128, fuse_act=False)
    tiles = fp8_block_tiles(MoETiles("grouped_mm"), 8, 4096, 128)
    assert tiles.mode == default_tiles(8, 4096).mode and tiles.up.block_k == 128


def test_selection(monkeypatch):
    block = dict(dtype=torch.bfloat16, hidden=2048, inter=768)
    kernel = experts_triton.TritonFp8FusedExperts
    assert kernel.cannot_implement_reason(**block, block=(128, 128)) is None
    assert kernel.cannot_implement_reason(**block, block=(128, 16)) is not None  # float8 dots need K >= 32
    assert kernel.cannot_implement_reason(**block, block=(128, 96)) is not None  # BLOCK_K: a power of two
    assert kernel.cannot_implement_reason(**block) is not None
    assert kernel.cannot_implement_reason(**{**block, "dtype": torch.float8_e4m3fn}, block=(128, 128)) is not None
    if DEVICE == "cpu":
        assert select("fused_moe_fp8", torch.device("cpu"), **block, block=(128, 128)) is TorchFp8FusedExperts
        if experts_triton.INTERPRETED:
            monkeypatch.setenv("BARYON_KERNEL_FUSED_MOE_FP8", "triton")
            assert select("fused_moe_fp8", torch.device("cpu"), **block, block=(128, 128)) is kernel


def test_dequantize_block_fp8_is_per_element_scale(seed):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, 10, 7, generator=gen) * 50).to(FP8)
    scale = torch.rand(2, 4, 3, generator=gen) + 0.5  # blocks (3, 3): partial last row and column blocks
    got = dequantize_block_fp8(q, scale, (3, 3))
    for e in range(2):
        for n in range(10):
            for k in range(7):
                assert got[e, n, k] == q[e, n, k].float() * scale[e, n // 3, k // 3]


def test_reference_is_the_per_block_definition(seed):
    """The reference against the definition: per token and k, each GEMM as the sum over K blocks
    of x_scale[kb] * w_scale[n // bn, kb] * (float8 x[kb] . float8 w[n, kb]). An intermediate
    value within float32 noise of an FP8 rounding boundary may round either way in the reference
    (float32 GEMMs) and the definition (float64): such a value is tried both ways (seed 729833229
    has one)."""
    gen = torch.Generator().manual_seed(seed)
    block = (16, 32)
    hidden, inter, top_k = 80, 40, 3
    x, w13, w2, w13_s, w2_s, weights, ids = _fp8_case(gen, 5, 6, top_k, hidden, inter, block)
    got = fused_experts_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids)

    def gemm(q, s, w, ws):  # q [K] float8, s [K groups]; w [N, K] float8, ws [N blocks, K groups]
        out = torch.zeros(w.shape[0], dtype=torch.float64)
        for kb in range(s.numel()):
            cols = slice(kb * block[1], (kb + 1) * block[1])
            partial = w[:, cols].double() @ q[cols].double()
            out += partial * s[kb].double() * ws[torch.arange(w.shape[0]) // block[0], kb].double()
        return out

    def down(act, e):  # act [inter] float64
        aq, as_ = quantize_per_group_reference(act.float()[None], block[1], FP8)
        return gemm(aq[0], as_[0], w2[e], w2_s[e])

    def either_way(act):  # act, and act with each value near an FP8 boundary nudged across it
        codes = [quantize_per_group_reference((act * f).float()[None], block[1], FP8)[0].float()
                 for f in (1 - 1e-4, 1 + 1e-4)]
        near = torch.nonzero(codes[0] != codes[1])[:, 1].tolist()
        variants = [act]
        for j in near[:2]:  # (more than two such values in one row: none in 41 seeds)
            for f in (1 - 1e-4, 1 + 1e-4):
                nudged = act.clone()
                nudged[j] *= f
                variants.append(nudged)
        return variants

    for t in range(5):
        xq, xs = quantize_per_group_reference(x[t:t + 1], block[1], FP8)
        options = [torch.zeros(hidden, dtype=torch.float64)]
        for k in range(top_k):
            e = int(ids[t, k])
            gate, up = gemm(xq[0], xs[0], w13[e], w13_s[e]).split(inter)
            outs = [weights[t, k].double() * down(a, e) for a in either_way(F.silu(gate) * up)]
            options = [o + d for o in options for d in outs]
        errors = [(got[t].double() - o).abs() - 1e-4 * (1 + o.abs()) for o in options]
        assert any((err <= 0).all() for err in errors), f"token {t}: {min(err.max().item() for err in errors)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernel_is_float_on_dequantized_weights(seed, dtype):
    """The torch kernel (the CPU path) dequantizes the weights and leaves the activations alone:
    float32 on the dequantized weights, and within float8 rounding of the w8a8 reference."""
    gen = torch.Generator().manual_seed(seed)
    block = (24, 32)
    experts = 6
    x, w13, w2, w13_s, w2_s, weights, ids = _fp8_case(gen, 17, experts, 2, 80, 40, block)
    x = x.to(dtype)
    got = TorchFp8FusedExperts.forward(x, w13, w2, w13_s, w2_s, block, weights, ids)
    assert got.dtype == dtype
    w13_f, w2_f = dequantize_block_fp8(w13, w13_s, block), dequantize_block_fp8(w2, w2_s, block)
    expected = fused_experts_reference(x.float(), w13_f, w2_f, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, atol=tol * float(expected.abs().max()), rtol=tol)
    # The w8a8 reference also rounds both activations to float8 (1/16 at worst per element): over
    # 400 seeds the norm-relative gap averaged 0.04 and reached 0.16 where a few large elements
    # carry a token's norm; a wrong scale or a lost expert gives ~1.
    assert _relative_error(got, fused_experts_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids)) < 0.3
    # Expert parallelism: pairs routed to the other half contribute nothing.
    half = experts // 2
    got = TorchFp8FusedExperts.forward(x, w13[half:], w2[half:], w13_s[half:], w2_s[half:], block, weights, ids,
                                       expert_start=half, num_experts=experts)
    expected = fused_experts_reference(x.float(), w13_f[half:], w2_f[half:], weights, ids, expert_start=half)
    torch.testing.assert_close(got.float(), expected, atol=tol * float(expected.abs().max()), rtol=tol)


# -- INT8 W8A8 experts: the same kernels on int8 codes ------------------------------------------

def _int8_case(gen, tokens, experts, top_k, hidden, inter, bk):
    """Routed tokens and int8 experts with per-channel scales spread into (1 x bk) blocks (as
    quantization/moe_int8.py holds a compressed-tensors W8A8 checkpoint's experts)."""
    def weight(n, k):
        w = torch.randn(experts, n, k, generator=gen) / k ** 0.5 * torch.exp(torch.randn(experts, n, 1, generator=gen))
        scale = w.abs().amax(-1, keepdim=True) / 127  # [E, N, 1]
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return q, scale.expand(experts, n, -(-k // bk)).contiguous()

    x = torch.randn(tokens, hidden, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen))
    (w13, w13_s), (w2, w2_s) = weight(2 * inter, hidden), weight(hidden, inter)
    weights, ids = route_reference(torch.randn(tokens, experts, generator=gen),
                                   RoutingConfig(experts, top_k, renormalize=True))
    return x, w13, w2, w13_s, w2_s, weights, ids


@needs_triton
@pytest.mark.parametrize("layout", ["pairs", "scan", "sorted"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_triton_int8_experts_match_reference(seed, monkeypatch, layout, tokens):
    """int8 codes through the FP8 kernels: activations quantized to int8 per token in groups of
    bk, int32 dots scaled per K tile; the reference quantizes alike (w8a8). The torch kernel
    (weight-only, the CPU path) is within the activation rounding."""
    monkeypatch.setattr(experts_triton, "tile_configs", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    block = (1, 32)
    x, w13, w2, w13_s, w2_s, weights, ids = _int8_case(gen, tokens, 6, 2, 96, 64, block[1])
    expected = fused_experts_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids)
    got = experts_triton.TritonInt8FusedExperts.forward(*(t.to(DEVICE) for t in (x, w13, w2, w13_s, w2_s)), block,
                                                        weights.to(DEVICE), ids.to(DEVICE))
    assert got.dtype == x.dtype and got.shape == x.shape
    _assert_matches_reference(got, expected, x.dtype)
    half = 3  # expert parallelism: the second half of the experts here
    local = [t[half:] for t in (w13, w2, w13_s, w2_s)]
    expected = fused_experts_fp8_reference(x, *local, block, weights, ids, expert_start=half, num_experts=6)
    got = experts_triton.TritonInt8FusedExperts.forward(x.to(DEVICE), *(t.to(DEVICE) for t in local), block,
                                                        weights.to(DEVICE), ids.to(DEVICE), expert_start=half,
                                                        num_experts=6)
    _assert_matches_reference(got, expected, x.dtype)
    dequant = TorchInt8FusedExperts.forward(x, *local, block, weights, ids, expert_start=half, num_experts=6)
    # The activations' int8 rounding only: over 3,000 seeds a median of 1.2%, 99.9% under 8.5% and
    # at most 10.6% (a group whose largest value dwarfs the rest); a wrong scale row is off by ~100%.
    assert _relative_error(dequant, expected) < 0.15


@cpu_engine_with_triton
def test_int8_w8a8_moe_checkpoint_keeps_int8_experts(tmp_path, seed, monkeypatch):
    """A compressed-tensors W8A8 MoE checkpoint holds its experts as int8 codes (a quarter of
    float32) with their channel scales where the Triton kernel runs (interpreted here), as float
    experts dequantized once where only the torch kernel does; either way exactly the
    checkpoint's dequantized experts, and the engine generates."""
    import quant_checkpoints as qc
    from baryon import LLM, SamplingParams
    from conftest import make_checkpoint, random_prompts

    src = make_checkpoint(tmp_path / "float", "qwen3_moe", seed=seed, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16)
    checkpoint = qc.compressed_tensors(src, tmp_path / "w8a8", qc.ct_scheme("W8A8"), seed=seed)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 128, 3, 8, seed)]
    for kernel in ("torch", "triton"):
        monkeypatch.setenv("BARYON_KERNEL_FUSED_MOE_INT8", kernel)
        with LLM(str(checkpoint.path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                 kv_cache_memory_gib=0.01) as llm:
            experts = llm.engine.core.runner.model.model.layers[0].mlp.experts
            assert type(experts.method).__name__ == "Int8MoEMethod" and experts.method.kernel.name == kernel
            if kernel == "triton":
                assert experts.method.w13.dtype == experts.method.w2.dtype == torch.int8
            else:  # the torch kernel would dequantize every step: float experts, once
                assert experts.method.holds_dequantized and experts.w13_weight.dtype == torch.float32
            w13, w2 = experts.method.dequantize(experts)
            for e in range(4):
                prefix = f"model.layers.0.mlp.experts.{e}"
                ref = checkpoint.reference
                gate_up = torch.cat([ref[f"{prefix}.gate_proj.weight"], ref[f"{prefix}.up_proj.weight"]])
                assert torch.equal(w13[e], gate_up)
                assert torch.equal(w2[e], ref[f"{prefix}.down_proj.weight"])
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
