"""Bad requests and bad models are refused with an error that names the problem, and a refused
request leaves nothing behind: the same LLM then generates exactly what a fresh one does, with
every KV block free and no request left in the engine."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from baryon import LLM, SamplingParams
from baryon.models.registry import supported_architectures
from conftest import random_prompts

VOCAB = 128
MAX_LEN = 48
MAX_LOGPROBS = 5
ENGINE_KWARGS = dict(skip_tokenizer_init=True, device="cpu", max_model_len=MAX_LEN, block_size=8,
                     max_logprobs=MAX_LOGPROBS, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    """One engine shared by every test here: each bad request is sent to it, so a request that
    leaves state behind shows up in this test or a later one."""
    return LLM(str(tiny_llama), **ENGINE_KWARGS)


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def assert_clean(llm: LLM) -> None:
    engine, core = llm.engine, llm.engine.core
    manager = core.block_manager
    assert not engine.has_unfinished_requests()
    assert engine.output_processor.requests == {} and engine.output_processor.samples == {}
    assert core.requests == {} and core.scheduler.num_unfinished == 0
    assert not core.scheduler.waiting and not core.scheduler.running
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


HEALTH_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Random prompts (one long enough for a chunked prefill) and a fresh engine's outputs."""
    from conftest import TEST_SEED

    prompts = random_prompts(1, VOCAB, 1, 16, TEST_SEED)
    prompts.append(random_prompts(1, VOCAB, 33, MAX_LEN - 1, TEST_SEED + 1)[0])
    fresh = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(ids(prompts), HEALTH_PARAMS, use_tqdm=False)
    return prompts, fresh


def assert_healthy(llm: LLM, reference) -> None:
    """No state left behind, and greedy outputs (with logprobs) equal to a fresh engine's."""
    assert_clean(llm)
    prompts, fresh = reference
    got = llm.generate(ids(prompts), HEALTH_PARAMS, use_tqdm=False)
    for g, f in zip(got, fresh, strict=True):
        assert g.prompt_token_ids == f.prompt_token_ids
        assert g.outputs[0].token_ids == f.outputs[0].token_ids
        assert g.outputs[0].finish_reason == f.outputs[0].finish_reason
        # (prefix-cache hits may change the float rounding slightly, not the result)
        for token, g_entry, f_entry in zip(g.outputs[0].token_ids, g.outputs[0].logprobs, f.outputs[0].logprobs):
            assert g_entry.keys() == f_entry.keys()
            assert abs(g_entry[token].logprob - f_entry[token].logprob) < 1e-4
    assert_clean(llm)


def _prompt(rng: random.Random, length: int | None = None) -> list[int]:
    length = length or rng.randrange(1, MAX_LEN - 1)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _with(rng: random.Random, bad_token: int) -> list[int]:
    prompt = _prompt(rng)
    prompt[rng.randrange(len(prompt))] = bad_token
    return prompt


# Each case: (id, a function (rng) -> (prompts, sampling params, what the message must contain),
# the error type). The prompts and params are given to llm.generate.
def _case_token_too_large(rng):
    bad = VOCAB + rng.randrange(0, 1000)
    return ids([_with(rng, bad)]), GREEDY, [str(bad), str(VOCAB), "vocabulary"]


def _case_token_equal_vocab(rng):
    return ids([_with(rng, VOCAB)]), GREEDY, [str(VOCAB), "vocabulary"]


def _case_negative_token(rng):
    bad = -rng.randrange(1, 1000)
    return ids([_with(rng, bad)]), GREEDY, [str(bad), "vocabulary"]


def _case_prompt_at_max_len(rng):
    return ids([_prompt(rng, MAX_LEN)]), GREEDY, [f"{MAX_LEN} tokens", f"max_model_len={MAX_LEN}"]


def _case_prompt_over_max_len(rng):
    n = MAX_LEN + rng.randrange(1, 300)
    return ids([_prompt(rng, n)]), GREEDY, [f"{n} tokens", f"max_model_len={MAX_LEN}"]


def _case_logprobs(rng):
    k = MAX_LOGPROBS + rng.randrange(1, 50)
    return ids([_prompt(rng)]), SamplingParams(logprobs=k), [f"logprobs={k}", f"max_logprobs={MAX_LOGPROBS}"]


def _case_prompt_logprobs(rng):
    k = MAX_LOGPROBS + rng.randrange(1, 50)
    return (ids([_prompt(rng)]), SamplingParams(prompt_logprobs=k),
            [f"prompt_logprobs={k}", f"max_logprobs={MAX_LOGPROBS}"])


def _case_stop_token_out_of_vocab(rng):
    bad = VOCAB + rng.randrange(0, 1000)
    return ids([_prompt(rng)]), SamplingParams(stop_token_ids=[1, bad]), ["stop_token_ids", str(bad)]


def _case_params_count(rng):
    n_prompts = rng.randrange(1, 5)
    n_params = rng.choice([k for k in range(0, 7) if k != n_prompts])
    return (ids([_prompt(rng) for _ in range(n_prompts)]), [GREEDY] * n_params,
            [f"{n_params} SamplingParams for {n_prompts} prompts"])


def test_seed_outside_64_bits_is_refused(seed):
    rng = random.Random(seed)
    bad = rng.choice([2**64 + rng.randrange(1000), -(2**63) - 1 - rng.randrange(1000)])
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=bad)


def test_failure_while_adding_samples_leaves_nothing_behind(tiny_llama, reference, monkeypatch, seed):
    """If the core refuses the 2nd of n=3 samples, the 1st is withdrawn too (all or nothing)."""
    llm = LLM(str(tiny_llama), **ENGINE_KWARGS)
    original = llm.engine.core.add_request
    calls = []

    def failing_add(request_id, *args):
        calls.append(request_id)
        if len(calls) == 2:
            raise ValueError("refused by the core")
        return original(request_id, *args)

    monkeypatch.setattr(llm.engine.core, "add_request", failing_add)
    with pytest.raises(ValueError, match="refused by the core"):
        llm.generate(ids([_prompt(random.Random(seed))]), SamplingParams(n=3, seed=1), use_tqdm=False)
    monkeypatch.setattr(llm.engine.core, "add_request", original)
    assert_healthy(llm, reference)


CASES = [
    ("empty-string", lambda rng: ("", GREEDY, ["empty"]), ValueError),
    ("empty-prompt-dict", lambda rng: ({"prompt": ""}, GREEDY, ["empty"]), ValueError),
    ("empty-token-list", lambda rng: (ids([[]]), GREEDY, ["empty"]), ValueError),
    ("token-id-too-large", _case_token_too_large, ValueError),
    ("token-id-equal-to-vocab-size", _case_token_equal_vocab, ValueError),
    ("negative-token-id", _case_negative_token, ValueError),
    ("float-token-id", lambda rng: (ids([[1, 2.0, 3]]), GREEDY, ["integer"]), ValueError),
    ("bool-token-id", lambda rng: (ids([[1, True]]), GREEDY, ["integer"]), ValueError),
    ("token-ids-as-string", lambda rng: (ids(["1 2 3"]), GREEDY, ["prompt_token_ids"]), ValueError),
    ("prompt-of-max-model-len-tokens", _case_prompt_at_max_len, ValueError),
    ("prompt-over-max-model-len", _case_prompt_over_max_len, ValueError),
    ("dict-wrong-key", lambda rng: ({"prompt_ids": [1, 2]}, GREEDY, ["prompt_ids", "prompt_token_ids"]),
     ValueError),
    ("dict-both-keys", lambda rng: ({"prompt": "a", "prompt_token_ids": [1]}, GREEDY, ["exactly one"]),
     ValueError),
    ("dict-extra-key", lambda rng: ({"prompt_token_ids": [1], "priority": 2}, GREEDY, ["priority"]),
     ValueError),
    ("empty-dict", lambda rng: ({}, GREEDY, ["prompt_token_ids"]), ValueError),
    ("text-without-tokenizer", lambda rng: ("Once upon a time", GREEDY, ["skip_tokenizer_init"]),
     ValueError),
    ("text-dict-without-tokenizer", lambda rng: ({"prompt": "hello"}, GREEDY, ["skip_tokenizer_init"]),
     ValueError),
    ("int-prompt", lambda rng: ([7], GREEDY, ["got int"]), ValueError),
    ("token-list-as-prompt", lambda rng: ([[1, 2, 3]], GREEDY, ["got list", "prompt_token_ids"]), ValueError),
    ("logprobs-above-max-logprobs", _case_logprobs, ValueError),
    ("prompt-logprobs-above-max-logprobs", _case_prompt_logprobs, ValueError),
    ("stop-string-without-tokenizer",
     lambda rng: (ids([_prompt(rng)]), SamplingParams(stop=["the end"]), ["stop", "tokenizer"]), ValueError),
    ("stop-token-id-outside-vocab", _case_stop_token_out_of_vocab, ValueError),
    ("wrong-number-of-sampling-params", _case_params_count, ValueError),
    ("dict-instead-of-sampling-params",
     lambda rng: (ids([_prompt(rng)]), [{"temperature": 0}], ["SamplingParams", "dict"]), TypeError),
]
CASES = [pytest.param(*c, id=c[0]) for c in CASES]
ISOLATED: set[str] = set()  # cases that need an engine of their own


@pytest.mark.parametrize("name,case,error", CASES)
def test_bad_request_is_refused_and_leaves_nothing_behind(llm, tiny_llama, reference, seed, name, case, error):
    if name in ISOLATED:
        llm = LLM(str(tiny_llama), **ENGINE_KWARGS)
    prompts, params, expected = case(random.Random(seed))
    with pytest.raises(error) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert type(e.value) is error, f"{name}: {type(e.value).__name__}: {e.value}"
    for text in expected:
        assert text in str(e.value), f"{name}: the error does not say {text!r}: {e.value}"
    assert_healthy(llm, reference)


def test_longest_allowed_prompt_still_runs(llm, tiny_llama, seed):
    """max_model_len - 1 prompt tokens is the limit: one token of output, then 'length'."""
    prompt = _prompt(random.Random(seed), MAX_LEN - 1)
    out = llm.generate(ids([prompt]), GREEDY, use_tqdm=False)[0].outputs[0]
    fresh = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(ids([prompt]), GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert out.token_ids == fresh.outputs[0].token_ids
    logprobs = llm.generate(ids([prompt]), SamplingParams(temperature=0, max_tokens=1, logprobs=MAX_LOGPROBS,
                                                           prompt_logprobs=MAX_LOGPROBS), use_tqdm=False)[0]
    assert len(logprobs.outputs[0].logprobs[0]) >= MAX_LOGPROBS
    assert len(logprobs.prompt_logprobs) == MAX_LEN - 1 and logprobs.prompt_logprobs[0] is None
    assert_clean(llm)


BAD_PROMPTS = [{"prompt_token_ids": []}, {"prompt_token_ids": [VOCAB]}, {"prompt_token_ids": [-1]},
               {"prompt_token_ids": list(range(MAX_LEN))}, {"prompt_ids": [1]}, "text without tokenizer"]


@pytest.mark.parametrize("bad_index", [2, "random"])
def test_batch_with_a_bad_third_prompt_leaves_no_request_behind(llm, tiny_llama, reference, seed, bad_index):
    rng = random.Random(seed)
    prompts = ids([_prompt(rng, rng.randrange(1, 20)) for _ in range(rng.randrange(4, 6))])
    index = 2 if bad_index == 2 else rng.randrange(len(prompts))
    prompts[index] = rng.choice(BAD_PROMPTS)
    with pytest.raises(ValueError):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean(llm)
    # The good prompts of that batch still run, and give a fresh engine's tokens.
    good = [p for i, p in enumerate(prompts) if i != index]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = llm.generate(good, params, use_tqdm=False)
    fresh = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(good, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in fresh]
    assert_healthy(llm, reference)


def test_batch_with_bad_third_sampling_params(llm, tiny_llama, reference, seed):
    rng = random.Random(seed)
    prompts = ids([_prompt(rng) for _ in range(5)])
    params = [GREEDY] * 5
    params[2] = rng.choice([SamplingParams(logprobs=MAX_LOGPROBS + 1), SamplingParams(stop="x"),
                            SamplingParams(stop_token_ids=[VOCAB])])
    with pytest.raises(ValueError):
        llm.generate(prompts, params, use_tqdm=False)
    assert_healthy(llm, reference)


def test_batch_with_n_samples_and_a_bad_prompt(llm, tiny_llama, reference, seed):
    """Requests of n > 1 samples added before the bad prompt are all removed, every sample."""
    rng = random.Random(seed)
    prompts = ids([_prompt(rng), _prompt(rng), [VOCAB + 1]])
    with pytest.raises(ValueError):
        llm.generate(prompts, SamplingParams(n=3, temperature=0.8, seed=seed, max_tokens=4), use_tqdm=False)
    assert_healthy(llm, reference)


# -- LLMEngine directly -----------------------------------------------------------------------

def test_engine_add_request_refuses_and_keeps_running_requests(llm, tiny_llama, reference, seed):
    rng = random.Random(seed)
    engine = llm.engine
    good = _prompt(rng)
    engine.add_request("kept", {"prompt_token_ids": good}, GREEDY)
    engine.step()  # the good request is running: it owns KV blocks now
    for bad in ({"prompt_token_ids": [VOCAB]}, {"prompt_token_ids": []}, "text", {"prompt_ids": good}):
        with pytest.raises(ValueError):
            engine.add_request(f"bad-{rng.randrange(10**6)}", bad, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("kept", {"prompt_token_ids": _prompt(rng)}, GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("typed", {"prompt_token_ids": good}, {"temperature": 0})
    assert list(engine.output_processor.requests) == ["kept"] and list(engine.core.requests) == ["kept"]

    finished = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished = output
    fresh = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(ids([good]), GREEDY, use_tqdm=False)[0]
    assert finished.request_id == "kept"
    assert finished.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert_healthy(llm, reference)


def test_chat_without_tokenizer(llm, tiny_llama, reference, seed):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert_healthy(llm, reference)


# -- bad models -------------------------------------------------------------------------------

def test_unknown_architecture_lists_the_supported_ones(tiny_llama, tmp_path):
    path = tmp_path / "foo"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        LLM(str(path), skip_tokenizer_init=True, device="cpu")
    assert "FooForCausalLM" in str(e.value) and "architectures" in str(e.value)
    for arch in supported_architectures():
        assert arch in str(e.value)
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(supported_architectures())


def test_missing_checkpoint_folder(tmp_path, seed):
    missing = tmp_path / f"no_such_checkpoint_{seed}"
    with pytest.raises(ValueError) as e:
        LLM(str(missing), skip_tokenizer_init=True, device="cpu")
    assert str(missing) in str(e.value) and "does not exist" in str(e.value)
    nested = f"./no/such/checkpoint_{seed}"
    with pytest.raises(ValueError, match=nested):
        LLM(nested, skip_tokenizer_init=True, device="cpu")


def test_checkpoint_path_that_is_a_file_or_has_no_config(tiny_llama, tmp_path):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_llama / "config.json"), skip_tokenizer_init=True, device="cpu")
    assert "config.json" in str(e.value) and "file" in str(e.value)
    empty = tmp_path / "no_config"
    empty.mkdir()
    shutil.copy(tiny_llama / "model.safetensors", empty / "model.safetensors")
    with pytest.raises(ValueError) as e:
        LLM(str(empty), skip_tokenizer_init=True, device="cpu")
    assert str(empty) in str(e.value) and "config" in str(e.value)


# -- with a tokenizer ---------------------------------------------------------------------------

STORIES_LEN = 32


@pytest.fixture(scope="module")
def stories_llm(stories_path) -> LLM:
    return LLM(str(stories_path), device="cpu", max_model_len=STORIES_LEN)


WORDS = ["Once", "upon", "a", "time", "there", "was", "a", "little", "girl", "named", "Lily"]
STORIES_PARAMS = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def stories_reference(stories_path):
    from conftest import TEST_SEED

    rng = random.Random(TEST_SEED)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12))) for _ in range(3)]
    fresh = LLM(str(stories_path), device="cpu", max_model_len=STORIES_LEN).generate(
        texts, STORIES_PARAMS, use_tqdm=False)
    return texts, [(o.outputs[0].token_ids, o.outputs[0].text) for o in fresh]


@pytest.mark.parametrize("prompt", ["", {"prompt": ""}, "long", {"prompt_token_ids": [512]}, {"prompt": 3},
                                    "Once \ud800upon"],
                         ids=["empty-string", "empty-prompt-dict", "too-long-text", "id-outside-vocab",
                              "non-text-prompt", "half-a-surrogate-pair"])
def test_bad_prompts_with_a_tokenizer(stories_llm, stories_reference, seed, prompt):
    rng = random.Random(seed)
    if prompt == "long":
        prompt = " ".join(rng.choice(WORDS) for _ in range(STORIES_LEN + rng.randrange(0, 40)))
    with pytest.raises(ValueError) as e:
        stories_llm.generate(prompt, GREEDY, use_tqdm=False)
    if prompt in ("", {"prompt": ""}):
        assert "empty" in str(e.value)
    elif isinstance(prompt, str) and "\ud800" in prompt:
        assert "U+D800" in str(e.value) and "character 5" in str(e.value)
    elif isinstance(prompt, str):
        assert f"max_model_len={STORIES_LEN}" in str(e.value)
    elif "prompt_token_ids" in prompt:
        assert "512" in str(e.value) and "vocabulary" in str(e.value)
    assert_clean(stories_llm)

    texts, expected = stories_reference
    got = stories_llm.generate(texts, STORIES_PARAMS, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in got] == expected
    assert all(o.prompt == t for o, t in zip(got, texts))
    assert_clean(stories_llm)
