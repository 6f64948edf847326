"""DP attention with expert parallelism (CPU, gloo, two replica processes): data-parallel replicas
that run attention on their own requests and share a MoE model's experts.

A MoE block over two replicas equals the block with every expert on one rank, for replicas of
different token counts; an engine of two such replicas gives the same greedy tokens and logprobs
as one engine, also when one replica runs out of requests and the other still decodes (its
padding steps keep the MoE layers going); configurations it does not support are refused by
name; shutdown leaves no replica running.
"""

from __future__ import annotations

import pytest
import torch

from baryon import LLM, SamplingParams
from conftest import TEST_SEED, make_checkpoint, random_prompts, run_in_ranks

VOCAB = 128  # conftest's BASE_CONFIG
LOGPROB_TOL = 1e-4
EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 32, 16


def _moe_block(ep_size: int, ep_rank: int, seed: int, shared: bool = False):
    """A Qwen3-style block (softmax top-k router, SiLU experts; shared: plus a DeepSeek-style
    shared expert) with the same random weights on every rank; the rank keeps its slice of the
    experts."""
    from baryon.kernels.moe.routing import RoutingConfig
    from baryon.layers.fused_moe.block import SparseMoeBlock
    from baryon.layers.fused_moe.layer import FusedMoE
    from baryon.layers.fused_moe.router import Router
    from baryon.layers.mlp import GatedMLP

    generator = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(Router(HIDDEN, RoutingConfig(EXPERTS, TOP_K, renormalize=True)),
                           FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, ep_size=ep_size, ep_rank=ep_rank),
                           GatedMLP(HIDDEN, INTER, reduce_results=False) if shared else None)
    block.gate.weight.data.copy_(torch.randn(EXPERTS, HIDDEN, generator=generator))
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) / INTER ** 0.5
    start = block.experts.expert_start
    block.experts.w13_weight.data.copy_(w13[start:start + block.experts.num_local_experts])
    block.experts.w2_weight.data.copy_(w2[start:start + block.experts.num_local_experts])
    if shared:
        block.shared_experts.gate_up_proj.weight.data.copy_(torch.randn(2 * INTER, HIDDEN, generator=generator))
        block.shared_experts.down_proj.weight.data.copy_(torch.randn(HIDDEN, INTER, generator=generator) / INTER)
    return block


def _norm(seed: int):
    from baryon.layers.norm import RMSNorm

    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data.copy_(torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed + 99)))
    return norm


def _block_rank(rank: int, world: int, init_method: str, seed: int):
    """A spawned replica: its own tokens (a different count on each rank) through the block whose
    experts are divided among the replicas, padded to the agreed count; (x, output) as numpy."""
    from baryon.distributed.parallel_state import destroy_distributed, init_distributed
    from baryon.layers.forward_context import forward_context

    torch.set_num_threads(1)
    init_distributed(world, rank, init_method, "gloo", True, torch.float32, data_parallel=True)
    try:
        counts = [3, 7]
        x = torch.randn(counts[rank], HIDDEN, generator=torch.Generator().manual_seed(seed + rank))
        block = _moe_block(world, rank, seed)
        assert block.experts.num_local_experts == EXPERTS // world
        with torch.inference_mode(), forward_context(None, dp_padded_tokens=max(counts)):
            out = block(x)
        return x.numpy(), out.numpy()
    finally:
        destroy_distributed()


def _block_then_norm_rank(rank: int, world: int, init_method: str, seed: int, shared: bool):
    """As _block_rank, the block leaving its replicas' parts to the norm after it (what a
    LlamaModel sets up under DP attention): the parts of every replica's padded rows come out,
    and the norm reduce-scatters them with the residual add; (x, residual, out, new residual)."""
    from baryon.distributed.parallel_state import destroy_distributed, init_distributed
    from baryon.layers.forward_context import forward_context

    torch.set_num_threads(1)
    init_distributed(world, rank, init_method, "gloo", True, torch.float32, data_parallel=True)
    try:
        counts = [7, 3]  # replica 1 pads, and its rows start past replica 0's
        generator = torch.Generator().manual_seed(seed + rank)
        x, residual = torch.randn(counts[rank], HIDDEN, generator=generator), torch.randn(counts[rank], HIDDEN,
                                                                                        generator=generator)
        block, norm = _moe_block(world, rank, seed, shared), _norm(seed)
        block.reduce_results, norm.reduces_input = False, True
        with torch.inference_mode(), forward_context(None, dp_padded_tokens=max(counts)):
            parts = block(x)
            assert parts.shape == (world * max(counts), HIDDEN)
            out, residual_out = norm(parts, residual)
        return x.numpy(), residual.numpy(), out.numpy(), residual_out.numpy()
    finally:
        destroy_distributed()


@pytest.mark.parametrize("shared", [False, True])
def test_moe_block_left_to_the_norm_over_replicas(seed, shared):
    got = run_in_ranks(_block_then_norm_rank, 2, seed, shared)
    whole, norm = _moe_block(1, 0, seed, shared), _norm(seed)
    for rank, arrays in got.items():
        x, residual, out, residual_out = map(torch.from_numpy, arrays)
        with torch.inference_mode():
            expected, expected_residual = norm(whole(x), residual)
        torch.testing.assert_close(residual_out, expected_residual, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert (expected_residual - residual).abs().max() > 0.1  # the block's output is in it


def test_moe_block_over_replicas_equals_every_expert_on_one_rank(seed):
    got = run_in_ranks(_block_rank, 2, seed)
    whole = _moe_block(1, 0, seed)  # every expert, one rank, no exchange
    for rank, (x, out) in got.items():
        x, out = torch.from_numpy(x), torch.from_numpy(out)
        with torch.inference_mode():
            expected = whole(x)
        assert out.shape == x.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert expected.abs().max() > 0.1  # not vacuous: the experts produce something


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dp_attention_moe"), "qwen3_moe", seed=TEST_SEED % 2**31)


def _outputs(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_dp_attention_matches_one_engine(moe_path, seed):
    """Two replicas sharing the experts against one engine with all of them: greedy tokens and
    logprobs. Output lengths differ a lot, so one replica's requests end while the other's still
    decode, and prompts of different lengths put prefills beside decodes in the same round; a
    second call runs after both replicas went idle together."""
    _check_matches_one_engine(moe_path, seed)


def test_dp_attention_with_a_shared_expert_matches_one_engine(tmp_path, seed):
    """Qwen2-MoE: a gated shared expert beside the routed ones, whose output each replica adds to
    its own rows of the parts the next norm reduce-scatters; a dense layer between two MoE layers
    (its input norm reduce-scatters, so the C++ decoder layer must not take it)."""
    path = make_checkpoint(tmp_path, "qwen2_moe", seed=seed % 2**31, num_hidden_layers=3, mlp_only_layers=[1])
    _check_matches_one_engine(path, seed)


def _check_matches_one_engine(path, seed: int) -> None:
    from test_parallel_serving import wait_until_gone

    prompts = random_prompts(5, VOCAB, 3, 24, seed)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (2, 14, 3, 9, 1)]
    later = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    with LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True) as one:
        expected = _outputs(one, prompts, params) + _outputs(one, prompts[-1:], later)
    with LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, data_parallel_size=2,
             enable_expert_parallel=True) as two:
        assert two.config.parallel.data_parallel_attention
        got = _outputs(two, prompts, params) + _outputs(two, prompts[-1:], later)
        pids = [replica.pid for replica in two.engine.core.replicas]
    for i, ((tokens1, logprobs1), (tokens2, logprobs2)) in enumerate(zip(expected, got)):
        assert tokens2 == tokens1, f"prompt {i}: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2)) < LOGPROB_TOL, f"prompt {i}"
    wait_until_gone(pids, 10)  # shutdown stopped both replicas


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_dp_attention_with_drafts_matches_one_engine(moe_path, tmp_path, seed, method):
    """Speculative decoding on two DP-attention replicas (a verify step is read back before the
    next is planned, yet every round still meets the other replica): n-gram drafts, and a dense
    draft model on each replica; greedy tokens and logprobs equal one engine's without drafts."""
    prompts = [p * 3 for p in random_prompts(4, VOCAB, 3, 8, seed)]  # repetitive: n-gram drafts to verify
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 3, 9, 16)]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(make_checkpoint(tmp_path / "draft", "qwen3", seed=seed % 2**31, num_hidden_layers=1))
    with LLM(str(moe_path), device="cpu", dtype="float32", skip_tokenizer_init=True) as one:
        expected = _outputs(one, prompts, params)
    with LLM(str(moe_path), device="cpu", dtype="float32", skip_tokenizer_init=True, data_parallel_size=2,
             enable_expert_parallel=True, speculative_config=spec) as two:
        assert two.config.parallel.data_parallel_attention and two.config.speculative.method == method
        got = _outputs(two, prompts, params)
    for i, ((tokens1, logprobs1), (tokens2, logprobs2)) in enumerate(zip(expected, got)):
        assert tokens2 == tokens1, f"prompt {i}: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2)) < LOGPROB_TOL, f"prompt {i}"


@pytest.mark.parametrize("method", ["mtp", "moe_draft_model", "qwen3_next_mtp"])
def test_dp_attention_with_drafts_that_have_experts(moe_path, tmp_path, seed, method):
    """Drafts whose layers have experts (DeepSeek-V3's and Qwen3-Next's MTP layer, chained for k =
    2; a MoE draft model, here the target itself, whose drafts are all right): under DP attention each replica
    runs every draft forward pass with the other (the passes' MoE rows agreed once per propose; a
    replica without rows in a pass runs padding). Greedy tokens, logprobs and the drafts proposed
    and accepted equal one engine's with the same draft; output lengths differ, so one replica
    idles while the other still drafts."""
    from test_deepseek_mtp import build_with_mtp

    if method == "mtp":
        path, _, _ = build_with_mtp(tmp_path / "mtp")
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    elif method == "qwen3_next_mtp":  # a hybrid target: linear-attention states commit per replica
        from conftest import make_checkpoint
        from test_hybrid_spec_decode import _with_mtp_weights

        path = make_checkpoint(tmp_path / "qwen3_next", "qwen3_next", seed=seed % 1000)
        _with_mtp_weights(path, "qwen3_next", seed % 1000)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        path, spec = moe_path, {"method": "draft_model", "model": str(moe_path), "num_speculative_tokens": 3}
    prompts = random_prompts(4, VOCAB, 3, 12, seed)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 3, 9, 16)]
    results = {}
    for replicas in (1, 2):
        layout = dict(data_parallel_size=2, enable_expert_parallel=True) if replicas == 2 else {}
        with LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, speculative_config=spec,
                 **layout) as llm:
            assert llm.config.parallel.data_parallel_attention == (replicas == 2)
            outputs = _outputs(llm, prompts, params)
            stats = llm.engine.core.spec_stats  # (the replicas': as of their last messages)
            results[replicas] = outputs, (stats.num_draft_tokens, stats.num_accepted_tokens)
    (expected, drafts_one), (got, drafts_two) = results[1], results[2]
    assert drafts_one[0] > 0, "no draft proposed"
    if method == "moe_draft_model":
        assert drafts_one[1] > 0, "the target as its own draft had no draft accepted"
    for i, ((tokens1, logprobs1), (tokens2, logprobs2)) in enumerate(zip(expected, got)):
        assert tokens2 == tokens1, f"prompt {i}: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2)) < LOGPROB_TOL, f"prompt {i}"
    assert drafts_two == drafts_one, "the replicas drafted otherwise than one engine"


def test_dp_attention_configuration(moe_path, tmp_path):
    from baryon.config import EngineConfig

    base = dict(model=str(moe_path), device="cpu", skip_tokenizer_init=True, data_parallel_size=2)
    config = EngineConfig.create(**base, enable_expert_parallel=True)
    replicas = config.replicas()
    assert [r.parallel.data_parallel_rank for r in replicas] == [0, 1]
    assert replicas[0].parallel.data_parallel_init_method == replicas[1].parallel.data_parallel_init_method
    assert all(r.parallel.data_parallel_size == 2 and r.parallel.data_parallel_attention for r in replicas)
    # Without expert parallelism the replicas are independent engines, each with every expert.
    plain = EngineConfig.create(**base).replicas()
    assert all(r.parallel.data_parallel_size == 1 and not r.parallel.data_parallel_attention for r in plain)
    # A dense model has no experts to share: independent replicas.
    dense = make_checkpoint(tmp_path / "dense", "llama", seed=1)
    assert not EngineConfig.create(**{**base, "model": str(dense)}, enable_expert_parallel=True
                                   ).parallel.data_parallel_attention
    with pytest.raises(ValueError, match=r"DP attention.*tensor_parallel_size=2"):
        EngineConfig.create(**base, enable_expert_parallel=True, tensor_parallel_size=2)
    # Every kind of draft runs: n-gram and dense drafts on each replica alone, drafts with experts
    # (MTP layers, a MoE draft model) in step with the other replicas.
    for spec in ({"method": "ngram", "num_speculative_tokens": 2},
                 {"method": "draft_model", "model": str(moe_path), "num_speculative_tokens": 2}):
        config = EngineConfig.create(**base, enable_expert_parallel=True, speculative_config=spec)
        assert config.parallel.data_parallel_attention and config.speculative.method == spec["method"]


def test_server_with_dp_attention(moe_path, seed):
    """`baryon serve --data-parallel-size 2 --enable-expert-parallel`: concurrent completions
    spread over both replicas come back with the offline engine's greedy tokens, and SIGTERM
    stops the server and both replicas."""
    from test_parallel_serving import assert_sigterm_stops_everything
    from test_server import ServerProcess, child_pids, post_concurrently

    prompts = random_prompts(4, VOCAB, 3, 16, seed)
    with LLM(str(moe_path), device="cpu", dtype="float32", skip_tokenizer_init=True) as one:
        expected = [t for t, _ in _outputs(one, prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                       ignore_eos=True, logprobs=0))]
    server = ServerProcess(moe_path, "--skip-tokenizer-init", "--dtype", "float32", "--data-parallel-size", "2",
                           "--enable-expert-parallel")
    try:
        server.wait_ready()
        assert len(child_pids(server.process.pid)) == 2  # one engine process per replica
        bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0} for p in prompts]
        results = post_concurrently(server.url, "/v1/completions", bodies)
        for i, result in enumerate(results):
            assert result["usage"]["completion_tokens"] == 6, result
            tokens = [int(t.split(":")[1]) for t in result["choices"][0]["logprobs"]["tokens"]]  # "token_id:<id>"
            assert tokens == expected[i], f"prompt {i}"
        assert_sigterm_stops_everything(server)
    finally:
        server.stop()
