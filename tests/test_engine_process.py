"""The offline API with its engine core in a process of its own (`engine_process=True`, the default
on a GPU): the same outputs as the engine in this process, the stopping rules that this process
applies (stop strings), structured outputs, the step and speculative-decoding counts the
benchmarks read, and a process that ends with the LLM."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from baryon import LLM, SamplingParams, StructuredOutputsParams
from baryon.config import EngineConfig, default_engine_process
from conftest import STORIES_PATH, random_prompts

pytestmark = pytest.mark.skipif(not STORIES_PATH.exists(), reason="needs the stories260K checkpoint")

ENGINE = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_gib=0.05)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def here(device):
    with LLM(str(STORIES_PATH), **{**ENGINE, "device": device}, engine_process=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def apart(device):
    with LLM(str(STORIES_PATH), **{**ENGINE, "device": device}, engine_process=True) as llm:
        yield llm


def _texts_and_ids(outputs):
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def test_the_default_follows_the_device():
    # (the function itself, imported before conftest's session fixture replaced baryon.config's)
    assert default_engine_process(torch.device("cuda", 0)) and not default_engine_process(torch.device("cpu"))
    assert EngineConfig.create(model=str(STORIES_PATH), device="cpu").engine_process is False
    assert EngineConfig.create(model=str(STORIES_PATH), device="cpu", engine_process=True).engine_process is True
    # Data-parallel replicas always are engine processes: asking for none is refused, not ignored.
    with pytest.raises(ValueError, match="engine_process=False cannot hold with data_parallel_size=2"):
        EngineConfig.create(model=str(STORIES_PATH), device="cpu", data_parallel_size=2, engine_process=False)


def test_outputs_match_the_engine_in_this_process(here, apart, seed):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 512, 3, 40, seed)] + ["Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0.9, top_p=0.8, seed=seed, max_tokens=20, n=2, logprobs=3)
    params[2] = SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=2)
    expected, got = here.generate(prompts, params, use_tqdm=False), apart.generate(prompts, params, use_tqdm=False)
    assert _texts_and_ids(got) == _texts_and_ids(expected)
    # The same batches run (a generate call's requests reach the engine as one message), so the
    # same numbers come out; a little tolerance still, as arrival is asynchronous.
    _assert_logprobs_close(got[1].outputs[0].logprobs, expected[1].outputs[0].logprobs)
    _assert_logprobs_close(got[2].prompt_logprobs[1:], expected[2].prompt_logprobs[1:])
    assert got[2].prompt_logprobs[0] is None


def _assert_logprobs_close(got, expected):
    assert len(got) == len(expected) > 0
    for position, reference in zip(got, expected):
        assert position.keys() == reference.keys()
        for token, logprob in position.items():
            assert logprob.decoded_token == reference[token].decoded_token
            assert logprob.logprob == pytest.approx(reference[token].logprob, abs=1e-4)


def test_a_stop_string_ends_the_request_in_the_engine_process(here, apart):
    free = here.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    words = free.outputs[0].text.split()
    assert len(words) > 4, free.outputs[0].text
    stop = words[3]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    expected = here.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    got = apart.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop and stop not in got.text
    assert (got.text, got.token_ids) == (expected.text, expected.token_ids)
    # The aborted request left nothing running: a next batch runs whole.
    again = apart.generate(["Once upon a time"] * 3, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in again] == [12, 12, 12]


def test_structured_output_in_the_engine_process(apart, seed):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = apart.generate(["Once upon a time", "The cat", "Once upon a time"], [params, plain, params],
                             use_tqdm=False)
    for output in (outputs[0], outputs[2]):
        value = json.loads(output.outputs[0].text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120 and len(value["name"]) <= 8
    assert len(outputs[1].outputs[0].token_ids) == 10


def test_the_benchmarks_counts_come_from_the_engine_process(apart):
    core = apart.engine.core
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    # The engine runs ahead of this process (a request that a stop string ended here ran on until
    # its abort arrived): a first batch settles what earlier tests left, a second is counted.
    apart.generate(["Once upon a time"] * 2, params, use_tqdm=False)
    before = core.num_steps
    apart.generate(["Once upon a time"] * 2, params, use_tqdm=False)
    # One prefill step and eight decodes; with steps overlapping one more may be launched in vain.
    assert 9 <= core.num_steps - before <= 10
    assert core.spec_stats.num_drafts == 0


def test_speculative_counts_add_up_across_the_process():
    with LLM(str(STORIES_PATH), **ENGINE, engine_process=True,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 1}) as llm:
        repeated = {"prompt_token_ids": [5, 6, 7, 8] * 12}
        llm.generate([repeated], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        stats = llm.engine.core.spec_stats
        assert stats.num_speculative_tokens == 3 and stats.num_draft_tokens > 0
        assert stats.num_accepted_tokens == sum(stats.accepted_per_position) <= stats.num_draft_tokens


def test_the_engine_process_ends_with_the_llm():
    llm = LLM(str(STORIES_PATH), **ENGINE, engine_process=True)
    (replica,) = llm.engine.core.replicas
    pid = replica.pid
    llm.generate("Once upon a time", SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()
    assert replica.exit_code() is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"the engine process {pid} is still running after shutdown()")


def test_serve_has_no_engine_process_flag():
    import argparse

    from baryon.server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--model", str(STORIES_PATH)]).model == str(STORIES_PATH)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", str(STORIES_PATH), "--engine-process"])


def test_a_refused_configuration_leaves_no_engine_process(monkeypatch):
    """The engine process starts before the arguments are checked (it imports meanwhile): an
    argument the configuration refuses stops it again."""
    import baryon.llm
    from baryon.engine.core_client import EngineProcess

    started = []

    class Recorded(EngineProcess):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(baryon.llm, "EngineProcess", Recorded)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(STORIES_PATH), **ENGINE | {"max_num_seqs": 0}, engine_process=True)
    assert len(started) == 1 and started[0].exit_code() is not None
