"""Turns EngineCore token outputs into RequestOutputs: detokenizes, applies stop strings, builds
logprob dicts and gathers the n samples of a request into one RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from baryon.engine.core import EngineCoreOutput
from baryon.engine.detokenizer import IncrementalDetokenizer
from baryon.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from baryon.runner.model_runner import RawLogprobs
from baryon.sampling_params import SamplingParams
from baryon.tokenizer import token_texts


@dataclass
class _SampleState:
    """One of the n samples of a request (one engine-core request)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_SampleState]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["time_to_first_token"] = self.first_token_time - self.arrival_time
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                             [s.completion() for s in self.samples], self.finished,
                             self.num_cached_tokens, metrics)


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine-core id of sample `index` of a request (the request id itself when n == 1)."""
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.samples: dict[str, tuple[_RequestState, _SampleState]] = {}  # core id -> states

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[str]:
        """Track a request; returns the engine-core ids of its samples."""
        samples = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            samples.append(_SampleState(i, params, detok, logprobs=[] if params.logprobs is not None else None,
                                        cumulative_logprob=0.0 if params.logprobs is not None else None))
        state = _RequestState(request_id, prompt, list(prompt_token_ids), samples)
        if params.prompt_logprobs is not None and len(prompt_token_ids) == 1:
            state.prompt_logprobs = [None]  # the first token has none, and no other comes from the core
        self.requests[request_id] = state
        core_ids = [sample_request_id(request_id, i, params.n) for i in range(params.n)]
        for core_id, sample in zip(core_ids, samples):
            self.samples[core_id] = (state, sample)
        return core_ids

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the core ids of its unfinished samples (to abort in the core)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        n = len(state.samples)
        unfinished = [sample_request_id(request_id, s.index, n) for s in state.samples if s.finish_reason is None]
        for s in state.samples:
            self.samples.pop(sample_request_id(request_id, s.index, n), None)
        return unfinished

    def process(self, outputs: list[EngineCoreOutput], final_only: bool = False) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's core outputs. Returns the RequestOutputs of the requests that changed
        (with final_only, of those that finished: building every running request's output every
        step is wasted work offline) and the core ids that a stop string finished (the caller
        aborts them in the core)."""
        changed: dict[str, _RequestState] = {}
        to_abort = []
        for out in outputs:
            entry = self.samples.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, sample = entry
            if state.first_token_time is None:
                state.first_token_time = time.monotonic()
                state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None] + [self._logprob_dict(raw) for raw in out.prompt_logprobs]
            stopped_by_string = self._append(sample, out)
            if stopped_by_string and out.finish_reason is None:
                to_abort.append(out.request_id)
            if sample.finish_reason is not None:
                del self.samples[out.request_id]
            changed[state.request_id] = state
        results = []
        for request_id, state in changed.items():
            finished = state.finished
            if finished or not final_only:
                results.append(state.output())
            if finished:
                del self.requests[request_id]
        return results, to_abort

    def _append(self, sample: _SampleState, out: EngineCoreOutput) -> bool:
        """Add the new tokens to a sample; True if a stop string ended it. The token that ends a
        sample (EOS or a stop token id: finish_reason "stop" without a stop string) adds no
        text, as in vLLM, even where special tokens are kept in the text."""
        ended_by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if out.new_logprobs is not None:
                raw = out.new_logprobs[i]
                sample.logprobs.append(self._logprob_dict(raw))
                sample.cumulative_logprob += raw[1][0]
            if sample.detokenizer is None or (ended_by_token and i == len(out.new_token_ids) - 1):
                continue
            delta = sample.detokenizer.step(token)
            if delta:
                sample.text += delta
                if self._check_stop_strings(sample, len(delta)):
                    return True
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return False

    @staticmethod
    def _check_stop_strings(sample: _SampleState, delta_len: int) -> bool:
        """Cut the text at the first stop string that the new text completed (not included)."""
        params = sample.params
        if not params.stop_strings or len(sample.token_ids) < params.min_tokens:
            return False
        longest = max(map(len, params.stop_strings))
        search_from = max(0, len(sample.text) - delta_len - longest + 1)
        found = [(sample.text.find(s, search_from), s) for s in params.stop_strings]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return False
        pos, stop = min(found)
        sample.text = sample.text[:pos]
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    def _logprob_dict(self, raw: RawLogprobs) -> PositionLogprobs:
        ids, values, first_rank = raw
        result: PositionLogprobs = {}
        for j, (token_id, value) in enumerate(zip(ids, values)):
            if token_id in result:
                continue
            text = token_texts(self.tokenizer)(token_id) if self.tokenizer is not None else None
            result[token_id] = Logprob(value, first_rank if j == 0 else j, text)
        return result
