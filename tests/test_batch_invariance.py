"""Batch invariance: a request's greedy tokens do not depend on what it is batched with or on how
the scheduler cuts the work (chunked prefill, prefix caching, preemption under a tiny cache), for a
dense model, a mixture of experts, DeepSeek-V3 (latent attention over its compressed cache,
grouped sigmoid routing) and DeepSeek-V3.2 (sparse attention: index keys cached beside the latent)."""

from __future__ import annotations

import pytest

from baryon import LLM, SamplingParams
from baryon.engine.scheduler import Scheduler
from conftest import make_checkpoint, random_prompts

NUM_REQUESTS = 16
MAX_TOKENS = 20


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32"])
def checkpoint(tmp_path_factory, request):
    """A dense model, a mixture of experts (8 experts, top-2, renormalised), DeepSeek-V3 and V3.2:
    routing, latent attention and the sparse key selection, like everything else, must not depend
    on what a request is batched with."""
    overrides = {"norm_topk_prob": True} if request.param in ("qwen3_moe", "deepseek_v3", "deepseek_v32") else {}
    return make_checkpoint(tmp_path_factory.mktemp("invariance"), request.param, seed=7, **overrides)


@pytest.fixture
def prompts(seed):
    # Mixed lengths, and a shared prefix for half of them so prefix caching has work to do.
    base = random_prompts(NUM_REQUESTS, 128, 2, 40, seed)
    shared = random_prompts(1, 128, 13, 13, seed + 1)[0]
    return [shared + p if i % 2 else p for i, p in enumerate(base)]


def _params(i: int) -> SamplingParams:
    # Varied output lengths, so requests finish and leave at different steps.
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS - i % 5, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i) for i in range(len(prompts))],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _engine(checkpoint, **kwargs) -> LLM:
    return LLM(str(checkpoint), skip_tokenizer_init=True, device="cpu", block_size=4, max_model_len=128,
               **kwargs)


@pytest.fixture(scope="module")
def default_engine(checkpoint):
    return _engine(checkpoint)


@pytest.fixture(scope="module")
def solo_engine(checkpoint):
    return _engine(checkpoint, enable_prefix_caching=False)


@pytest.fixture
def alone(solo_engine, prompts):
    """Each request run by itself, with prefix caching off so nothing is shared."""
    llm = solo_engine
    results = []
    for i, prompt in enumerate(prompts):
        out = llm.generate([{"prompt_token_ids": prompt}], _params(i), use_tqdm=False)
        results.append(out[0].outputs[0].token_ids)
    assert all(len(r) == MAX_TOKENS - i % 5 for i, r in enumerate(results))
    return results


def test_batch_of_16_mixed_lengths(default_engine, prompts, alone):
    assert _generate(default_engine, prompts) == alone


def test_chunked_prefill_forced_small(checkpoint, prompts, alone):
    llm = _engine(checkpoint, max_num_batched_tokens=7)
    assert _generate(llm, prompts) == alone


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(checkpoint, prompts, alone, prefix_caching):
    llm = _engine(checkpoint, enable_prefix_caching=prefix_caching, max_num_batched_tokens=64)
    first = _generate(llm, prompts)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i) for i in range(len(prompts))],
                         use_tqdm=False)  # a second pass can hit every prompt's full blocks
    assert first == alone
    assert [o.outputs[0].token_ids for o in again] == alone
    cached = sum(o.num_cached_tokens for o in again)
    assert (cached > 0) == prefix_caching
    block_manager = llm.engine.core.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_preemption_under_tiny_kv_cache(checkpoint, prompts, alone, monkeypatch):
    preempted = []
    original = Scheduler._preempt

    def counting_preempt(self, request):
        preempted.append(request.request_id)
        original(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", counting_preempt)
    # 40 blocks of 4 tokens: a few requests at a time at most, so running ones get preempted.
    llm = _engine(checkpoint, num_kv_blocks=40)
    assert _generate(llm, prompts) == alone
    assert preempted, "the tiny cache was expected to force preemptions"
    block_manager = llm.engine.core.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_seeded_sampling_is_batch_invariant(default_engine, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    batch = default_engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i in (0, 5, 11):
        solo = default_engine.generate([{"prompt_token_ids": prompts[i]}], params[i], use_tqdm=False)
        assert solo[0].outputs[0].token_ids == batch[i].outputs[0].token_ids


def test_mixed_sampling_rows_follow_their_requests_as_the_batch_changes(default_engine, prompts):
    """Greedy, seeded temperature, top-k and top-p requests that end at different steps: the batch's
    sampling rows are rebuilt whenever its requests change (and reused while they do not), so each
    request samples with its own parameters to its last token, as it does alone."""
    def params(i: int) -> SamplingParams:
        kind = i % 4
        return SamplingParams(temperature=0 if kind == 0 else 0.7 + 0.1 * kind, top_k=5 if kind == 2 else 0,
                              top_p=0.8 if kind == 3 else 1.0, seed=2000 + i, max_tokens=4 + 3 * (i % 5),
                              ignore_eos=True)

    batch = default_engine.generate([{"prompt_token_ids": p} for p in prompts], [params(i) for i in range(len(prompts))],
                                    use_tqdm=False)
    for i in range(len(prompts)):
        solo = default_engine.generate([{"prompt_token_ids": prompts[i]}], params(i), use_tqdm=False)
        assert solo[0].outputs[0].token_ids == batch[i].outputs[0].token_ids, f"request {i}"
