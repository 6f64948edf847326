"""MoE kernels against their torch references: routing (softmax / sigmoid, grouped, with a
correction bias, ties), the alignment of pairs to expert tiles, and the expert GEMMs (Triton in
both layouts, torch._grouped_mm). Triton runs on CUDA when present, else in the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baryon.kernels.moe import experts_triton
from baryon.kernels.moe.align import align_pairs, align_pairs_triton, padded_capacity
from baryon.kernels.moe.experts_grouped_mm import GroupedMMFusedExperts
from baryon.kernels.moe.experts_torch import fused_experts_reference
from baryon.kernels.moe.routing import RoutingConfig, TritonRouting, route_reference
from baryon.kernels.moe.tile_configs import MoETiles, TileConfig, default_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(experts_triton.triton is None, reason="triton is not installed")

ROUTINGS = [  # (id, config, with a correction bias)
    ("softmax-top2", RoutingConfig(8, 2), False),
    ("softmax-top4-renorm", RoutingConfig(16, 4, renormalize=True), False),
    ("softmax-top6-of-12", RoutingConfig(12, 6, renormalize=True), False),
    ("top-k-equals-experts", RoutingConfig(4, 4, renormalize=True), False),
    ("one-expert", RoutingConfig(1, 1), False),
    ("sigmoid-grouped-bias", RoutingConfig(16, 4, True, "sigmoid", num_groups=4, topk_group=2,
                                           routed_scaling_factor=2.5), True),
    ("sigmoid-160-experts-one-group", RoutingConfig(160, 8, True, "sigmoid", routed_scaling_factor=1.8), True),
    ("softmax-grouped-max", RoutingConfig(24, 3, False, "softmax", num_groups=8, topk_group=3), False),
    ("sigmoid-grouped-unnormalised", RoutingConfig(20, 5, False, "sigmoid", num_groups=5, topk_group=3), True),
]


def _on_grid(values: torch.Tensor) -> torch.Tensor:
    """values rounded to multiples of 1/256: two scores are then equal or clearly apart. Distinct
    random floats can sit an ulp apart (0.18950397 and 0.18950400 did), where the kernel's exp and
    torch's may order them differently; exact ties stay, and must go to the lower index."""
    return torch.round(values * 256) / 256


def _logits(gen: torch.Generator, tokens: int, experts: int) -> torch.Tensor:
    logits = _on_grid(torch.randn(tokens, experts, generator=gen))
    if tokens > 2:
        logits[0] = 0.0  # every expert tied
        logits[1, : experts // 2] = logits[1, experts // 2:experts // 2 * 2]  # pairs of equal values
    return logits


@needs_triton
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("name,config,bias", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_triton_routing_matches_reference(seed, monkeypatch, tokens, name, config, bias):
    monkeypatch.setenv("BARYON_KERNEL_MOE_ROUTING", "triton")
    gen = torch.Generator().manual_seed(seed)
    logits = _logits(gen, tokens, config.num_experts)
    correction = _on_grid(torch.randn(config.num_experts, generator=gen) * 0.3) if bias else None
    weights, ids = route_reference(logits, config, correction)
    got_weights, got_ids = TritonRouting.forward(logits.to(DEVICE), config,
                                                 None if correction is None else correction.to(DEVICE))
    assert torch.equal(got_ids.cpu(), ids), f"{name}: chosen experts differ (ties must go to the lower index)"
    torch.testing.assert_close(got_weights.cpu(), weights, atol=1e-6, rtol=1e-5)


def test_reference_ties_go_to_the_lower_expert():
    weights, ids = route_reference(torch.zeros(2, 8), RoutingConfig(8, 3, renormalize=True))
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize("routing", ["qwen3", "glm4"])
def test_reference_routing_matches_transformers_routers(seed, routing):
    """The reference chooses what transformers' routers choose (as sets) with the same weights."""
    import transformers as tf

    torch.manual_seed(seed)
    hidden, tokens = 32, 50
    if routing == "qwen3":
        hf_config = tf.Qwen3MoeConfig(hidden_size=hidden, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
        router = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(hf_config)
        config, bias = RoutingConfig(16, 4, renormalize=True), None
    else:
        hf_config = tf.Glm4MoeConfig(hidden_size=hidden, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                     topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=True)
        router = tf.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(hf_config)
        router.e_score_correction_bias.normal_(0, 0.2)
        config = RoutingConfig(16, 4, True, "sigmoid", num_groups=4, topk_group=2, routed_scaling_factor=2.0)
        bias = router.e_score_correction_bias
    router.weight.data.normal_(0, 0.5)
    x = torch.randn(tokens, hidden)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
        weights, ids = route_reference(F.linear(x, router.weight), config, bias)
    hf_order, order = hf_ids.argsort(dim=1), ids.long().argsort(dim=1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.long().gather(1, order))
    torch.testing.assert_close(hf_weights.gather(1, hf_order).float(), weights.gather(1, order))


@pytest.mark.parametrize("tokens,top_k,experts,block_m,start,local", [
    (1, 2, 8, 16, 0, 8), (40, 3, 8, 16, 0, 8), (33, 8, 64, 4, 0, 64), (20, 2, 8, 16, 4, 4), (7, 4, 4, 1, 0, 4)])
def test_align_pairs_groups_pairs_by_expert(seed, tokens, top_k, experts, block_m, start, local):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    sorted_pairs, block_experts, num_padded = align_pairs(ids, local, start, block_m)
    num_pairs = ids.numel()
    assert sorted_pairs.numel() == padded_capacity(num_pairs, local, block_m)
    flat = ids.flatten() - start
    owned = [p for p in range(num_pairs) if 0 <= flat[p] < local]
    used = sorted_pairs[: int(num_padded)]
    assert sorted(p for p in used.tolist() if p < num_pairs) == owned  # each owned pair exactly once
    assert bool((sorted_pairs[int(num_padded):] == num_pairs).all())
    for block in range(int(num_padded) // block_m):
        rows = used[block * block_m:(block + 1) * block_m]
        real = rows[rows < num_pairs].tolist()
        assert real, "a block with no pair"
        assert all(flat[p] == block_experts[block] for p in real)
        assert real == sorted(real)  # pair order within an expert
    counts = torch.bincount(flat[(flat >= 0) & (flat < local)], minlength=local)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())


@needs_triton
@pytest.mark.parametrize("tokens,top_k,experts,block_m,start,local", [
    (1, 2, 8, 16, 0, 8), (300, 8, 64, 4, 0, 64), (20, 2, 8, 16, 4, 4), (7, 4, 4, 1, 0, 4), (500, 6, 160, 64, 80, 80),
    # 69 chunks of pairs: the offsets kernel's running sums over two tiles of chunks
    (1100, 8, 128, 16, 0, 128),
    # 2 chunks and 220 blocks of rows: each scatter program names seven strides of blocks
    (30, 8, 200, 2, 0, 200)])
def test_triton_align_equals_reference(seed, tokens, top_k, experts, block_m, start, local):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    expected = align_pairs(ids, local, start, block_m)
    got = align_pairs_triton(ids.to(DEVICE), local, start, block_m)
    for name, a, b in zip(("sorted_pairs", "block_experts", "num_padded"), expected, got):
        assert torch.equal(a, b.cpu()), name


def _routing_case(gen, tokens, experts, top_k, hidden, inter, dtype=torch.float32, skewed=False):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if skewed:  # most tokens to expert 0 (and a few experts receive nothing)
        logits[:, 0] += 5.0
        logits[:, experts // 2:] -= 5.0
    weights, ids = route_reference(logits, RoutingConfig(experts, top_k, renormalize=True))
    return x, w13, w2, weights, ids


EXPERT_CASES = [  # (id, tokens, experts, top_k, hidden, inter, skewed)
    ("one-token", 1, 8, 2, 32, 48, False),
    ("empty-experts", 3, 16, 2, 64, 32, False),
    ("many-per-expert", 40, 4, 2, 48, 80, True),
    ("top-k-all", 9, 4, 4, 32, 32, False),
    ("odd-sizes", 13, 6, 3, 40, 24, False),
]


LAYOUTS = {  # (mode, gate/up tile, down tile): every layout, the fused and the separate activation
    "pairs": ("pairs", TileConfig(1, 32, 32), TileConfig(1, 16, 64)),
    "scan": ("scan", TileConfig(16, 32, 32, scan=16), TileConfig(16, 16, 64, scan=32)),
    "sorted": ("sorted", TileConfig(16, 32, 64), TileConfig(32, 16, 32)),
    "sorted-separate-act": ("sorted", TileConfig(16, 16, 32, fuse_act=False), TileConfig(16, 32, 64)),
}


@needs_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,tokens,experts,top_k,hidden,inter,skewed", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
def test_triton_experts_match_reference(seed, monkeypatch, layout, name, tokens, experts, top_k, hidden, inter, skewed):
    monkeypatch.setattr(experts_triton, "tile_configs", lambda *args: MoETiles(*LAYOUTS[layout]))
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, weights, ids = _routing_case(gen, tokens, experts, top_k, hidden, inter, skewed=skewed)
    expected = fused_experts_reference(x, w13, w2, weights, ids)
    got = experts_triton.TritonFusedExperts.forward(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    # Expert parallelism: the second half of the experts on this rank, the rest contribute nothing.
    half = experts // 2
    expected = fused_experts_reference(x, w13[half:], w2[half:], weights, ids, expert_start=half)
    got = experts_triton.TritonFusedExperts.forward(*(t.to(DEVICE) for t in (x, w13[half:], w2[half:], weights, ids)),
                                                    expert_start=half, num_experts=experts)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 2, 24), (7, 4, 40), (33, 8, 1500)])
def test_sum_topk_sums_only_the_ranks_own_pairs(seed, tokens, top_k, hidden):
    """Expert parallelism: the sum over k leaves out pairs routed to other ranks' experts, whose
    rows of y were never written (NaN here: reading one would show)."""
    gen = torch.Generator().manual_seed(seed)
    experts, start, local = 16, 4, 8
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    y = torch.randn(tokens * top_k, hidden, generator=gen)
    mine = ((ids >= start) & (ids < start + local)).reshape(-1)
    y[~mine] = float("nan")
    expected = torch.where(mine[:, None], y, 0.0).view(tokens, top_k, hidden).sum(dim=1)
    got = experts_triton.sum_topk(y.to(DEVICE), tokens, top_k, ids.to(DEVICE), start, local)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    full = experts_triton.sum_topk(torch.randn(tokens * top_k, hidden, generator=gen).to(DEVICE), tokens, top_k)
    assert torch.isfinite(full).all() and full.shape == (tokens, hidden)


@pytest.mark.parametrize("name,tokens,experts,top_k,hidden,inter,skewed", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
def test_grouped_mm_experts_match_reference(seed, name, tokens, experts, top_k, hidden, inter, skewed):
    if not hasattr(torch, "_grouped_mm") or (DEVICE == "cuda" and GroupedMMFusedExperts.unsupported_reason(
            torch.device(DEVICE))):
        pytest.skip("no torch._grouped_mm here")  # on CPU torch has one too: the same code path is tested
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, w13, w2, weights, ids = _routing_case(gen, tokens, experts, top_k, hidden, inter, dtype, skewed)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    got = GroupedMMFusedExperts.forward(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)
    half = experts // 2
    expected = fused_experts_reference(x.float(), w13[half:].float(), w2[half:].float(), weights, ids, half)
    got = GroupedMMFusedExperts.forward(*(t.to(DEVICE) for t in (x, w13[half:], w2[half:], weights, ids)),
                                        expert_start=half, num_experts=experts)
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)


def test_reference_is_the_per_token_definition(seed):
    """The reference against the plain definition: each token through each of its k experts."""
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, weights, ids = _routing_case(gen, 6, 5, 3, 16, 24)
    got = fused_experts_reference(x, w13, w2, weights, ids)
    for t in range(6):
        expected = torch.zeros(16)
        for k in range(3):
            gate, up = (w13[ids[t, k]] @ x[t]).split(24)
            expected += weights[t, k] * (w2[ids[t, k]] @ (F.silu(gate) * up))
        torch.testing.assert_close(got[t], expected, atol=1e-5, rtol=1e-5)


def test_default_layout_follows_the_tuned_tables():
    """Without a table for the GPU: the pairs GEMVs for a few pairs, the scan kernels while experts
    average fewer than 12 rows, sorted past that, where the H100 and H200 tables switch (DeepSeek-V2-
    Lite's 64 experts at 256 tokens x 6 took the scan kernels before: 623 against 403 us on an H200)."""
    assert default_tiles(64, 2 * 6).mode == "pairs"
    assert default_tiles(64, 64 * 6).mode == "scan"
    assert default_tiles(64, 256 * 6).mode == "sorted"
    assert default_tiles(128, 128 * 8).mode == "scan"
    assert default_tiles(128, 192 * 8).mode == "sorted"
    assert default_tiles(8, 20 * 2).mode == "scan"  # 5 rows an expert
    tiles = [default_tiles(64, pairs) for pairs in (768, 3072, 16384)]  # 12, 48, 256 rows an expert
    assert [t.up.block_m for t in tiles] == [32, 64, 128]
