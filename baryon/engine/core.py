"""EngineCore: the scheduler, the block manager and the model runner, advanced one step at a time.

It speaks token ids only: requests come in as prompt token ids + SamplingParams, and each step
returns the new token ids (and logprobs) of the requests it advanced, with a finish reason when
one ended by a token-level rule (EOS, a stop token id, max_tokens, the context length). Text —
tokenizing, detokenizing, stop strings — belongs to the frontend, which may abort a request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from baryon.config import EngineConfig
from baryon.distributed.parallel_state import destroy_distributed, dp_all_gather_host, init_distributed
from baryon.distributed.worker_group import WorkerGroup, WorkerDiedError, backend_for
from baryon.engine.kv_cache import BlockManager
from baryon.engine.scheduler import Scheduler
from baryon.engine.state_slots import StateSlots
from baryon.logger import get_logger
from baryon.multimodal.inputs import MultiModalInputs, RequestImages
from baryon.request import Request, RequestStatus
from baryon.layers.forward_context import DPStep
from baryon.runner.model_runner import LaunchedStep, ModelRunner, RawLogprobs
from baryon.sampling_params import SamplingParams
from baryon.structured_output.compiler import GrammarCompiler
from baryon.structured_output.matcher import RequestGrammar

logger = get_logger(__name__)

SPEC_LOG_INTERVAL_S = 10.0  # how often speculative decoding's acceptance is logged


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
class SpecDecodeStats:
    """Speculative decoding totals since start (vLLM's spec_decode metrics)."""

    num_speculative_tokens: int  # k
    num_drafts: int = 0  # verifications of a request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at each depth

    last_log_time: float = 0.0

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def log_every(self, interval_s: float) -> None:
        now = time.monotonic()
        if self.num_drafts and now - self.last_log_time >= interval_s:
            self.last_log_time = now
            logger.info("speculative decoding: acceptance rate %.3f, mean accepted length %.2f, %d draft "
                        "tokens, accepted per position %s", self.acceptance_rate, self.mean_accepted_length,
                        self.num_draft_tokens, self.accepted_per_position)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _InFlight:
    scheduled: list[tuple[Request, int]]
    step: LaunchedStep
    num_drafts: dict[str, int] = field(default_factory=dict)  # request id -> drafts it verifies


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._grammar_compiler: GrammarCompiler | None = None  # made for the first structured-output request
        parallel = config.parallel
        tp = parallel.tensor_parallel_size
        # DP attention: this replica is one rank of the replicas' process group (see step()).
        self.data_parallel = parallel.data_parallel_attention
        self.stopped = False  # DP attention: the replicas agreed to stop
        self.replicas_busy = False  # DP attention: some replica had work in the last round
        if self.data_parallel:
            if config.device.type == "cuda":
                torch.cuda.set_device(config.device)
            init_distributed(parallel.data_parallel_size, parallel.data_parallel_rank,
                             parallel.data_parallel_init_method, backend_for(config.device), True,
                             config.model.dtype, data_parallel=True)
            logger.info("DP attention: replica %d of %d; the MoE layers' experts are divided among the replicas",
                        parallel.data_parallel_rank, parallel.data_parallel_size)
        # Tensor parallelism: ranks 1.. in worker processes, rank 0 here; all build their runner at once.
        self.workers = WorkerGroup.start(config, tp, parallel.enable_expert_parallel) if tp > 1 else None
        try:
            self.runner = ModelRunner(config, self.workers)
        except Exception as e:
            try:
                # A worker that died is the reason to give (a collective failed, or the process
                # group its death aborted was gone; waited for only after a failed collective).
                if self.workers is not None:
                    self.workers.check(wait_s=1.0 if isinstance(e, RuntimeError) else 0.0, starting=True)
            finally:
                self.shutdown()
            raise
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        spec = config.speculative
        state_slots = StateSlots(self.runner.num_state_slots) if self.runner.num_state_slots else None
        self.scheduler = Scheduler(config.scheduler, self.block_manager, spec.num_lookahead_slots if spec else 0,
                                   state_slots)
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        self.requests: dict[str, Request] = {}
        self._prompt_logprobs: dict[str, list[RawLogprobs]] = {}
        self._in_flight: _InFlight | None = None  # the launched step not yet read back
        self.num_steps = 0  # steps launched since start
        # Steps overlap (launch N+1, then read N) unless a model drafts after each read-back.
        self._overlap = spec is None or spec.method == "ngram"

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: frozenset[int], multimodal: MultiModalInputs | None = None) -> None:
        """multimodal: the prompt's images, their placeholder tokens expanded in prompt_token_ids."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        room = self.config.model.max_model_len - len(prompt_token_ids)
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids,
                          max_tokens=room if params.max_tokens is None else min(params.max_tokens, room))
        if multimodal is not None:
            request.images = self._request_images(prompt_token_ids, multimodal)
        if params.seed is not None:
            request.generator = torch.Generator(self.config.device).manual_seed(params.seed)
        if params.structured_outputs is not None:
            request.grammar = RequestGrammar(self._grammars().submit(params.structured_outputs), eos_token_ids,
                                             params.structured_outputs.reasoning_end)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _request_images(self, prompt_token_ids: list[int], multimodal: MultiModalInputs) -> RequestImages:
        if self.runner.images is None:
            raise ValueError(f"{self.config.model.hf_config.architectures[0]} does not read images; image "
                             f"prompts need an image-and-text model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)")
        multimodal.check(prompt_token_ids, self.config.model.hf_config.image_token_id)
        return RequestImages(multimodal, len(prompt_token_ids))

    def _grammars(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            model = self.config.model
            if model.tokenizer_path is None:
                raise ValueError("structured outputs need a tokenizer; this engine has skip_tokenizer_init=True")
            self._grammar_compiler = GrammarCompiler(model.tokenizer_path, model.trust_remote_code, model.vocab_size)
        return self._grammar_compiler

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(self.config, prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                self._prompt_logprobs.pop(request_id, None)
                self.runner.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    # -- one step -----------------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def shutdown(self) -> None:
        """Stop the worker processes (tensor parallelism) or leave the replicas' group (DP
        attention); the engine cannot step afterwards."""
        multi_rank = self.workers is not None or self.data_parallel
        runner = getattr(self, "runner", None)  # absent when the runner failed to build
        worker_died = self.workers is not None and self.workers.failure is not None  # the device may wait on it
        if multi_rank and runner is not None and not worker_died:
            runner.release_cuda_graphs()  # before the process group goes (see CUDAGraphRunner.release)
        if self.workers is not None:
            self.workers.shutdown()
        if self.data_parallel:
            destroy_distributed()
        if runner is not None:
            runner.step_masks.shutdown()
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()

    def step(self, stopping: bool = False) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then read back the previous one (see `_step`).
        With worker processes, a step that fails because a worker died says so.

        DP attention: every replica calls this in every round of its loop, with or without work
        (`stopping`: this replica was asked to stop). The replicas agree on the round first: if
        one has tokens to run, all launch a forward pass (padding only where nothing is
        scheduled); if one is stopping, all stop (`self.stopped`) and launch nothing."""
        if self.workers is None:
            return self._step(stopping)
        try:
            return self._step(stopping)
        except WorkerDiedError:
            raise
        except RuntimeError:  # a collective failed: a worker that died is the reason to give
            self.workers.check(wait_s=1.0)
            raise

    def _step(self, stopping: bool = False) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then read back the previous one.

        Launching step N+1 before waiting for step N keeps the device busy while the host
        prepares, updates and detokenizes. Step N+1 feeds each decoding request the token step
        N sampled straight from device memory. A request that step N ends (EOS, a stop token)
        may have one token computed in step N+1 in vain; that token is dropped. Requests whose
        pending token is their last (max_tokens) are not scheduled again.

        With speculative decoding a step that verifies drafts yields a number of tokens known
        only once it is read back, so nothing is launched behind it: the call that finds it in
        flight reads it. Steps without drafts overlap as above when the proposer runs on the
        host (n-gram lookup: it then drafts from the tokens known so far, one token behind, for
        the positions after the pending token). A model draft runs on the device after each
        step's read-back, so with one every step is read back before the next is planned.
        """
        flight, read_back = self._in_flight, []
        if flight is not None and (flight.num_drafts or not self._overlap):
            self._in_flight = None
            read_back = self._update(flight)
            if not self.data_parallel:
                return read_back
            # DP attention: this round still meets the other replicas (their MoE layers may need
            # this replica's experts), with the step planned from the tokens just read.
        outputs = read_back + self._fail_broken_grammars()
        # DP attention: after a round in which no replica ran anything, no request has new tokens
        # to draft from on any replica, so all skip drafting alike (a draft with experts would
        # otherwise meet the others for nothing in every idle round).
        if self.config.speculative is not None and (not self.data_parallel or self.replicas_busy):
            self.runner.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule().scheduled if not stopping else []
        dp_step = self._agree_with_replicas(scheduled, stopping) if self.data_parallel else None
        if self.stopped:
            return outputs
        launched = None
        if not scheduled and dp_step is not None:
            self.runner.launch([], dp_step)  # padding: the other replicas' tokens need this replica's experts
        if scheduled:
            launched = _InFlight(scheduled, self.runner.launch(scheduled, dp_step))
            self.num_steps += 1
            for request, num_new in scheduled:
                request.num_computed_tokens += num_new
                if request.request_id in launched.step.row_of:
                    request.num_pending_tokens += 1
                if request.spec_token_ids:
                    launched.num_drafts[request.request_id] = len(request.spec_token_ids)
                    request.spec_token_ids = []
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return outputs
        return outputs + self._update(previous)

    def _agree_with_replicas(self, scheduled: list[tuple[Request, int]], stopping: bool) -> DPStep | None:
        """DP attention: every replica says what it would run (tokens, sequences, whether all are
        decodes) and whether it stops; all get the same answer: the step every one launches
        (None: no replica has work) — the rows every replica pads its MoE input to, and the
        decode graph all replay when every replica's step is decodes (or nothing) that fit one."""
        num_tokens = sum(n for _, n in scheduled)
        decodes = all(n == 1 for _, n in scheduled)
        rounds = dp_all_gather_host([num_tokens, len(scheduled), int(decodes), int(stopping)])
        if any(stop for *_, stop in rounds):
            self.stopped = True
            return None
        padded_tokens = max(tokens for tokens, *_ in rounds)
        self.replicas_busy = padded_tokens > 0
        if padded_tokens == 0:
            return None
        graph_size = None
        if all(decodes for _, _, decodes, _ in rounds):
            graph_size = self.runner.dp_graph_size(max(seqs for _, seqs, *_ in rounds))
        return DPStep(padded_tokens=graph_size or padded_tokens, graph_size=graph_size)

    def _fail_broken_grammars(self) -> list[EngineCoreOutput]:
        """Abort the waiting requests whose grammar did not compile (the frontends check every
        spec's syntax first, so this is what xgrammar refuses past parsing)."""
        outputs = []
        for request in [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.error]:
            logger.error("request %s: its grammar did not compile: %s", request.request_id, request.grammar.error)
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            del self.requests[request.request_id]
            self.runner.forget(request.request_id)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=request.finish_reason,
                                            stop_reason=f"grammar error: {request.grammar.error}"))
        return outputs

    def _update(self, flight: _InFlight) -> list[EngineCoreOutput]:
        result = flight.step.result()
        outputs = []
        for request, _ in flight.scheduled:
            rid = request.request_id
            if self.requests.get(rid) is not request:
                continue  # finished or aborted since this step was launched
            if rid in result.prompt_logprobs:
                previous = self._prompt_logprobs.get(rid, []) if result.prompt_logprobs_start[rid] else []
                self._prompt_logprobs[rid] = previous + result.prompt_logprobs[rid]
            tokens = result.sampled.get(rid)
            if tokens is None:
                self.block_manager.cache_full_blocks(request)
                continue
            num_drafts = flight.num_drafts.get(rid, 0)
            if num_drafts:  # roll the rejected drafts back: their K/V slots get rewritten
                self.spec_stats.add(num_drafts, len(tokens) - 1)
                request.num_computed_tokens -= num_drafts - (len(tokens) - 1)
            logprobs = result.logprobs.get(rid)
            status = None
            for n, token in enumerate(tokens, 1):
                request.append_output_token(token)
                status = self._finish_status(request, token)
                if status is not None:
                    if request.grammar is not None and request.grammar.refused(request.num_output_tokens - 1):
                        request.drop_last_output_token()  # the grammar allowed no token here: none is output
                        n -= 1
                    tokens, logprobs = tokens[:n], logprobs[:n] if logprobs is not None else None
                    break
            self.block_manager.cache_full_blocks(request)
            output = EngineCoreOutput(
                rid, tokens, new_logprobs=logprobs, prompt_logprobs=self._prompt_logprobs.pop(rid, None),
                num_cached_tokens=max(request.num_cached_tokens, 0))
            if status is not None:
                self.scheduler.finish(request, status)
                del self.requests[rid]
                self.runner.forget(rid)
                output.finish_reason, output.stop_reason = request.finish_reason, request.stop_reason
            outputs.append(output)
        if flight.num_drafts:
            self.spec_stats.log_every(SPEC_LOG_INTERVAL_S)
        return outputs

    def _finish_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        grammar = request.grammar
        if grammar is not None:  # structured outputs: a grammar that has ended stops the request
            if grammar.num_accepted < len(request.output_token_ids):  # (a step's masks accepted it already)
                grammar.advance(request.output_token_ids)
            if grammar.is_terminated():
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
