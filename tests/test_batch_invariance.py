"""Batch invariance: a request's greedy tokens do not depend on what it is batched with or on how
the scheduler cuts the work (chunked prefill, prefix caching, preemption under a tiny cache), for a
dense model, a mixture of experts, DeepSeek-V3 (latent attention over its compressed cache,
grouped sigmoid routing), DeepSeek-V3.2 (sparse attention: index keys cached beside the latent) and
Qwen3-Next (linear attention: each request's recurrent state in a state slot, taken at admission,
given back at preemption and at the end, reused by the next request)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from baryon import LLM, SamplingParams
from baryon.engine.scheduler import Scheduler
from baryon.kernels.attention import mla_indexer
from baryon.kernels.moe import routing
from baryon.layers.sampler import Sampler
from conftest import make_checkpoint, random_prompts

NUM_REQUESTS = 16
MAX_TOKENS = 20
# A step's matmuls round differently with its number of rows (MKL takes other paths below ~12 rows
# on the CPU), so a value moves by ~1e-6 of the largest between a batched and a lone run. Where a
# choice by float value is that close, it can swap and the request rightly decode differently:
# DeepSeek-V3.2's indexer keeping each token's `index_topk` best keys (seen: a gap of 6.6e-7), a
# router's top-k experts and, for grouped routing, its groups (seen: 1.7e-7 between DeepSeek's two
# groups), a greedy token's argmax. A request whose lone run met a gap under
# NEAR_TIE (relative; 20x that noise) in any of them is not compared (~5% of them); every other one
# must match to the last token, and at least half of the requests are compared.
NEAR_TIE = 2e-5


class ChoiceGaps:
    """The smallest relative gap between the last value kept and the first dropped over the
    choices the engine made since `reset`: V3.2's index keys, routers' experts, greedy tokens."""

    def __init__(self) -> None:
        self.smallest = math.inf
        self.key_choices = 0  # V3.2 top-k calls that had to drop keys

    def reset(self) -> None:
        self.smallest = math.inf

    def record(self, values: torch.Tensor, k: int) -> bool:
        """values [T, N], of which each row keeps its k best: True where some row dropped one."""
        if values.shape[-1] <= k:
            return False
        best = torch.topk(values.float(), k + 1, dim=-1).values  # [T, k + 1], best first
        drops = best[:, k] > float("-inf")
        if drops.any():
            gap = (best[drops, k - 1] - best[drops, k]) / best[drops, 0].abs().clamp_min(1e-30)
            self.smallest = min(self.smallest, float(gap.min()))
        return bool(drops.any())

    @property
    def near_tie(self) -> bool:
        return self.smallest < NEAR_TIE


@pytest.fixture
def choice_gaps(monkeypatch) -> ChoiceGaps:
    gaps = ChoiceGaps()
    choose_keys, route, sample = mla_indexer.topk_indices, routing.route_reference, Sampler.forward

    def keys(scores: torch.Tensor, topk: int) -> torch.Tensor:
        gaps.key_choices += gaps.record(scores, topk)
        return choose_keys(scores, topk)

    def experts(logits: torch.Tensor, config: routing.RoutingConfig, correction_bias=None):
        scores = logits.float().softmax(dim=-1) if config.scoring == "softmax" else logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if config.num_groups > 1:  # grouped routing chooses groups first (DeepSeek-V3: by each group's best two)
            grouped = choice.view(choice.shape[0], config.num_groups, -1)
            group_scores = (grouped.topk(2, dim=-1).values.sum(-1) if correction_bias is not None
                            else grouped.max(dim=-1).values)  # [T, groups]
            gaps.record(group_scores, config.topk_group)
            kept = group_scores.topk(config.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        gaps.record(choice, config.top_k)
        return route(logits, config, correction_bias)

    def tokens(self, logits: torch.Tensor, batch):
        gaps.record(logits, 1)
        return sample(self, logits, batch)

    monkeypatch.setattr(mla_indexer, "topk_indices", keys)
    monkeypatch.setattr(routing, "route_reference", experts)
    monkeypatch.setattr(Sampler, "forward", tokens)
    return gaps


@dataclass
class Alone:
    tokens: list[list[int]]  # each request's greedy tokens, run by itself
    comparable: list[bool]  # False where its lone run met a near-tie in a choice


def assert_same_as_alone(got: list[list[int]], alone: Alone) -> None:
    compared = [i for i, ok in enumerate(alone.comparable) if ok]
    assert len(compared) >= NUM_REQUESTS // 2, f"{NUM_REQUESTS - len(compared)} requests met a near-tie"
    for i in compared:
        assert got[i] == alone.tokens[i], f"request {i}"


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32", "qwen3_next"])
def checkpoint(tmp_path_factory, request):
    """A dense model, a mixture of experts (8 experts, top-2, renormalised), DeepSeek-V3 and V3.2:
    routing, latent attention and the sparse key selection, like everything else, must not depend
    on what a request is batched with."""
    overrides = {"norm_topk_prob": True} if request.param != "qwen3" else {}
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
def alone(solo_engine, prompts, choice_gaps, checkpoint):
    """Each request run by itself, with prefix caching off so nothing is shared."""
    llm = solo_engine
    results, comparable = [], []
    for i, prompt in enumerate(prompts):
        choice_gaps.reset()
        out = llm.generate([{"prompt_token_ids": prompt}], _params(i), use_tqdm=False)
        results.append(out[0].outputs[0].token_ids)
        comparable.append(not choice_gaps.near_tie)
    assert all(len(r) == MAX_TOKENS - i % 5 for i, r in enumerate(results))
    if "index_topk" in (checkpoint / "config.json").read_text():  # V3.2: tokens saw more keys than index_topk
        assert choice_gaps.key_choices > 0
    return Alone(results, comparable)


def test_batch_of_16_mixed_lengths(default_engine, prompts, alone):
    assert_same_as_alone(_generate(default_engine, prompts), alone)


def test_three_sequences_at_a_time(checkpoint, prompts, alone):
    """Requests wait for a running one to finish (a hybrid model's next one takes its state slot)."""
    llm = _engine(checkpoint, max_num_seqs=3, max_num_batched_tokens=24)
    assert_same_as_alone(_generate(llm, prompts), alone)
    slots = llm.engine.core.scheduler.state_slots
    if slots is not None:
        assert slots.num_slots == 3 and slots.num_free == 3  # every slot given back


def test_chunked_prefill_forced_small(checkpoint, prompts, alone):
    llm = _engine(checkpoint, max_num_batched_tokens=7)
    assert_same_as_alone(_generate(llm, prompts), alone)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(checkpoint, prompts, alone, prefix_caching):
    llm = _engine(checkpoint, enable_prefix_caching=prefix_caching, max_num_batched_tokens=64)
    first = _generate(llm, prompts)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i) for i in range(len(prompts))],
                         use_tqdm=False)  # a second pass can hit every prompt's full blocks
    assert_same_as_alone(first, alone)
    assert_same_as_alone([o.outputs[0].token_ids for o in again], alone)
    cached = sum(o.num_cached_tokens for o in again)
    hybrid = llm.config.model.has_recurrent_state  # prefix caching is off for it (its state is per token)
    assert llm.config.cache.enable_prefix_caching == (prefix_caching and not hybrid)
    assert (cached > 0) == (prefix_caching and not hybrid)
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
    assert_same_as_alone(_generate(llm, prompts), alone)
    assert preempted, "the tiny cache was expected to force preemptions"
    block_manager = llm.engine.core.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    slots = llm.engine.core.scheduler.state_slots
    assert slots is None or slots.num_free == slots.num_slots


def test_seeded_sampling_is_batch_invariant(default_engine, prompts, choice_gaps):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    batch = default_engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    for i in (0, 5, 11, 14):
        choice_gaps.reset()
        solo = default_engine.generate([{"prompt_token_ids": prompts[i]}], params[i], use_tqdm=False)
        if choice_gaps.near_tie:
            continue
        assert solo[0].outputs[0].token_ids == batch[i].outputs[0].token_ids, f"request {i}"
        compared += 1
    assert compared >= 2


def test_mixed_sampling_rows_follow_their_requests_as_the_batch_changes(default_engine, prompts, choice_gaps):
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
    compared = 0
    for i in range(len(prompts)):
        choice_gaps.reset()
        solo = default_engine.generate([{"prompt_token_ids": prompts[i]}], params(i), use_tqdm=False)
        if choice_gaps.near_tie:
            continue
        assert solo[0].outputs[0].token_ids == batch[i].outputs[0].token_ids, f"request {i}"
        compared += 1
    assert compared >= NUM_REQUESTS // 2
