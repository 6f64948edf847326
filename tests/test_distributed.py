"""Tensor and expert parallelism on CPU (gloo): TP=2 matches TP=1 token for token, each rank loads
only its shard of the checkpoint, and bad parallel configurations fail clearly without leaving
worker processes behind."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from torch.utils._pytree import tree_flatten

from baryon import LLM, SamplingParams
from conftest import TEST_SEED, make_checkpoint, random_prompts, run_in_ranks

VOCAB = 128  # conftest's BASE_CONFIG
LOGPROB_TOL = 1e-4


# -- helpers ---------------------------------------------------------------------------------------


def _worker_children() -> set[int]:
    """Live `python -m baryon.runner.worker` processes whose parent is this process (the engine
    launches them with subprocess.Popen, so multiprocessing does not know them)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"baryon.runner.worker" in cmdline:
            found.add(int(entry))
    return found


def _run(path, tp: int, prompts: list[list[int]], *param_sets, **engine_kwargs):
    """Generate `prompts` once per entry of `param_sets` with one fresh engine of `tp` ranks, shut
    it down, and check that its workers are gone. Returns one list of outputs per entry."""
    before = _worker_children()
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", skip_tokenizer_init=True,
             **engine_kwargs) as llm:
        if tp > 1:
            assert len(_worker_children() - before) == tp - 1, "expected one worker process per extra rank"
        outputs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                   for params in param_sets]
    assert not _worker_children() - before, "shutdown left worker processes running"
    return outputs


def _chosen_logprobs(completion) -> list[float]:
    return [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]


def _assert_prompt_logprobs_match(ref, got, k: int) -> None:
    """Position by position: the prompt token's logprob and every top-k entry agree. A top-k entry
    of one side may only be missing on the other where it ties with the k-th (a near-tie within
    the tolerance may order the two differently)."""
    assert len(ref) == len(got) and ref[0] is None and got[0] is None
    for pos, (a, b) in enumerate(zip(ref[1:], got[1:]), 1):
        assert len(a) >= k and len(b) >= k, f"position {pos}: fewer than {k} entries"
        for token in a.keys() & b.keys():
            assert abs(a[token].logprob - b[token].logprob) < LOGPROB_TOL, f"position {pos}, token {token}"
        for x, y in ((a, b), (b, a)):
            kth = min(e.logprob for e in y.values() if e.rank <= k)
            for token in x.keys() - y.keys():
                assert x[token].rank <= k, f"position {pos}: prompt token {token} missing from one side"
                assert abs(x[token].logprob - kth) < LOGPROB_TOL, \
                    f"position {pos}: top-{k} token {token} ({x[token].logprob}) absent on the other side"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name, arch, **overrides): a random checkpoint (fresh weights each session seed),
    made once per module."""
    made = {}

    def get(name: str, arch: str, **overrides):
        if name not in made:
            made[name] = make_checkpoint(tmp_path_factory.mktemp(name), arch, seed=TEST_SEED % 2**31, **overrides)
        return made[name]

    return get


# -- 1. parity ---------------------------------------------------------------------------------------

PARITY_CASES = {
    # name: (arch, checkpoint overrides, extra engine arguments at TP=2)
    "llama-gqa": ("llama", {}, {}),  # 4 heads / 2 KV heads: both split
    "qwen2-1kv-tied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True), {}),  # KV head replicated
    "qwen3_moe-ep": ("qwen3_moe", {}, dict(enable_expert_parallel=True)),  # 4 experts per rank
    "qwen3_moe-tp": ("qwen3_moe", {}, {}),  # every expert, half its intermediate size per rank
    "qwen3-qknorm": ("qwen3", {}, {}),  # per-head QK RMSNorm on each rank's heads
    "deepseek_v2-mla": ("deepseek_v2", {}, {}),  # latent attention: heads split, the latent whole
    "gpt_oss-sinks": ("gpt_oss", {}, {}),  # attention sinks split with the heads, MXFP4-free experts
    "phi3-fused": ("phi3", {}, {}),  # the checkpoint's fused qkv_proj / gate_up_proj cut per rank
    "phi3-1kv-fused": ("phi3", dict(num_key_value_heads=1), {}),  # ... with the one KV head replicated
    # sandwich norms on each rank's reduced block outputs, scaled embeddings, local / global layers
    "gemma3-window": ("gemma3", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"]), {}),
    # attention and MLP side by side on one LayerNorm, q / k rows reordered before each rank's slice
    "cohere-parallel-blocks": ("cohere", dict(logit_scale=0.25), {}),
    # q/k norms over all heads: each rank's sum of squares all-reduced (1 KV head: replicated on both)
    "olmo2-qk-norms": ("olmo2", dict(), {}),
    "olmo2-1kv-replicated": ("olmo2", dict(num_key_value_heads=1), {}),
    # each rank's block outputs scaled before the all-reduce; logits divided after the gather
    "granite-multipliers": ("granite", dict(embedding_multiplier=6.0, attention_multiplier=0.125,
                                            residual_multiplier=0.3, logits_scaling=4.0), {}),
    # soft-capped scores per rank's heads, the final cap on the gathered vocabulary
    "gemma2-softcaps": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0), {}),
    # Gated DeltaNet: each rank's key heads with their value heads, their conv channels of q / k / v,
    # A_log / dt_bias and state slots; the interleaved projections de-interleaved before the slices
    "qwen3_next-linear-attention": ("qwen3_next", {}, {}),
    "qwen3_5-projections-apart": ("qwen3_5", {}, {}),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_tp2_matches_tp1(case, checkpoint, seed):
    arch, overrides, extra = PARITY_CASES[case]
    path = checkpoint(case if overrides else arch, arch, **overrides)  # (cases without overrides share one)
    prompts = random_prompts(3, VOCAB, 3, 12, seed)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    # Greedy with nothing else asked: each rank's argmax over its vocabulary slice, exchanged.
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref, ref_plain = _run(path, 1, prompts, params, plain)
    got, got_plain = _run(path, 2, prompts, params, plain, **extra)
    for i, (a, b, c) in enumerate(zip(ref, got, got_plain)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}: greedy tokens differ"
        assert c.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i}: argmax-only greedy tokens differ"
        assert len(a.outputs[0].token_ids) == 8
        la, lb = _chosen_logprobs(a.outputs[0]), _chosen_logprobs(b.outputs[0])
        assert max(abs(x - y) for x, y in zip(la, lb)) < LOGPROB_TOL, f"prompt {i}: logprobs {la} vs {lb}"
        _assert_prompt_logprobs_match(a.prompt_logprobs, b.prompt_logprobs, k=2)


def _argmax_rank(rank: int, world: int, init_method: str, vocab: int, seed: int) -> dict:
    """A spawned gloo rank: ParallelLMHead.argmax over this rank's slice of shared random logits
    with many ties (values from {0, 1, 2, 3}) and the padding columns past the vocabulary holding
    the largest value; per dtype, the ids it found."""
    from baryon.distributed.parallel_state import destroy_distributed, init_distributed
    from baryon.layers.embedding import ParallelLMHead

    torch.set_num_threads(1)
    init_distributed(world, rank, init_method, "gloo", expert_parallel=False, dtype=torch.float32)
    try:
        head = ParallelLMHead(vocab, 8)
        full = torch.randint(0, 4, (33, vocab), generator=torch.Generator().manual_seed(seed)).float()
        local = torch.full((33, head.rows_per_rank), 9.0)
        local[:, : head.vocab_end - head.vocab_start] = full[:, head.vocab_start:head.vocab_end]
        return {str(dtype): head.argmax(local.to(dtype)).numpy() for dtype in (torch.float32, torch.bfloat16)}
    finally:
        destroy_distributed()


@pytest.mark.parametrize("vocab", [37, 40])
def test_vocab_parallel_argmax_matches_the_gathered_one(seed, vocab):
    """Two ranks find the first id of each row's largest logit, as an argmax over the whole row
    does: ties inside a rank's slice and across the ranks, and the last rank's padding ignored."""
    results = run_in_ranks(_argmax_rank, 2, vocab, seed)
    full = torch.randint(0, 4, (33, vocab), generator=torch.Generator().manual_seed(seed)).float()
    expected = full.argmax(dim=-1).numpy()
    top = full == full.max(dim=-1, keepdim=True).values  # [33, vocab]
    half = -(-vocab // 2)
    assert (top[:, :half].any(dim=-1) & top[:, half:].any(dim=-1)).any()  # some rows tie across the ranks
    for rank in (0, 1):
        for ids in results[rank].values():
            assert ids.tolist() == expected.tolist()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2-ep", "dp2-attention-ep"])
def test_deepseek_v3_fp8_blocks_across_ranks_match_one(checkpoint, tmp_path, seed, layout):
    """Issue 16's layouts in miniature: DeepSeek-V3 (latent attention with query LoRA, grouped
    noaux_tc routing, a shared expert) from an FP8 128x128-style block checkpoint (16x16 blocks
    here) over two ranks, with heads split (TP), experts divided (EP) or replicas sharing the
    experts (DP attention), gives one rank's greedy tokens and logprobs."""
    from quant_checkpoints import fp8_block

    path = fp8_block(checkpoint("deepseek_v3", "deepseek_v3"), tmp_path / "fp8").path
    prompts = random_prompts(4, VOCAB, 3, 14, seed)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (ref,) = _run(path, 1, prompts, params)
    if "data_parallel_size" in layout:
        with LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, **layout) as llm:
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    else:
        (got,) = _run(path, layout["tensor_parallel_size"], prompts, params,
                      **{k: v for k, v in layout.items() if k != "tensor_parallel_size"})
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}: greedy tokens differ"
        la, lb = _chosen_logprobs(a.outputs[0]), _chosen_logprobs(b.outputs[0])
        assert max(abs(x - y) for x, y in zip(la, lb)) < LOGPROB_TOL, f"prompt {i}: logprobs {la} vs {lb}"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tp_norms_reduce_what_the_blocks_leave(checkpoint, arch):
    """Under TP the o/down projections and MoE blocks leave their sums to the RMSNorm after them
    (one fused call on GPUs); the parity tests above check the numbers."""
    path = checkpoint(arch, arch)
    with LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", skip_tokenizer_init=True) as llm:
        model = llm.engine.core.runner.model.model
        for i, layer in enumerate(model.layers):
            assert layer.self_attn.o_proj.reduce_results is False and layer.post_attention_layernorm.reduces_input
            block = layer.mlp.down_proj if arch == "llama" else layer.mlp
            assert block.reduce_results is False
            assert (model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm).reduces_input
        assert not model.layers[0].input_layernorm.reduces_input  # the embedding reduces its own sum


def test_tp2_seeded_sampling_matches_tp1(checkpoint, seed):
    """Random sampling with a per-request seed: rank 0 samples from the gathered logits, so TP=2
    draws the same tokens as TP=1."""
    path = checkpoint("llama", "llama")
    prompts = random_prompts(3, VOCAB, 3, 12, seed)
    params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    other = [SamplingParams(temperature=0.8, seed=seed + 1000 + i, max_tokens=10, ignore_eos=True)
             for i in range(len(prompts))]
    ref, ref_other = ([o.outputs[0].token_ids for o in outs] for outs in _run(path, 1, prompts, params, other))
    (got,) = ([o.outputs[0].token_ids for o in outs] for outs in _run(path, 2, prompts, params))
    assert ref == got
    # Not vacuous: other seeds draw other tokens (at T=0.8 nearly every token differs).
    assert ref_other != ref


# -- 2. each rank loads only its shard -------------------------------------------------------------
#
# What is counted: the bytes of checkpoint tensors that the loader consumes, i.e. that reach a
# parameter (copy_ into it, .to(dtype), .clone(), ...). Every tensor the checkpoint iterator yields
# is wrapped in _Counted; a view of it (narrow, slicing, chunk) stays wrapped and counts nothing; an
# op whose result does not share storage with a wrapped input counts the bytes of its wrapped
# inputs. This measures the loader's sharding, not disk I/O: safetensors' get_tensor hands out each
# tensor whole (see the report), whichever part of it a rank then keeps.


class _Counted(torch.Tensor):
    read_bytes = 0  # per process

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            counted = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, _Counted)]
            result = func(*args, **kwargs)
            storages = {t.untyped_storage().data_ptr() for t in counted}
            nbytes = sum(t.numel() * t.element_size() for t in counted)

            def settle(value):
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                    return value.as_subclass(cls)  # a view: still the checkpoint's bytes
                if isinstance(value, torch.Tensor):  # data left the checkpoint tensor
                    cls.read_bytes += nbytes
                return value

            if isinstance(result, (tuple, list)) and result and all(isinstance(v, torch.Tensor) for v in result):
                if all(v.untyped_storage().data_ptr() in storages for v in result):
                    return type(result)(v.as_subclass(cls) for v in result)
                cls.read_bytes += nbytes
                return result
            if func in (torch.Tensor.__setitem__, torch.Tensor.item, torch.Tensor.tolist):
                cls.read_bytes += nbytes
                return result
            return settle(result)


def _counting_load(path: str) -> int:
    """Load the model at `path` on this process's rank with every checkpoint tensor counted;
    returns the bytes consumed."""
    from baryon.config import EngineConfig
    from baryon.loader import model_loader

    original = model_loader.checkpoint_weights

    def counted(*args, **kwargs):
        for name, tensor, file in original(*args, **kwargs):
            yield name, tensor.as_subclass(_Counted), file

    _Counted.read_bytes = 0
    model_loader.checkpoint_weights = counted
    try:
        config = EngineConfig.create(model=path, device="cpu", dtype="float32", skip_tokenizer_init=True).model
        model = model_loader.load_model(config, torch.device("cpu"))
    finally:
        model_loader.checkpoint_weights = original
    assert not any(isinstance(p, _Counted) for p in model.parameters())
    return _Counted.read_bytes


def _rank_main(rank: int, world_size: int, init_method: str, path: str) -> int:
    """A spawned rank: join the group, load with counting; the bytes it read."""
    from baryon.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(world_size, rank, init_method, "gloo", expert_parallel=False, dtype=torch.float32)
    try:
        return _counting_load(path)
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def load_checkpoint(tmp_path_factory):
    """Big enough that the matrices dominate: 8 heads / 4 KV heads of 32, hidden 256, vocab 512."""
    return make_checkpoint(tmp_path_factory.mktemp("load_llama"), "llama", seed=TEST_SEED % 2**31,
                           hidden_size=256, intermediate_size=512, vocab_size=512, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4)


def test_each_rank_reads_only_its_shard(load_checkpoint):
    sizes = {}
    for file in load_checkpoint.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                t = handle.get_tensor(name)
                sizes[name] = t.numel() * t.element_size()
    total = sum(sizes.values())
    replicated = sum(n for name, n in sizes.items() if name.endswith("norm.weight"))  # RMSNorm weights
    assert 0 < replicated < 0.01 * total

    # One rank: everything is read once (so the counter cannot pass vacuously).
    assert _counting_load(str(load_checkpoint)) == total

    # Two ranks, in their own processes.
    counts = run_in_ranks(_rank_main, 2, str(load_checkpoint))
    expected = replicated + (total - replicated) // 2  # every split here is into equal halves
    for rank in range(2):
        assert counts[rank] < 0.6 * total, f"rank {rank} read {counts[rank]} of {total} bytes"
        assert counts[rank] == expected, f"rank {rank} read {counts[rank]} bytes, expected {expected}"
    assert counts[0] + counts[1] == total + replicated


# -- 3. configuration errors -----------------------------------------------------------------------


def test_config_errors(checkpoint):
    from baryon.config import EngineConfig

    path = str(checkpoint("llama", "llama"))
    base = dict(model=path, device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig.create(**base, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="compilation_level=1"):
        EngineConfig.create(**base, tensor_parallel_size=2, compilation_level=1)
    # Every proposer runs with TP: prompt lookup on rank 0, a draft model sharded over the ranks.
    for spec in ({"method": "draft_model", "num_speculative_tokens": 2, "model": path},
                 {"method": "ngram", "num_speculative_tokens": 2}):
        config = EngineConfig.create(**base, tensor_parallel_size=2, speculative_config=spec)
        assert config.speculative.method == spec["method"] and config.parallel.tensor_parallel_size == 2


def test_indivisible_heads_fail_cleanly(checkpoint):
    """TP=3 on 4 attention heads: every rank fails building the model. The error names the
    divisibility problem and no worker process outlives the failed engine."""
    path = checkpoint("llama", "llama")
    before = _worker_children()
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the tensor-parallel size 3"):
        LLM(str(path), tensor_parallel_size=3, device="cpu", dtype="float32", skip_tokenizer_init=True)
    # (Rank 0's own error, not the WorkerDiedError of a worker that exited of the same error.)
    assert not _worker_children() - before, "a failed start left worker processes running"


# -- drafts over several ranks -----------------------------------------------------------------

def _draft_cases(tmp_path, seed, checkpoint) -> dict[str, tuple]:
    """name -> (target path, speculative config): a draft model (the target's weights with
    noise), an EAGLE-3 head and DeepSeek-V3's MTP layer, each sharded like its target."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_deepseek_mtp import build_with_mtp
    from test_eagle3 import _eagle3_tensors, _write_eagle3
    from test_hybrid_spec_decode import _with_mtp_weights

    target = checkpoint("llama", "llama")
    near = tmp_path / "near"
    near.mkdir()
    for item in target.iterdir():
        shutil.copy(item, near / item.name)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(target / "model.safetensors")
    save_file({n: w + 0.2 * w.std() * torch.randn(w.shape, generator=gen) for n, w in weights.items()},
              near / "model.safetensors", metadata={"format": "pt"})
    head = _write_eagle3(tmp_path / "eagle3", _eagle3_tensors(seed, 64, with_embedding=False),
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    mtp, _, _ = build_with_mtp(tmp_path / "mtp")
    hybrid = make_checkpoint(tmp_path / "qwen3_next", "qwen3_next", seed=seed % 1000)
    _with_mtp_weights(hybrid, "qwen3_next", seed % 1000)
    return {"draft_model": (target, {"method": "draft_model", "model": str(near), "num_speculative_tokens": 3}),
            "eagle3": (target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}),
            "mtp": (mtp, {"method": "mtp", "num_speculative_tokens": 2}),
            # Qwen3-Next: the linear layers' states commit what each verification kept, per rank
            "qwen3_next_mtp": (hybrid, {"method": "mtp", "num_speculative_tokens": 2})}


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp", "qwen3_next_mtp"])
def test_drafts_over_two_ranks_match_one(checkpoint, tmp_path, seed, method):
    """A draft with weights runs sharded on both ranks (rank 0 sends each propose's requests, the
    drafts rank 0 draws reach the other rank over gloo): TP=2 gives TP=1's greedy tokens and
    logprobs with the same drafts (as many proposed and accepted: a rank drafting from other
    state would propose other tokens), and a seeded sampling run repeats itself. (The random
    EAGLE-3 head and MTP layer are rarely right: their drafts are proposed, seldom accepted.)"""
    path, spec = _draft_cases(tmp_path, seed, checkpoint)[method]
    prompts = [{"prompt_token_ids": p + p[: len(p) // 2] + p} for p in random_prompts(4, VOCAB, 4, 12, seed)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=12, ignore_eos=True)
    outputs, drafts = {}, {}
    for tp in (1, 2):
        with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", skip_tokenizer_init=True,
                 block_size=4, speculative_config=spec) as llm:
            outputs[tp] = llm.generate(prompts, greedy, use_tqdm=False)
            stats = llm.engine.core.spec_stats
            drafts[tp] = (stats.num_draft_tokens, stats.num_accepted_tokens)
            assert drafts[tp][0] > 0, f"TP={tp}: no draft proposed"
            if tp == 2:
                first, again = ([o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
                                for _ in range(2))
                assert first == again
    assert drafts[2] == drafts[1]
    if method == "draft_model":  # the near draft agrees with the target often
        assert drafts[1][1] > 0, "no draft accepted"
    for i, (a, b) in enumerate(zip(outputs[1], outputs[2])):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}: greedy tokens differ"
        la, lb = _chosen_logprobs(a.outputs[0]), _chosen_logprobs(b.outputs[0])
        assert max(abs(x - y) for x, y in zip(la, lb)) < LOGPROB_TOL, f"prompt {i}: logprobs {la} vs {lb}"
