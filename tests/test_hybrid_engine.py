"""Hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet layers beside full attention) in the engine:
state slots (engine/state_slots.py), what the engine turns off for them, and what it refuses.
Parity: tests/test_parity.py; batching, preemption and slot reuse: tests/test_batch_invariance.py;
speculative decoding: tests/test_hybrid_spec_decode.py."""

from __future__ import annotations

import pytest

from baryon import LLM, SamplingParams
from baryon.config import EngineConfig
from baryon.engine.state_slots import StateSlots
from baryon.request import Request
from conftest import make_checkpoint, random_prompts


def _request(name: str) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(max_tokens=4), frozenset(), max_tokens=4)


def test_state_slots_are_taken_once_and_reused(seed):
    import random

    rng = random.Random(seed)
    num_slots = rng.randint(2, 6)
    slots = StateSlots(num_slots)
    held = [_request(f"r{i}") for i in range(num_slots)]
    for request in held:
        slots.take(request)
    assert sorted(r.state_slot for r in held) == list(range(num_slots))  # each slot once
    with pytest.raises(AssertionError, match="no free state slot"):
        slots.take(_request("one too many"))
    with pytest.raises(AssertionError, match="already holds"):
        slots.take(held[0])
    leaving = held.pop(rng.randrange(num_slots))
    freed = leaving.state_slot
    slots.free(leaving)
    slots.free(leaving)  # twice (finished after a preemption): the slot is given back once
    assert leaving.state_slot == -1 and slots.num_free == 1
    newcomer = _request("next")
    slots.take(newcomer)
    assert newcomer.state_slot == freed and slots.num_free == 0


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hybrid"), "qwen3_next", seed=11)


def test_prefix_caching_is_off_and_slots_match_max_num_seqs(hybrid, seed):
    llm = LLM(str(hybrid), skip_tokenizer_init=True, device="cpu", dtype="float32", max_num_seqs=5,
              kv_cache_memory_gib=0.01)
    assert llm.config.model.has_recurrent_state and not llm.config.cache.enable_prefix_caching
    runner = llm.engine.core.runner
    assert len(runner.state_layers) == 2  # the two linear-attention layers of linear / full / linear
    conv, recurrent = runner.state_layers[0].states
    assert conv.shape == (5, 3, 2 * 2 * 16 + 4 * 8)  # [slots, K - 1, q | k | v channels]
    assert recurrent.shape == (5, 4, 16, 8)  # [slots, value heads, Dk, Dv]
    # The same prompt twice in one batch: the same tokens from two slots.
    prompt = random_prompts(1, 128, 12, 12, seed)[0]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2,
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(compilation_level=1, device="cpu"), "compilation_level=1 is not supported with linear attention"),
])
def test_refused_with_a_reason(hybrid, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(hybrid), skip_tokenizer_init=True, kv_cache_memory_gib=0.01, **kwargs)


def test_dense_models_keep_no_state_slots(tmp_path):
    path = make_checkpoint(tmp_path / "qwen3", "qwen3")
    config = EngineConfig.create(model=str(path), skip_tokenizer_init=True, device="cpu")
    assert not config.model.has_recurrent_state and config.cache.enable_prefix_caching
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", kv_cache_memory_gib=0.01)
    assert llm.engine.core.scheduler.state_slots is None and llm.engine.core.runner.state_layers == []


def test_aborted_requests_give_their_slots_back(hybrid, seed):
    """Requests aborted while running (slots held) or waiting (none yet): every slot comes back, and
    a request run afterwards in a reused slot decodes as it does alone."""
    llm = LLM(str(hybrid), skip_tokenizer_init=True, device="cpu", dtype="float32", max_num_seqs=3,
              kv_cache_memory_gib=0.01)
    core = llm.engine.core
    prompts = random_prompts(5, 128, 6, 14, seed)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params, frozenset())
    for _ in range(3):
        core.step()
    slots = core.scheduler.state_slots
    assert slots.num_free == 0  # three running (12 tokens each to go), two waiting
    assert [core.requests[f"r{i}"].state_slot >= 0 for i in range(5)] == [True] * 3 + [False] * 2
    core.abort_requests(["r0", "r3", "r4"])  # one running, both waiting
    while core.has_unfinished_requests():
        core.step()
    assert slots.num_free == slots.num_slots
    again = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
