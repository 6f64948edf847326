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
def test_cuda_graphs_replay_verifications(tmp_path, seed):
    """On the GPU the verifications replay decode graphs (one decode a token for attention, one
    sequence a request for the linear layers): greedy output as without drafts."""
    # heads of 64: the Triton attention kernels (graph safe) serve them
    path = make_checkpoint(tmp_path / "graphs", "qwen3_next", seed=seed % 1000, head_dim=64)
    prompts = random_prompts(6, 128, 3, 14, seed)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(ENGINE, device="cuda")
    reference = _generate(LLM(str(path), **engine), prompts, params)
    llm = LLM(str(path), **engine, speculative_config=NGRAM)
    assert llm.engine.core.runner.graph_runner is not None
    _with_oracle(llm, prompts, reference, error=0.3, seed=seed)
    _assert_same(_generate(llm, prompts, params), reference)


def _with_mtp_weights(path, arch: str, seed: int):
    """Add `mtp.*` tensors to a saved hybrid checkpoint (one MTP layer: a random full-attention
    decoder layer of the same config, fc and norms), as the published checkpoints carry them.
    Returns transformers' modules of the MTP (float64) for the reference."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from conftest import hf_classes, spread_hybrid_norms

    config = AutoConfig.from_pretrained(path)
    _, model_cls = hf_classes(arch)
    torch.manual_seed(seed + 1)
    donor = model_cls(config).eval()
    spread_hybrid_norms(donor)
    full = config.layer_types.index("full_attention")
    hidden = config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    donor.save_pretrained(path / "donor")  # the published tensor layout (experts one by one)
    layer = f"model.layers.{full}."
    mtp = {f"mtp.layers.0.{name[len(layer):]}": tensor
           for name, tensor in load_file(path / "donor" / "model.safetensors").items() if name.startswith(layer)}
    mtp |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5,
            **{f"mtp.{norm}.weight": torch.randn(hidden, generator=gen) * 0.1
               for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    weights = load_file(path / "model.safetensors") | {n: t.contiguous() for n, t in mtp.items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    donor = model_cls.from_pretrained(path / "donor", dtype=torch.float64, attn_implementation="eager",
                                      experts_implementation="eager").eval()  # (grouped matmuls take no float64)
    return {"layer": donor.model.layers[full], "rotary": donor.model.rotary_emb,
            **{name[4:-7]: tensor.double() for name, tensor in mtp.items() if not name.startswith("mtp.layers")}}


def _mtp_reference(path, mtp, tokens: list[int]) -> list[int]:
    """transformers' target over `tokens`, then the MTP formula at every position p (hidden at p,
    token p + 1): the token it predicts for p + 2."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                  experts_implementation="eager").eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state[0]  # [L, hidden], after the final norm

        def norm(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps) * (1 + weight)

        embeds = norm(target.model.embed_tokens(ids[0, 1:]), mtp["pre_fc_norm_embedding"])
        x = torch.cat((embeds, norm(hidden[:-1], mtp["pre_fc_norm_hidden"])), dim=-1) @ mtp["fc"].t()
        n = x.shape[0]
        positions = torch.arange(n)[None]
        # (Qwen3.5's rotary takes [3, batch, n] positions: multimodal RoPE, all three alike for text)
        rope_positions = positions[None].expand(3, 1, n) if "qwen3_5" in target.config.model_type else positions
        causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = mtp["layer"](x[None], position_embeddings=mtp["rotary"](x[None], rope_positions), attention_mask=causal,
                           position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        logits = target.lm_head(norm(out[0], mtp["norm"]))
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_mtp_drafts_are_the_mtp_layers_predictions(tmp_path, arch, seed):
    """The checkpoint's MTP layer drafts (k = 1): every draft is the token transformers' target
    plus the MTP formula predict there; greedy output is the target's; k = 2 chains the layer."""
    path = make_checkpoint(tmp_path / arch, arch, seed=seed % 1000)
    mtp = _with_mtp_weights(path, arch, seed % 1000)
    prompts = random_prompts(3, 128, 5, 12, seed)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    reference = _generate(LLM(str(path), **ENGINE), prompts, params)
    llm = LLM(str(path), **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    proposer = llm.engine.core.runner.proposer
    assert type(proposer.model).__name__ == "Qwen3NextMTP" and proposer.num_mtp_layers == 1
    assert proposer.model.lm_head is llm.engine.core.runner.model.lm_head  # shared, not a copy
    drafts = {}  # (prompt, tokens known) -> the draft
    propose = proposer.propose

    def recording(requests, max_drafts, sampling):
        proposals = propose(requests, max_drafts, sampling)
        for request, proposal in zip(requests, proposals):
            if proposal:
                drafts[(tuple(request.prompt_token_ids), request.num_tokens)] = proposal[0]
        return proposals

    proposer.propose = recording
    _assert_same(_generate(llm, prompts, params), reference)
    assert drafts
    checked = 0
    for prompt, ref in zip(prompts, reference):
        sequence = prompt + ref.token_ids
        predicted = _mtp_reference(path, mtp, sequence)
        for (key, known), draft in drafts.items():
            if key == tuple(prompt):  # a draft for index `known`, from position known - 2
                assert draft == predicted[known - 2], (known, draft, predicted[known - 2])
                checked += 1
    assert checked == len(drafts)
    # (vLLM's name of the method)
    chained = LLM(str(path), **ENGINE, speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    assert chained.config.speculative.method == "mtp"
    _assert_same(_generate(chained, prompts, params), reference)


def test_mtp_without_mtp_weights_is_refused(hybrid):
    with pytest.raises(ValueError, match="no multi-token prediction weights"):
        LLM(str(hybrid), **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
