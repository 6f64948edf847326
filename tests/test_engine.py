"""Engine behaviour end to end on a tiny model: abort, stopping rules, context limits."""

from __future__ import annotations

import pytest

from baryon import LLM, SamplingParams
from conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=4, max_model_len=64)


def _greedy(llm, prompt, **kwargs):
    params = SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 12, **kwargs})
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]


def _all_blocks_free(llm) -> bool:
    block_manager = llm.engine.core.block_manager
    return block_manager.num_free_blocks == block_manager.num_blocks


def test_abort_mid_generation_frees_blocks_and_spares_others(llm, seed):
    prompts = random_prompts(3, 128, 6, 20, seed)
    expected = [_greedy(llm, p, max_tokens=15).token_ids for p in prompts]
    engine = llm.engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=15)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    finished = {}
    for step in range(100):
        if step == 3:
            engine.abort_request(["r1"])
            assert "r1" not in engine.core.requests
        for out in engine.step():
            assert out.request_id != "r1" or step < 3
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"r0", "r2"}
    assert finished["r0"] == expected[0] and finished["r2"] == expected[2]
    assert _all_blocks_free(llm)


def test_stop_token_ids_and_eos(llm, seed):
    prompt = random_prompts(1, 128, 5, 10, seed)[0]
    free_run = _greedy(llm, prompt, max_tokens=12).token_ids
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    out = _greedy(llm, prompt, stop_token_ids=[stop_at])
    assert out.token_ids == free_run[: first + 1]  # the stop token is kept in token_ids
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens holds the stop token off: it is banned until then, so the output changes.
    held = _greedy(llm, prompt, stop_token_ids=[stop_at], min_tokens=first + 2, max_tokens=first + 2)
    assert stop_at not in held.token_ids[: first + 2] and len(held.token_ids) == first + 2


def test_eos_from_generation_config(llm, tiny_llama, tmp_path, seed):
    import json
    import shutil

    prompt = random_prompts(1, 128, 5, 10, seed)[0]
    free_run = _greedy(llm, prompt, max_tokens=12).token_ids
    eos = free_run[6]
    other = next(t for t in range(127, -1, -1) if t not in free_run)  # a second EOS id never generated
    folder = shutil.copytree(tiny_llama, tmp_path / "eos")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, other]}))
    eos_llm = LLM(str(folder), skip_tokenizer_init=True, device="cpu", block_size=4, max_model_len=64)
    assert {eos, other} <= eos_llm.engine.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=12)
    out = eos_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: free_run.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignoring = _greedy(eos_llm, prompt, max_tokens=12)
    assert ignoring.token_ids == free_run and ignoring.finish_reason == "length"


def test_max_tokens_none_runs_to_the_context_end(llm, seed):
    prompt = random_prompts(1, 128, 50, 50, seed)[0]
    out = _greedy(llm, prompt, max_tokens=None)
    assert len(out.token_ids) == 64 - 50 and out.finish_reason == "length"
    longest = random_prompts(1, 128, 63, 63, seed)[0]
    assert len(_greedy(llm, longest, max_tokens=5).token_ids) == 1  # only one slot of context left
    with pytest.raises(ValueError, match="max_model_len=64"):
        _greedy(llm, longest + [1])
    assert _all_blocks_free(llm)


def test_logprobs_are_consistent(llm, seed):
    prompt = random_prompts(1, 128, 5, 10, seed)[0]
    out = _greedy(llm, prompt, logprobs=3, max_tokens=6)
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_dummy_weights_generate(tiny_llama):
    llm = LLM(str(tiny_llama), load_format="dummy", skip_tokenizer_init=True, device="cpu")
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""


def test_prompt_logprobs_survive_preemption(tiny_llama, seed):
    """A prompt_logprobs request preempted during its prefill recomputes them from scratch."""
    prompts = [random_prompts(1, 128, 20, 20, seed)[0], random_prompts(1, 128, 40, 40, seed + 1)[0]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)]

    def run(num_kv_blocks):
        llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=4, max_model_len=64,
                  max_num_batched_tokens=8, num_kv_blocks=num_kv_blocks)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[1]

    roomy, tight = run(64), run(16)  # 16 blocks of 4 forces the second request out repeatedly
    assert len(tight.prompt_logprobs) == len(prompts[1]) == len(roomy.prompt_logprobs)
    for a, b in zip(roomy.prompt_logprobs[1:], tight.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_repetition_penalty_matches_a_reference_loop(tiny_llama, seed):
    """Penalties see every generated token, the one still in flight on the device included.
    Reference: transformers' logits, the vLLM/OpenAI repetition rule applied by hand each step."""
    import torch
    from transformers import LlamaForCausalLM

    penalty = 1.8
    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=4, max_model_len=64)
    prompts = random_prompts(3, 128, 4, 12, seed)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                logits = model(torch.tensor([ids])).logits[0, -1]
                seen = torch.tensor(sorted(set(ids)))
                scores = logits[seen]
                logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
                ids.append(int(logits.argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):]
