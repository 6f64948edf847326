"""EngineCore: the scheduler, the block manager and the model runner, advanced one step at a time.

It speaks token ids only: requests come in as prompt token ids + SamplingParams, and each step
returns the new token ids (and logprobs) of the requests it advanced, with a finish reason when
one ended by a token-level rule (EOS, a stop token id, max_tokens, the context length). Text —
tokenizing, detokenizing, stop strings — belongs to the frontend, which may abort a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baryon.config import EngineConfig
from baryon.engine.kv_cache import BlockManager
from baryon.engine.scheduler import Scheduler
from baryon.logger import get_logger
from baryon.request import Request, RequestStatus
from baryon.runner.model_runner import LaunchedStep, ModelRunner, ModelRunnerOutput, RawLogprobs
from baryon.sampling_params import SamplingParams

logger = get_logger(__name__)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[RawLogprobs] | None = None
    prompt_logprobs: list[RawLogprobs] | None = None  # whole prompt, sent once with the first token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def check_prompt(config: EngineConfig, prompt_token_ids: list[int]) -> None:
    """Refuse, before any work, a prompt the engine cannot run."""
    max_model_len, vocab = config.model.max_model_len, config.model.vocab_size
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, which leaves no room for "
                         f"output in max_model_len={max_model_len}; the prompt may have at most "
                         f"{max_model_len - 1} tokens")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab}) of the model"
                         + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""))


@dataclass
class _InFlight:
    scheduled: list[tuple[Request, int]]
    step: LaunchedStep


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._prompt_logprobs: dict[str, list[RawLogprobs]] = {}
        self._in_flight: _InFlight | None = None  # the launched step not yet read back

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: frozenset[int]) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        room = self.config.model.max_model_len - len(prompt_token_ids)
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids,
                          max_tokens=room if params.max_tokens is None else min(params.max_tokens, room))
        if params.seed is not None:
            request.generator = torch.Generator(self.config.device).manual_seed(params.seed)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(self.config, prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then read back the previous one.

        Launching step N+1 before waiting for step N keeps the device busy while the host
        prepares, updates and detokenizes. Step N+1 feeds each decoding request the token step
        N sampled straight from device memory. A request that step N ends (EOS, a stop token)
        may have one token computed in step N+1 in vain; that token is dropped. Requests whose
        pending token is their last (max_tokens) are not scheduled again.
        """
        scheduled = self.scheduler.schedule().scheduled
        launched = None
        if scheduled:
            launched = _InFlight(scheduled, self.runner.launch(scheduled))
            for request, num_new in scheduled:
                request.num_computed_tokens += num_new
                if request.request_id in launched.step.row_of:
                    request.num_pending_tokens += 1
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        return self._update(previous.scheduled, previous.step.result())

    def _update(self, scheduled: list[tuple[Request, int]], result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for request, _ in scheduled:
            rid = request.request_id
            if self.requests.get(rid) is not request:
                continue  # finished or aborted since this step was launched
            if rid in result.prompt_logprobs:
                previous = self._prompt_logprobs.get(rid, []) if result.prompt_logprobs_start[rid] else []
                self._prompt_logprobs[rid] = previous + result.prompt_logprobs[rid]
            token = result.sampled.get(rid)
            if token is None:
                self.block_manager.cache_full_blocks(request)
                continue
            request.append_output_token(token)
            self.block_manager.cache_full_blocks(request)
            status = self._finish_status(request, token)
            output = EngineCoreOutput(
                rid, [token], new_logprobs=[result.logprobs[rid]] if rid in result.logprobs else None,
                prompt_logprobs=self._prompt_logprobs.pop(rid, None),
                num_cached_tokens=max(request.num_cached_tokens, 0))
            if status is not None:
                self.scheduler.finish(request, status)
                del self.requests[rid]
                output.finish_reason, output.stop_reason = request.finish_reason, request.stop_reason
            outputs.append(output)
        return outputs

    def _finish_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
