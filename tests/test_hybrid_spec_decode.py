"""Speculative decoding of hybrid models (Qwen3-Next, Qwen3.5): a verification's tokens leave the
linear-attention layers' states as they stood and are recorded, and the next step folds in the
accepted ones (metadata.DraftRows). Greedy output equals decoding without drafts whatever the
drafts were: an oracle proposer that knows the answer but corrupts part of it (accepting all,
some or none of a proposal), n-gram lookup, a draft model; with preemption and chunked prefill."""

from __future__ import annotations

import random

import pytest
import torch

from baryon import LLM, SamplingParams
from conftest import make_checkpoint, random_prompts

ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4, max_model_len=128,
              kv_cache_memory_gib=0.02)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)


class OracleProposer:
    """Drafts the reference continuation of each prompt, each draft token replaced by a wrong one
    with probability `error`: whole proposals accepted, partly, or not at all."""

    attention_layers = []
    samples = False

    def __init__(self, answers: dict[tuple[int, ...], list[int]], num_prompt: dict[tuple[int, ...], int],
                 error: float, seed: int) -> None:
        self.answers, self.num_prompt, self.error = answers, num_prompt, error
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, requests, max_drafts, sampling):
        drafts = []
        for request, most in zip(requests, max_drafts):
            key = tuple(request.prompt_token_ids)
            done = len(request.all_token_ids) - self.num_prompt[key]
            truth = self.answers[key][done:done + most]
            drafts.append([t if self.rng.random() > self.error else (t + 1) % 128 for t in truth])
            self.proposed += len(truth)
        return drafts

    def draft_probs(self, requests, num_drafts, vocab_size):
        return None

    def forget(self, request_id):
        pass


def _generate(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _with_oracle(llm, prompts, reference, error, seed):
    oracle = OracleProposer({tuple(p): r.token_ids for p, r in zip(prompts, reference)},
                            {tuple(p): len(p) for p in prompts}, error, seed)
    llm.engine.core.runner.proposer = oracle
    return oracle


def _assert_same(outputs, reference, logprobs=False):
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    if logprobs:
        for out, ref in zip(outputs, reference):
            for got, want in zip(out.logprobs, ref.logprobs):
                for token in want:
                    assert abs(got[token].logprob - want[token].logprob) < 1e-4


def test_greedy_output_and_logprobs_equal_decoding_without_drafts(hybrid, seed):
    prompts = random_prompts(5, 128, 3, 14, seed)
    # max_tokens differ per request, so some end inside a draft
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    reference = _generate(LLM(str(hybrid), **ENGINE), prompts, params)
    llm = LLM(str(hybrid), **ENGINE, speculative_config=NGRAM)
    oracle = _with_oracle(llm, prompts, reference, error=0.3, seed=seed)
    outputs = _generate(llm, prompts, params)
    _assert_same(outputs, reference, logprobs=True)
    stats = llm.engine.core.spec_stats
    assert oracle.proposed > 0 and stats.num_draft_tokens > 0
    assert 0.0 < stats.acceptance_rate < 1.0  # kept and rejected drafts both
    assert stats.accepted_per_position[-1] > 0  # and whole proposals kept
    core = llm.engine.core
    assert core.scheduler.state_slots.num_free == core.scheduler.state_slots.num_slots
    # the slots' pending blocks: [slots, 2 (k + 1), C] for the convolution's inputs and outputs
    conv, rule, inputs, outputs_, ba = core.runner.state_layers[0].states
    assert inputs.shape[:2] == outputs_.shape[:2] == ba.shape[:2] == (conv.shape[0], 2 * 4)


@pytest.mark.parametrize("error", [0.0, 1.0])
def test_drafts_all_kept_or_all_rejected(hybrid, seed, error):
    prompts = random_prompts(3, 128, 4, 10, seed)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    reference = _generate(LLM(str(hybrid), **ENGINE), prompts, params)
    llm = LLM(str(hybrid), **ENGINE, speculative_config=NGRAM)
    _with_oracle(llm, prompts, reference, error=error, seed=seed)
    _assert_same(_generate(llm, prompts, params), reference)
    assert llm.engine.core.spec_stats.acceptance_rate == 1.0 - error


def test_preemption_and_chunked_prefill_keep_greedy_output(hybrid, seed):
    """A cache too small for every request preempts (a preempted request's slot and pending block
    are given up; it recomputes from its first token), and a small step budget trims drafts and
    splits prompts into chunks beside verifications."""
    prompts = random_prompts(6, 128, 8, 26, seed)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = _generate(LLM(str(hybrid), **ENGINE), prompts, params)
    for engine in (dict(ENGINE, num_kv_blocks=40), dict(ENGINE, max_num_batched_tokens=10)):
        llm = LLM(str(hybrid), **engine, speculative_config=NGRAM)
        _with_oracle(llm, prompts, reference, error=0.3, seed=seed)
        scheduler, preemptions = llm.engine.core.scheduler, []
        preempt = scheduler._preempt
        scheduler._preempt = lambda request: (preemptions.append(request.request_id), preempt(request))
        _assert_same(_generate(llm, prompts, params), reference)
        assert bool(preemptions) == ("num_kv_blocks" in engine)


def test_ngram_and_draft_model_keep_greedy_output(hybrid, tmp_path, seed):
    base = random_prompts(4, 128, 4, 12, seed)
    prompts = [p + p[:len(p) // 2] + p for p in base]  # repeated spans: prompt lookup finds matches
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = _generate(LLM(str(hybrid), **ENGINE), prompts, params)
    draft = make_checkpoint(tmp_path / "draft", "qwen3", seed=seed % 1000)
    for spec in (NGRAM, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}):
        llm = LLM(str(hybrid), **ENGINE, speculative_config=spec)
        _assert_same(_generate(llm, prompts, params), reference)
        assert llm.engine.core.spec_stats.num_draft_tokens > 0, spec


def test_a_hybrid_draft_model_is_refused(hybrid):
    with pytest.raises(ValueError, match="has linear-attention layers"):
        LLM(str(hybrid), **ENGINE, speculative_config={"method": "draft_model", "model": str(hybrid),
                                                       "num_speculative_tokens": 2})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (decode graphs, Triton kernels)")
def test_cuda_graphs_replay_verifications(hybrid, seed):
    """On the GPU the verifications replay decode graphs (one decode a token for attention, one
    sequence a request for the linear layers): greedy output as without drafts."""
    prompts = random_prompts(6, 128, 3, 14, seed)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(ENGINE, device="cuda")
    reference = _generate(LLM(str(hybrid), **engine), prompts, params)
    llm = LLM(str(hybrid), **engine, speculative_config=NGRAM)
    assert llm.engine.core.runner.graph_runner is not None
    _with_oracle(llm, prompts, reference, error=0.3, seed=seed)
    _assert_same(_generate(llm, prompts, params), reference)
