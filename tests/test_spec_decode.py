"""Speculative decoding through the whole engine: greedy output is token-identical to decoding
without it, for each proposer, with stop strings, max_tokens reached inside a draft, prefix
caching and preemption; logprobs of accepted tokens equal the non-speculative ones; seeded
sampling is reproducible; the acceptance statistics count what happened."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baryon import LLM, SamplingParams
from baryon.config import EngineConfig
from conftest import make_checkpoint, random_prompts

ENGINE = dict(skip_tokenizer_init=True, device="cpu", block_size=4, max_model_len=160)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("spec_target"), "llama", seed=3)


@pytest.fixture(scope="module")
def near_draft(target, tmp_path_factory) -> Path:
    """The target with noise on every weight: it agrees with the target often, not always."""
    folder = tmp_path_factory.mktemp("spec_near_draft")
    for item in target.iterdir():
        shutil.copy(item, folder / item.name)
    weights = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    noisy = {name: w + 0.35 * w.std() * torch.randn(w.shape, generator=gen) for name, w in weights.items()}
    save_file(noisy, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _repetitive_prompts(seed: int, count: int = 6) -> list[dict]:
    """Prompts that repeat spans, so prompt lookup finds matches."""
    prompts = []
    for p in random_prompts(count, 128, 4, 16, seed):
        prompts.append({"prompt_token_ids": p + p[: len(p) // 2] + p})
    return prompts


def _generate(llm: LLM, prompts: list[dict], params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _specs(target: Path, near_draft: Path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "self-draft": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4},
        "near-draft": {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": 3},
    }


@pytest.mark.parametrize("name", ["ngram", "self-draft", "near-draft"])
def test_greedy_output_is_identical_and_acceptance_counted(target, near_draft, name, seed):
    prompts = _repetitive_prompts(seed)
    # max_tokens differ per request, so some end inside a draft.
    params = [SamplingParams(temperature=0, max_tokens=5 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
    reference = _generate(LLM(str(target), **ENGINE), prompts, params)
    llm = LLM(str(target), **ENGINE, speculative_config=_specs(target, near_draft)[name])
    outputs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    stats = llm.engine.core.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == sum(stats.accepted_per_position)
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))
    if name == "self-draft":  # a model drafting for itself is always right
        assert stats.acceptance_rate == 1.0
    elif name == "near-draft":
        assert 0.0 < stats.acceptance_rate < 1.0
    # The memory sizing's profile of the largest verification (every row sampling) runs.
    emitted = llm.engine.core.runner.profile_verify_sampling()
    k = llm.config.speculative.num_speculative_tokens
    assert len(emitted) == min(256, 8192 // (k + 1)) and bool(((emitted >= 1) & (emitted <= k + 1)).all())
    # Every block is back in the free list, and the engine holds nothing of finished requests.
    core = llm.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not getattr(core.runner.proposer, "num_computed", {}) and not getattr(core.runner.proposer, "histories", {})


def test_prefix_caching_and_preemption_keep_greedy_output(target, near_draft, seed):
    """Shared prefixes hit the cache (hashes registered only for verified tokens), a cache too
    small for every request preempts and recomputes, drafts included, and prompts longer than
    the step budget prefill in chunks."""
    base = random_prompts(1, 128, 24, 24, seed)[0]
    prompts = [{"prompt_token_ids": base + p} for p in random_prompts(6, 128, 2, 10, seed + 1)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    few_blocks = dict(ENGINE, num_kv_blocks=44, max_model_len=96)  # the requests cannot all fit: preemption
    small_budget = dict(ENGINE, max_model_len=96, max_num_batched_tokens=12)  # chunked prefill, drafts trimmed
    reference = _generate(LLM(str(target), **dict(ENGINE, max_model_len=96)), prompts, params)
    for spec in _specs(target, near_draft).values():
        for engine in (few_blocks, small_budget):
            llm = LLM(str(target), **engine, speculative_config=spec)
            scheduler, preemptions = llm.engine.core.scheduler, []
            preempt = scheduler._preempt
            scheduler._preempt = lambda request: (preemptions.append(request.request_id), preempt(request))
            first = _generate(llm, prompts, params)
            again = _generate(llm, prompts, params)  # served from the prefix cache
            assert [o.token_ids for o in first] == [r.token_ids for r in reference], (spec, engine)
            assert [o.token_ids for o in again] == [r.token_ids for r in reference], (spec, engine)
            if engine is few_blocks:
                assert preemptions, spec


def test_stop_strings_and_eos_end_inside_a_draft(stories_path, seed):
    """A real model with a tokenizer: stop strings cut the text where they would without
    speculation, tokens past an EOS in an accepted draft are dropped."""
    stories = str(stories_path)
    prompts = ["Once upon a time", "Lily and Tom went"]
    params = SamplingParams(temperature=0, max_tokens=40, stop=["the", "."])
    plain = LLM(stories, device="cpu", max_model_len=256)
    reference = _generate(plain, prompts, params)
    no_stop = SamplingParams(temperature=0, max_tokens=90)
    reference_eos = _generate(plain, prompts, no_stop)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": stories, "num_speculative_tokens": 5}):
        llm = LLM(stories, device="cpu", max_model_len=256, speculative_config=spec)
        outputs = _generate(llm, prompts, params)
        assert [(o.text, o.token_ids, o.stop_reason) for o in outputs] == \
            [(r.text, r.token_ids, r.stop_reason) for r in reference]
        assert {o.finish_reason for o in outputs} == {"stop"}
        eos = _generate(llm, prompts, no_stop)
        assert [(o.token_ids, o.finish_reason) for o in eos] == [(r.token_ids, r.finish_reason) for r in reference_eos]


def test_logprobs_of_accepted_tokens_match(target, near_draft, seed):
    prompts = _repetitive_prompts(seed, count=4)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    reference = _generate(LLM(str(target), **ENGINE), prompts, params)
    for spec in _specs(target, near_draft).values():
        outputs = _generate(LLM(str(target), **ENGINE, speculative_config=spec), prompts, params)
        for out, ref in zip(outputs, reference):
            assert out.token_ids == ref.token_ids
            for got, want in zip(out.logprobs, ref.logprobs):
                assert list(got) == list(want)
                for token in want:
                    assert abs(got[token].logprob - want[token].logprob) < 1e-4
                    assert got[token].rank == want[token].rank
            assert abs(out.cumulative_logprob - ref.cumulative_logprob) < 1e-3


def test_seeded_sampling_is_reproducible(target, near_draft, seed):
    """A seeded request gives the same tokens in the same batch. With a draft model it also does
    alone: its drafts depend on its own tokens only. (With n-gram lookup, whether a proposal is
    made one token behind depends on which steps overlap, hence on the batch; each draft consumes
    random draws, so a seeded request's sample may then differ from its solo run, while still
    following the target distribution; greedy output never depends on the batch.)"""
    prompts = _repetitive_prompts(seed, count=3)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=seed + i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    for name, spec in _specs(target, near_draft).items():
        llm = LLM(str(target), **ENGINE, speculative_config=spec)
        first = [o.token_ids for o in _generate(llm, prompts, seeded)]
        again = [o.token_ids for o in _generate(llm, prompts, seeded)]
        assert first == again, name
        assert all(len(t) == 30 for t in first)
        if name != "ngram":
            alone = [o.token_ids for o in _generate(llm, prompts[1:2], seeded[1:2])]
            assert alone[0] == first[1], name  # the batch around a seeded request does not change it


def test_penalties_and_min_tokens_run_without_drafts(target, seed):
    """Position-dependent sampling is never drafted for: output equals plain decoding."""
    prompts = _repetitive_prompts(seed, count=4)
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=12, stop_token_ids=[5, 7]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    reference = _generate(LLM(str(target), **ENGINE), prompts, params)
    for spec in ({"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):  # steps overlap
        outputs = _generate(LLM(str(target), **ENGINE, speculative_config=spec), prompts, params)
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference], spec


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "spec_model": "x"}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "no multi-token prediction layers"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_refused(target, spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(model=str(target), device="cpu", speculative_config=spec)


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = make_checkpoint(tmp_path / "other", "llama", seed=1, vocab_size=96)
    spec = json.dumps({"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocab_size 96"):
        EngineConfig.create(model=str(target), device="cpu", speculative_config=spec)


from test_deepseek_mtp import build_with_mtp  # noqa: E402
from test_eagle3 import _eagle3_tensors, _write_eagle3  # noqa: E402


def _greedy_identity(model: str, spec: dict, prompts: list[dict], engine: dict) -> LLM:
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    reference = _generate(LLM(model, **engine), prompts, params)
    llm = LLM(model, **engine, speculative_config=spec)
    outputs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    return llm


def test_mtp_draft_keeps_greedy_output(tmp_path, seed):
    """DeepSeek-V3's MTP layer drafts (chained for k > 1) from the target's hidden states."""
    path, _, _ = build_with_mtp(tmp_path)
    llm = _greedy_identity(str(path), {"method": "mtp", "num_speculative_tokens": 3}, _repetitive_prompts(seed, 4),
                           dict(ENGINE, max_model_len=128))
    proposer = llm.engine.core.runner.proposer
    assert type(proposer.model).__name__ == "DeepseekMTP" and proposer.num_mtp_layers == 1
    assert llm.engine.core.spec_stats.num_draft_tokens > 0


def test_eagle3_on_a_target_without_its_hidden_states_is_refused(tmp_path, seed):
    """A Gemma 3 target does not hand EAGLE-3 its layers' hidden states: refused by name at start."""
    gemma = make_checkpoint(tmp_path / "gemma3", "gemma3", seed=seed, head_dim=16, query_pre_attn_scalar=16)
    head = _write_eagle3(tmp_path / "eagle3", _eagle3_tensors(seed, 64, with_embedding=False))
    with pytest.raises(ValueError, match="EAGLE-3 heads read a Llama-family target's hidden states; Gemma3ForCausalLM"):
        LLM(str(gemma), speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2},
            **ENGINE)


def test_eagle3_head_keeps_greedy_output(target, tmp_path, seed):
    """An EAGLE-3 head in the published layout (own draft vocabulary, the target's embedding) drafts
    from three of the target's hidden states."""
    head = _write_eagle3(tmp_path / "eagle3", _eagle3_tensors(seed, 64, with_embedding=False),
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = _greedy_identity(str(target), spec, _repetitive_prompts(seed, 4), ENGINE)
    runner = llm.engine.core.runner
    assert runner.model.model.aux_hidden_state_layers == (0, 1, 2)
    assert runner.proposer.model.embed_tokens is runner.model.model.embed_tokens
    assert llm.engine.core.spec_stats.num_draft_tokens > 0


def test_server_flag_and_metrics(stories_path):
    """`baryon serve --speculative-config JSON`: completions equal offline greedy decoding and
    /metrics counts the drafts."""
    import httpx

    from test_server import ServerProcess, scrape

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    server = ServerProcess(stories_path, "--max-model-len", "256", "--speculative-config", spec).wait_ready()
    try:
        prompts = ["Once upon a time", "The little dog saw the dog"]
        plain = LLM(str(stories_path), device="cpu", max_model_len=256)
        expected = [o.text for o in _generate(plain, prompts, SamplingParams(temperature=0, max_tokens=40))]
        for prompt, text in zip(prompts, expected):
            reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": str(stories_path), "prompt": prompt, "max_tokens": 40, "temperature": 0}).json()
            assert reply["choices"][0]["text"] == text
        metrics = scrape(server)
        drafted = metrics["baryon:spec_decode_num_draft_tokens_total"]
        accepted = metrics["baryon:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and 0 < accepted <= drafted
        assert metrics["baryon:spec_decode_num_drafts_total"] > 0
    finally:
        server.stop()


def test_hidden_state_draft_sees_every_computed_position(target, tmp_path, seed):
    """The draft's cache rows are written for every token the target computes: prompt chunks
    (a small step budget), and steps in which no request may draft (min_tokens)."""
    head = _write_eagle3(tmp_path / "eagle3", _eagle3_tensors(seed, 64, with_embedding=False),
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(str(target), **dict(ENGINE, max_num_batched_tokens=8), speculative_config=spec)
    proposer, seen = llm.engine.core.runner.proposer, set()
    run = proposer._run

    def recording_run(input_ids, positions, hidden, tables, computed, num_new, depth):
        if depth == 0:  # catch-up rows (draft steps run at depth >= 1)
            seen.update(int(p) for p in positions)
        return run(input_ids, positions, hidden, tables, computed, num_new, depth)

    proposer._run = recording_run
    prompt = random_prompts(1, 128, 30, 30, seed)[0]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[1])
    out = _generate(llm, [{"prompt_token_ids": prompt}], params)[0]
    # A draft row for every position the target computed before the request's last step.
    assert set(range(len(prompt) + len(out.token_ids) - 2)) <= seen


def test_draft_model_catches_up_within_the_step_budget(target, seed):
    """A draft model catches up on a long prompt over several steps (each within the step budget,
    so running decodes never wait for a whole draft prefill), drafting once it has."""
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    llm = LLM(str(target), **dict(ENGINE, max_num_batched_tokens=16), speculative_config=spec)
    proposer, sizes = llm.engine.core.runner.proposer, []  # tokens the draft ran per propose()
    forward, propose = proposer._forward, proposer.propose

    def recording_forward(tables, computed, num_new, input_ids, last_rows, depth):
        sizes[-1] += int(num_new.sum())
        return forward(tables, computed, num_new, input_ids, last_rows, depth)

    def recording_propose(*args):
        sizes.append(0)
        return propose(*args)

    proposer._forward, proposer.propose = recording_forward, recording_propose
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 128, 60, 80, seed)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = _generate(LLM(str(target), **dict(ENGINE, max_num_batched_tokens=16)), prompts, params)
    assert [o.token_ids for o in _generate(llm, prompts, params)] == [r.token_ids for r in reference]
    k = spec["num_speculative_tokens"]
    # The budget (plus at most one token per other request) to catch up, then k - 1 draft steps.
    assert max(sizes) <= 16 + len(prompts) + (k - 1) * len(prompts)
    assert llm.engine.core.spec_stats.acceptance_rate == 1.0 and llm.engine.core.spec_stats.num_drafts > 0
