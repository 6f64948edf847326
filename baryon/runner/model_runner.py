"""The model runner: owns the model, the KV cache and the sampler; runs one scheduled step.

Each step turns the scheduler's (request, num_new_tokens) list into flat batch tensors and
attention metadata (built with vectorised numpy), runs the model, computes logits only for the
rows that are sampled (plus prompt positions whose logprobs were asked for) and samples
(a request with structured outputs: from the tokens its grammar allows).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from baryon.config import EngineConfig
from baryon.distributed.parallel_state import broadcast_from_first, tp_rank, tp_world_size
from baryon.distributed.worker_group import WorkerGroup
from baryon.request import Request
from baryon.kernels import vocab_argmax
from baryon.kernels.attention.metadata import AttentionMetadata, batch_layout, host_metadata, padding_metadata
from baryon.layers.attention import Attention, PagedKVLayer
from baryon.layers.forward_context import DPStep, MultiModalStep, forward_context, multimodal_context
from baryon.layers.gated_delta_net import RecurrentStateLayer
from baryon.layers.sampler import Sampler, SamplingBatch
from baryon.layers.fused_decoder_layer import fuse_decoder_layers
from baryon.loader.model_loader import load_model
from baryon.logger import get_logger
from baryon.multimodal.processor import largest_image_tokens
from baryon.runner.compilation import LEVEL_NAMES, compile_forward, uses_cuda_graphs
from baryon.runner.cuda_graph import CUDAGraphRunner, default_capture_sizes
from baryon.runner.image_inputs import ImageEncoder, rope_positions
from baryon.runner.kv_cache_sizing import choose_num_blocks
from baryon.runner.piecewise_graph import PiecewiseGraphRunner, default_piecewise_sizes
from baryon.runner.propose_plan import ProposePlan, ProposeReceiver, ProposeSender
from baryon.runner.sampling_inputs import build_sampling_batch
from baryon.runner.step_plan import StepPlan
from baryon.runner.step_watchdog import StepWatchdog
from baryon.spec_decode.factory import build_proposer
from baryon.spec_decode.rejection_sampler import RejectionSampler
from baryon.structured_output.step_masks import PendingMask, StepMasks
from baryon.transfer import to_device, to_device_many

logger = get_logger(__name__)

# With speculative decoding, decode graphs are captured up to this many tokens (verification steps
# of up to this many draft + last tokens replay them).
MAX_VERIFY_GRAPH_TOKENS = 512

# How often a multi-GPU engine's wait for a step asks its watchdog (dead workers, hangs), seconds.
_WATCH_INTERVAL_S = 0.01

# (token ids [k+1], logprobs [k+1], rank of the first id): one position's logprobs, the token
# that was sampled (or, for prompt logprobs, the actual next prompt token) first.
RawLogprobs = tuple[list[int], list[float], int]


@dataclass
class ModelRunnerOutput:
    # request id -> new token ids (one, or with speculative decoding the accepted drafts + one)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[RawLogprobs]] = field(default_factory=dict)  # one per new token
    prompt_logprobs: dict[str, list[RawLogprobs]] = field(default_factory=dict)  # for this chunk
    prompt_logprobs_start: dict[str, int] = field(default_factory=dict)  # the chunk's first position


@dataclass
class _Batch:
    """A step's inputs on the device."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    query_start: np.ndarray  # [num_seqs + 1]: each scheduled request's first token index


@dataclass
class _Sampling:
    """Rank 0's view of a step's requests: who samples, from which rows."""

    # Token index of each sampling request's last token, or of its last token and its drafts.
    sample_rows: list[int]
    sampling_requests: list[Request]
    num_drafts: list[int]  # per sampling request: draft tokens verified this step
    # (request, first token index, number of rows) for prompt-logprob rows of this chunk.
    prompt_logprob_spans: list[tuple[Request, int, int]]


class ModelRunner:
    """One rank's model runner. With tensor parallelism every rank builds one (rank 0 in the
    engine, with `workers`: the other ranks' processes, which it sends each step's plan); only
    rank 0 samples."""

    def __init__(self, config: EngineConfig, workers: WorkerGroup | None = None) -> None:
        self.config = config
        self.device = config.device
        self.workers: WorkerGroup | None = None  # set once every rank has built its runner (below)
        self.watchdog: StepWatchdog | None = None  # the same
        self.is_first_rank = tp_rank() == 0
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        if self.device.type == "cpu":  # tensor-parallel ranks share the cores
            torch.set_num_threads(config.cpu_threads_per_rank)
        elif self.device.index is not None:  # Triton launches on the current device: a data-parallel
            torch.cuda.set_device(self.device)  # replica's rank 0 is not on cuda:0 ("cuda" alone: the current one)
        self.model = load_model(config.model, self.device, config.seed)
        if self.device.type == "cpu" and config.compilation.level == 0:
            fuse_decoder_layers(self.model, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedKVLayer)]
        # Linear-attention layers (hybrid models): a state per running request, in state slots.
        self.state_layers = [m for m in self.model.modules() if isinstance(m, RecurrentStateLayer)]
        self.num_state_slots = config.scheduler.max_num_seqs if self.state_layers else 0
        if config.compilation.level > 0 and (self.state_layers or
                                             not all(isinstance(a, Attention) for a in self.attention_layers)):
            kind = "linear attention (Qwen3-Next, Qwen3.5)" if self.state_layers else \
                "multi-head latent attention (DeepSeek)"
            raise ValueError(f"compilation_level={config.compilation.level} is not supported with {kind} yet: use "
                             f"compilation_level=0 (the default; decode steps still replay CUDA graphs)")
        self.forward = compile_forward(self.model, config.compilation.level)
        # Image prompts (the Qwen VL models, Qwen3.5): the vision tower's runs and outputs (on rank 0).
        self.images = self._image_encoder() if getattr(self.model, "accepts_images", False) else None
        logger.info("compilation level %d: %s", config.compilation.level, LEVEL_NAMES[config.compilation.level])
        self.sampler = Sampler(self.device, config.seed)
        self.step_masks = StepMasks(self.vocab_size, self.device)  # structured outputs' logits masks
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.proposer, self.rejection_sampler = None, None
        # Drafting over several ranks (a sharded draft): rank 0 tells the others whom to draft for.
        self.propose_sender: ProposeSender | None = None
        self.propose_receiver: ProposeReceiver | None = None
        if config.speculative is not None:
            # A draft with weights is sharded like the target: every rank runs its forward passes.
            # n-gram lookup has none: rank 0 alone proposes.
            if self.is_first_rank or config.speculative.method != "ngram":
                self.proposer = build_proposer(config, self.max_blocks_per_seq, self.model)
                self.attention_layers += self.proposer.attention_layers  # the draft's caches share the block ids
            if self.is_first_rank:
                self.rejection_sampler = RejectionSampler(self.device, config.seed)
            if tp_world_size() > 1 and config.speculative.method != "ngram":
                if self.is_first_rank:
                    self.propose_sender = ProposeSender()
                else:
                    self.propose_receiver = ProposeReceiver()
        self.graph_runner: CUDAGraphRunner | None = None  # captured once the KV cache exists
        self.piecewise_runner: PiecewiseGraphRunner | None = None
        self.last_launch = LaunchedStep([])  # the step whose samples may be pending inputs
        # The last sampling batch built, and the requests it was built for (see _sampling_batch).
        self._last_sampling: tuple[list[Request], SamplingBatch] | None = None
        # A verification's most tokens (drafts + the last token): what a slot's pending blocks hold.
        self.pending_tokens = config.speculative.num_speculative_tokens + 1 if config.speculative else 0
        for layer in self.state_layers:  # allocated first: the KV cache gets what they leave
            layer.bind_states(self.num_state_slots, self.device, self.pending_tokens)
        self.num_blocks = choose_num_blocks(config, self)
        self.bind_kv_cache(self.num_blocks)
        self.graph_runner, self.piecewise_runner = self.capture_cuda_graphs(
            self.cuda_graph_sizes(), self.piecewise_graph_sizes())
        # Until here every rank ran the same profiling and capture steps on its own; from now
        # on rank 0 plans each step and the workers run its plans.
        self.workers = workers
        # Rank 0 of an engine whose steps wait for other GPUs gives up on a step that hangs.
        multi_gpu = self.device.type == "cuda" and (workers is not None or config.parallel.data_parallel_attention)
        self.watchdog = StepWatchdog(config.parallel.watchdog_timeout_s, workers) if multi_gpu else None

    def cuda_graph_sizes(self) -> list[int]:
        """The decode batch sizes to capture (empty: no CUDA graphs)."""
        compilation = self.config.compilation
        if not uses_cuda_graphs(compilation.level, self.device, compilation.enforce_eager):
            return []
        unsafe = sorted({f"{type(a).__name__} ({a.backend.name})" for a in self.attention_layers
                         if not a.cuda_graph_safe} |
                        {f"{type(a).__name__} ({a.conv.name}, {a.rule.name})" for a in self.state_layers
                         if not a.cuda_graph_safe})
        if unsafe:
            logger.info("CUDA graphs off: attention layers %s cannot be captured", unsafe)
            return []
        largest = self.config.scheduler.max_num_seqs
        if self.config.speculative is not None:  # verification runs k + 1 decodes per request
            largest = max(largest, min(largest * (1 + self.config.speculative.num_speculative_tokens),
                                       MAX_VERIFY_GRAPH_TOKENS))
        return sorted(set(compilation.cuda_graph_sizes or default_capture_sizes(largest)))

    def piecewise_graph_sizes(self) -> list[int]:
        """The token-count buckets of steps with prefill chunks to capture (empty: they run eagerly).
        Only at compilation level 0: compiled forwards call attention through the custom op."""
        compilation = self.config.compilation
        if (not compilation.piecewise_cuda_graphs or compilation.level != 0
                or not uses_cuda_graphs(compilation.level, self.device, compilation.enforce_eager)):
            return []
        if not all(isinstance(a, Attention) for a in self.attention_layers) or self.state_layers:
            logger.info("piecewise CUDA graphs off: they cut the forward pass at standard attention layers only")
            return []
        if self.config.parallel.data_parallel_attention:
            logger.info("piecewise CUDA graphs off: with DP attention a prefill step's MoE rows are agreed per step")
            return []
        if self.config.speculative is not None and self.config.speculative.method == "eagle3":
            logger.info("piecewise CUDA graphs off: EAGLE-3 reads hidden states from inside the forward pass")
            return []
        return default_piecewise_sizes(self.config.scheduler.max_num_batched_tokens)

    def capture_cuda_graphs(self, decode_sizes: list[int],
                            piecewise_sizes: list[int]) -> tuple[CUDAGraphRunner | None, PiecewiseGraphRunner | None]:
        """Capture decode graphs and piecewise graphs of these sizes over the KV cache bound now."""
        decode = piecewise = None
        if decode_sizes:
            features = getattr(self.proposer, "target_features", None)
            lm_head = self.model.lm_head
            decode = CUDAGraphRunner(self.forward, lm_head.local_logits_into, lm_head.rows_per_rank,
                                     self.config.model.dtype, decode_sizes, self.max_blocks_per_seq, self.device,
                                     features, self.proposer.features_dim if features else 0)
            if self.state_layers:
                decode.set_recurrent(max(self.pending_tokens, 1), with_drafts=bool(self.pending_tokens))
            decode.capture()
            if hasattr(self.proposer, "capture_cuda_graphs"):  # a draft model: its steps are decodes too
                self.proposer.capture_cuda_graphs(CUDAGraphRunner, decode_sizes)
        if piecewise_sizes:
            piecewise = PiecewiseGraphRunner(self.model, piecewise_sizes, self.config.model.max_model_len,
                                             self.max_blocks_per_seq, self.device)
            piecewise.capture()
        return decode, piecewise

    def release_cuda_graphs(self) -> None:
        """Free every captured graph, after the device has finished with them: a rank of a
        multi-GPU engine calls this before it leaves the process group (see
        CUDAGraphRunner.release); the runner cannot step afterwards."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for runner in (self.graph_runner, self.piecewise_runner):
            if runner is not None:
                runner.release()
        self.graph_runner = self.piecewise_runner = None

    def kv_bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.config.cache.kv_cache_dtype).element_size()
        return sum(math.prod(a.cache_shape(1, self.block_size)) * itemsize for a in self.attention_layers)

    def bind_kv_cache(self, num_blocks: int | None) -> None:
        """Give every attention layer its cache of `cache_shape(num_blocks, block_size)` (for
        standard attention [2, num_blocks, block_size, kv_heads, head_dim], for MLA [num_blocks,
        block_size, kv_lora_rank + rope_dim]) in the cache dtype (the model's, or float8_e4m3fn)
        (None: take the caches away)."""
        dtype = self.config.cache.kv_cache_dtype
        fp8 = dtype == torch.float8_e4m3fn  # allocated as bytes: not every device has float8 fill kernels
        if fp8 and num_blocks is not None and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            if capability < (8, 9):  # Triton's float8e4nv conversions need sm_89+
                raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer "
                                 f"(this one is {capability[0]}.{capability[1]})")
        for layer in self.attention_layers:
            layer.kv_cache = None if num_blocks is None else torch.zeros(
                layer.cache_shape(num_blocks, self.block_size),
                dtype=torch.uint8 if fp8 else dtype, device=self.device).view(dtype)

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, scheduled: list[tuple[Request, int]], dp_step: DPStep | None = None) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device and return without waiting.

        A request whose last token is still pending (sampled by the previous launch, not yet
        known on the host) reads it from that launch's device tensor, so the next step can be
        prepared while the previous one runs. With tensor parallelism the plan goes to the other
        ranks first, which run the same forward pass. With DP attention `dp_step` says how this
        step meets the other replicas' (an empty `scheduled`: a forward pass of padding only,
        whose MoE layers serve the other replicas' tokens)."""
        if not scheduled and dp_step is not None:
            self.last_launch.complete()  # queued before this step, as any launch's (see _upload)
            return self._launch_padding(dp_step)
        images = self.images.step(scheduled) if self.images is not None else None
        plan, sampling = self._plan(scheduled, images)
        if self.workers is not None:
            self.workers.send_step(plan.encode())
            if images is not None:
                self.images.share(images)
        return self._launch(plan, scheduled, sampling, dp_step, images)

    def dp_graph_size(self, num_seqs: int) -> int | None:
        """The decode graph a DP-attention step of at most num_seqs decodes per replica replays
        on every replica (None: no graph that large, or no graphs)."""
        return self.graph_runner.padded_size(max(num_seqs, 1)) if self.graph_runner is not None else None

    def _launch_padding(self, dp_step: DPStep) -> LaunchedStep:
        """DP attention, a replica with nothing scheduled: replay the agreed decode graph with
        padding rows only, or run one padding token (stored nowhere) eagerly."""
        if dp_step.graph_size is not None:
            no_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
            self.graph_runner.run(no_ids, no_ids, padding_metadata(0, self.block_size, self.device),
                                  size=dp_step.graph_size)
        else:
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
            with forward_context(padding_metadata(1, self.block_size, self.device), dp_step.padded_tokens):
                self.forward(token, token)
        step = LaunchedStep([])
        step.finish_launch(self.device)
        return step  # not the last launch: its samples feed nothing

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """A rank > 0 runs rank 0's plan: the forward pass, its share of the LM head, and it
        receives the ids rank 0 samples (and first, in a step of image prompts, its vision inputs)."""
        images = self.images.receive(plan.image_step, len(plan.input_ids)) if plan.image_step is not None else None
        self._launch(plan, None, None, images=images)

    def _launch(self, plan: StepPlan, scheduled: list[tuple[Request, int]] | None,
                sampling: _Sampling | None, dp_step: DPStep | None = None,
                images: MultiModalStep | None = None) -> LaunchedStep:
        """images: the step's image-prompt inputs (it then runs eagerly)."""
        batch = self._upload(plan)
        rows = plan.logit_rows
        sampling_ids = [r.request_id for r in sampling.sampling_requests] if self.is_first_rank else []
        step = LaunchedStep(sampling_ids, self.watchdog)
        observe = getattr(self.proposer, "observe", None)  # a draft that reads the target's hidden states
        # The decode graph this step replays (None: it runs eagerly); with DP attention the agreed one.
        graph_size = dp_step.graph_size if dp_step is not None else \
            self.graph_runner.padded_size(batch.metadata.num_seqs) if images is None and self._can_replay(batch) else None
        greedy_ids = None  # [num_sampling]: an argmax-only step's tokens, found on every rank
        if graph_size is not None:
            # The graph computes every row's logits, this rank's vocabulary slice [num_seqs, vocab /
            # tp] in the model's dtype; a decode step usually samples every row.
            local = self.graph_runner.run(batch.input_ids, batch.positions, batch.metadata, size=graph_size)
            local = local if len(rows) == batch.metadata.num_seqs else local[self._index(rows)]
            if plan.argmax_only:
                greedy_ids = self.model.lm_head.argmax(local)
            else:
                logits = self.model.lm_head.gather_logits(local)  # [rows, vocab] float32
            if observe is not None:
                observe(scheduled, batch.query_start, self.graph_runner.features[:batch.metadata.num_tokens])
        else:
            if images is None and self.piecewise_runner is not None and \
                    self.piecewise_runner.padded_size(batch.metadata.num_tokens):
                hidden = self.piecewise_runner.run(batch.input_ids, batch.positions, batch.metadata)
            else:
                with forward_context(batch.metadata, dp_step and dp_step.padded_tokens), multimodal_context(images):
                    hidden = self.forward(batch.input_ids, batch.positions)  # [num_tokens, hidden]
            if plan.argmax_only:
                lm_head = self.model.lm_head
                greedy_ids = lm_head.argmax(lm_head.local_logits(hidden[self._index(rows)]))
            else:
                logits = self.model.compute_logits(hidden[self._index(rows)]) if len(rows) else None  # [rows, vocab]
            if observe is not None:
                observe(scheduled, batch.query_start, self.proposer.target_features(hidden))
        previous, self.last_launch = self.last_launch, step
        if greedy_ids is not None:  # every rank has the tokens: nothing to sample or broadcast
            step.sampled_device = greedy_ids
            if self.is_first_rank:
                step.copy_to_host("sampled", greedy_ids)
            step.finish_launch(self.device)
            return step
        num_sampled = plan.num_sampled_rows
        if not self.is_first_rank:
            if plan.num_sampling:  # what rank 0 samples: the next step's pending inputs
                step.sampled_device = broadcast_from_first(
                    torch.empty(plan.num_sampling, dtype=torch.int64, device=self.device))
            step.finish_launch(self.device)
            return step
        if len(rows) > num_sampled:
            self._prompt_logprobs(logits[num_sampled:], sampling.prompt_logprob_spans, step)
        if not num_sampled:
            step.finish_launch(self.device)
        elif self.rejection_sampler is not None:
            self._verify(logits[:num_sampled], sampling, step, previous)
            self._share_and_finish(step)
        else:
            requests = sampling.sampling_requests
            sampling_batch = self._sampling_batch(requests, previous)  # as the requests stand at launch
            # Structured outputs: the masks fill in the background, and the sampling waits until
            # the engine needs this step (`LaunchedStep.complete`), having processed the previous
            # step's outputs, scheduled the next step and packed its inputs meanwhile.
            mask = self.step_masks.begin(requests, range(len(requests)), previous.pending_tokens,
                                         in_background=True)
            finish = functools.partial(self._sample, logits[:num_sampled], requests, sampling_batch, step, mask)
            if mask is None:
                finish()
            else:
                step.defer(finish)
        return step

    def _share_and_finish(self, step: LaunchedStep) -> None:
        """The sampled ids to the other ranks (they are their next step's inputs too), then the
        event that says the step is done."""
        if tp_world_size() > 1:
            broadcast_from_first(step.sampled_device)
        step.finish_launch(self.device)

    def _index(self, rows) -> torch.Tensor:
        return to_device(torch.from_numpy(np.asarray(rows, dtype=np.int64)), self.device)

    def execute(self, scheduled: list[tuple[Request, int]]) -> ModelRunnerOutput:
        """launch() and wait for its result."""
        return self.launch(scheduled).result()

    def _can_replay(self, batch: _Batch) -> bool:
        """A decode-only step (one token per sequence) small enough for a captured graph."""
        md = batch.metadata
        return (self.graph_runner is not None and md.num_tokens == md.num_seqs
                and self.graph_runner.padded_size(md.num_seqs) is not None)

    def _plan(self, scheduled: list[tuple[Request, int]], images: MultiModalStep | None
              ) -> tuple[StepPlan, _Sampling]:
        """The step's inputs as host arrays, and who samples from which rows."""
        num_seqs = len(scheduled)
        num_new_list = [n for _, n in scheduled]
        computed_list = [r.num_computed_tokens for r, _ in scheduled]
        num_new = np.array(num_new_list, dtype=np.int64).reshape(num_seqs)
        computed = np.array(computed_list, dtype=np.int64).reshape(num_seqs)
        block_tables = _block_tables([r.block_ids for r, _ in scheduled])  # [num_seqs, width]
        starts = [0, *itertools.accumulate(num_new_list)]  # query_start as Python ints
        input_ids = np.zeros(starts[-1], dtype=np.int64)  # [num_tokens]
        sample_rows, sampling_requests, num_drafts, spans = [], [], [], []
        pending_index, pending_source = [], []  # token index <- row of the last launch's samples
        last_rows = self.last_launch.row_of
        for (request, n), start, c in zip(scheduled, starts, computed_list):
            drafts = request.spec_token_ids  # scheduled after the request's last token
            num_known = n - len(drafts)
            known = request.all_token_ids[c:c + num_known]
            if known:
                input_ids[start:start + len(known)] = known
            if drafts:
                input_ids[start + num_known:start + n] = drafts
            if len(known) < num_known:  # the token before the drafts is the one the previous launch sampled
                pending_index.append(start + num_known - 1)
                pending_source.append(last_rows[request.request_id])
            if c + num_known == request.num_tokens:  # its next token(s) are sampled
                sample_rows.extend(range(start + num_known - 1, start + n))
                sampling_requests.append(request)
                num_drafts.append(len(drafts))
            if request.sampling_params.prompt_logprobs is not None and c < request.num_prompt_tokens - 1:
                spans.append((request, start, min(c + n, request.num_prompt_tokens - 1) - c))
        # A step of decodes with drafts runs as one decode per token (see build_metadata).
        per_token = any(num_drafts) and len(sampling_requests) == num_seqs and \
            all(n == d + 1 for n, d in zip(num_new_list, num_drafts))
        logit_rows = list(sample_rows)
        for _, start, count in spans:
            logit_rows.extend(range(start, start + count))
        argmax_only = (bool(sampling_requests) and not spans and self.rejection_sampler is None
                       and self.vocab_size < vocab_argmax.MAX_VOCAB
                       and all(_takes_argmax(r) for r in sampling_requests))
        state_slots = np.array([r.state_slot for r, _ in scheduled], dtype=np.int32).reshape(num_seqs)
        drafts = _draft_rows(scheduled, computed_list) if self.state_layers and self.pending_tokens else \
            np.zeros((3, 0), dtype=np.int32)
        plan = StepPlan(input_ids=input_ids, num_computed=computed, num_new=num_new, block_tables=block_tables,
                        state_slots=state_slots, drafts=drafts,
                        rope_positions=rope_positions(scheduled) if self.images is not None else _NO_POSITIONS,
                        pending_index=np.array(pending_index, dtype=np.int64),
                        pending_source=np.array(pending_source, dtype=np.int64),
                        logit_rows=np.array(logit_rows, dtype=np.int64), num_sampled_rows=len(sample_rows),
                        num_sampling=len(sampling_requests), per_token=per_token, argmax_only=argmax_only,
                        image_step=ImageEncoder.shape(images))
        return plan, _Sampling(sample_rows, sampling_requests, num_drafts, spans)

    def _upload(self, plan: StepPlan) -> _Batch:
        """The plan's tensors on the device, pending tokens read from the last launch's samples."""
        layout = batch_layout(plan.block_tables, plan.num_computed, plan.num_new, self.block_size)
        host = host_metadata(layout, plan.block_tables, plan.per_token,
                             plan.state_slots if self.state_layers else None,
                             plan.drafts if self.state_layers and self.pending_tokens else None)
        arrays = host.arrays()
        input_ids, positions, pending_source, pending_index, *on_device = to_device_many(
            [plan.input_ids, plan.rope_positions if len(plan.rope_positions) else layout.positions, plan.pending_source, plan.pending_index, *arrays], self.device)
        # The last launch's samples may be this step's inputs: what it deferred (a structured-output
        # step's sampling, which waits for its masks) is queued now, so that its masks had this
        # step's planning to fill in, and before anything of this step reads the samples.
        self.last_launch.complete()
        if len(plan.pending_index):  # (index_copy_ / index_select: far less host time than tensor indexing)
            input_ids.index_copy_(0, pending_index, self.last_launch.sampled_device.index_select(0, pending_source))
        return _Batch(input_ids=input_ids, positions=positions, metadata=host.on_device(on_device),
                      query_start=layout.query_start)

    def _sample(self, logits: torch.Tensor, requests: list[Request], batch: SamplingBatch, step: LaunchedStep,
                mask: PendingMask | None) -> None:
        if mask is not None:
            self.step_masks.apply(mask, logits)
        result = self.sampler(logits, batch)
        step.sampled_device = result.sampled
        step.copy_to_host("sampled", result.sampled)
        step.keep_logprobs(requests, result)
        self._share_and_finish(step)

    def propose(self, requests: list[Request]) -> None:
        """requests: the running ones. Draft the tokens each decoding request's next step verifies
        (speculative decoding),
        into request.spec_token_ids; none where the draft cannot count: penalties and min_tokens
        change each position's distribution with the tokens before it. A request whose last
        token is still pending (steps overlapping, n-gram lookup only) gets the proposal for the
        tokens known so far minus its first token, the guess for the pending one; verification
        keeps the output exact whatever the guess."""
        k = self.config.speculative.num_speculative_tokens
        max_drafts, lags = [], []
        for r in requests:
            room = min(k, r.max_tokens - r.num_output_tokens - r.num_pending_tokens - 1)
            lag = r.num_pending_tokens
            decoding = r.num_tokens - r.num_computed_tokens == 1
            max_drafts.append(room + lag if decoding and room > 0 and not _position_dependent(r) else 0)
            lags.append(lag)
        # A draft that reads the target's hidden states catches up on every step, drafting or not;
        # one with experts under DP attention meets the other replicas' draft passes every round.
        if not any(max_drafts) and not hasattr(self.proposer, "observe") and \
                not getattr(self.proposer, "meets_replicas", False):
            for request in requests:
                request.spec_token_ids = []
            return
        sampling = build_sampling_batch(requests, self.vocab_size, self.device) if self.proposer.samples else None
        if self.propose_sender is not None and self.workers is not None:
            rows = getattr(self.proposer, "rows", {})
            self.workers.send_propose(self.propose_sender.plan(requests, max_drafts, rows).encode())
        for request, drafts, lag in zip(requests, self.proposer.propose(requests, max_drafts, sampling), lags):
            request.spec_token_ids = drafts[lag:]

    def run_propose(self, plan: ProposePlan) -> None:
        """A rank > 0 drafts with rank 0 (its share of every draft forward pass); the drafts
        rank 0 samples arrive over the device."""
        requests, forgotten = self.propose_receiver.apply(plan)
        for request_id in forgotten:
            self.proposer.forget(request_id)
        if hasattr(self.proposer, "rows"):
            self.proposer.rows = {request_id: tuple(value) for request_id, value in plan.rows.items()}
        self.proposer.propose(requests, plan.max_drafts, None)

    def _image_encoder(self) -> ImageEncoder:
        """The vision tower's runner: its calls hold up to a step's token budget of images, or the
        largest image the checkpoint's processor makes (its tokens up to max_model_len)."""
        largest = largest_image_tokens(self.config.model.model_path) if self.is_first_rank else None
        largest = min(largest or 0, self.config.model.max_model_len)
        budget = max(self.config.scheduler.max_num_batched_tokens, largest)
        return ImageEncoder(self.model, self.device, self.config.model.dtype, budget, largest or budget)

    @torch.inference_mode()
    def profile_images(self) -> None:
        """Run the vision tower's largest call once (rank 0: the only one that runs it), so that
        the memory sizing counts its activations."""
        if self.images is not None and self.is_first_rank:
            self.images.profile()

    @torch.inference_mode()
    def profile_verify_sampling(self) -> torch.Tensor | None:
        """Run the rejection sampler once on the largest verification a step can hold, every row
        sampling with top-k / top-p and model-draft probabilities, so that the memory sizing
        counts its [rows, vocab] temporaries. Returns the tokens each profiled request emitted."""
        if self.rejection_sampler is None:  # a rank > 0 of tensor parallelism: rank 0 samples
            return None
        k, scheduler = self.config.speculative.num_speculative_tokens, self.config.scheduler
        num_requests = max(min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens // (k + 1)), 1)
        num_drafts, rows = num_requests * k, num_requests * (k + 1)
        cu_num_drafts = np.arange(0, num_drafts + 1, k, dtype=np.int32)
        logits = torch.zeros(rows, self.vocab_size, device=self.device)
        draft_probs = torch.full((num_drafts, self.vocab_size), 1 / self.vocab_size, device=self.device) \
            if self.proposer.samples else None
        column = lambda value, dtype: torch.full((num_requests,), value, dtype=dtype, device=self.device)  # noqa: E731
        batch = SamplingBatch(temperature=column(1.0, torch.float32), greedy=column(False, torch.bool),
                              all_greedy=False, top_k=column(50, torch.int64), top_p=column(0.9, torch.float32),
                              min_p=None, generators={}, penalties=None, banned=None, num_logprobs=None)
        return self.rejection_sampler(logits, torch.zeros(num_drafts, dtype=torch.int64, device=self.device),
                                      torch.from_numpy(cu_num_drafts).to(self.device), cu_num_drafts, draft_probs,
                                      batch).num_output  # [num_requests]

    def forget(self, request_id: str) -> None:
        """A request ended: the proposer drops its state (the other ranks' with the next plan)."""
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if self.images is not None:
            self.images.forget(request_id)
        if self.propose_sender is not None:
            self.propose_sender.forget(request_id)

    def _sampling_batch(self, requests: list[Request], previous: LaunchedStep):
        """The requests' sampling inputs; penalties count a token still pending on the device
        (sampled by `previous`, the launch before this step).

        Steady decoding samples the same requests, in the same order, step after step: their
        batch is then the last one, unless it has inputs that change with every token (penalties'
        counts; min_tokens' bans, which only lift as outputs grow, so a batch without them stays
        without them)."""
        last = self._last_sampling
        if last is not None and last[1].penalties is None and last[1].banned is None and \
                len(last[0]) == len(requests) and all(a is b for a, b in zip(last[0], requests)):
            return last[1]
        pending = [(i, previous.row_of[r.request_id]) for i, r in enumerate(requests) if r.num_pending_tokens]
        batch = build_sampling_batch(requests, self.vocab_size, self.device, pending,
                                     previous.sampled_device if pending else None)
        self._last_sampling = (list(requests), batch)
        return batch

    def _verify(self, logits: torch.Tensor, batch: _Sampling, step: LaunchedStep, previous: LaunchedStep) -> None:
        """Speculative sampling: accept each request's drafts against its rows' logits
        ([sum(num_drafts + 1), vocab]) and sample the token after the last accepted one."""
        requests = batch.sampling_requests
        cu_num_drafts = np.zeros(len(requests) + 1, dtype=np.int32)
        np.cumsum(batch.num_drafts, out=cu_num_drafts[1:])
        drafts = [t for r in requests for t in r.spec_token_ids]
        draft_ids = to_device(torch.tensor(drafts, dtype=torch.int64), self.device)
        draft_probs = self.proposer.draft_probs(requests, batch.num_drafts, self.vocab_size) if drafts else None
        # A constrained request verifies no drafts (see _position_dependent): its one row.
        mask = self.step_masks.begin(requests, (cu_num_drafts[:-1] + np.arange(len(requests))).tolist(),
                                     previous.pending_tokens, in_background=False)
        if mask is not None:
            self.step_masks.apply(mask, logits)
        sampling = self._sampling_batch(requests, previous)
        result = self.rejection_sampler(logits, draft_ids, to_device(torch.from_numpy(cu_num_drafts), self.device),
                                        cu_num_drafts, draft_probs, sampling)
        step.cu_num_drafts = cu_num_drafts
        # Each request's last token: the next launch's input when steps overlap.
        step.sampled_device = result.output_token_ids.gather(1, (result.num_output.long() - 1).unsqueeze(1)).squeeze(1)
        step.copy_to_host("verified", result.output_token_ids)
        step.copy_to_host("num_verified", result.num_output)
        step.keep_logprobs(requests, result)

    def _prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[Request, int, int]],
                         step: LaunchedStep) -> None:
        """Logprob of each next prompt token (plus the top-k) at the chunk's prompt positions."""
        offset = 0
        for request, start, count in spans:
            k = request.sampling_params.prompt_logprobs
            logprobs = logits[offset:offset + count].log_softmax(dim=-1)  # [count, vocab]
            offset += count
            first = request.num_computed_tokens + 1  # prompt index of the token predicted by row 0
            actual = to_device(torch.tensor(request.prompt_token_ids[first:first + count]), self.device).unsqueeze(1)
            actual_logprob = logprobs.gather(1, actual)
            ranks = (logprobs > actual_logprob).sum(dim=-1) + 1
            top_values, top_ids = logprobs.topk(k, dim=-1)
            name = f"prompt:{request.request_id}"
            step.copy_to_host(name + ":ids", torch.cat((actual, top_ids), dim=1))
            step.copy_to_host(name + ":values", torch.cat((actual_logprob, top_values), dim=1))
            step.copy_to_host(name + ":ranks", ranks)
            step.prompt_logprob_requests.append((request.request_id, request.num_computed_tokens))


_NO_POSITIONS = np.zeros(0, dtype=np.int64)  # a step whose RoPE positions are its cache positions


def _block_tables(block_ids: list[list[int]]) -> np.ndarray:
    """[num_seqs, longest] int32: row i holds block_ids[i], zero-padded."""
    lengths = np.array([len(ids) for ids in block_ids], dtype=np.int64).reshape(len(block_ids))
    tables = np.zeros((len(block_ids), int(lengths.max(initial=0))), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), dtype=np.int32, count=int(lengths.sum()))
    return tables


def _takes_argmax(request: Request) -> bool:
    """Whether the request's next token is the argmax of its raw logits: greedy, without
    logprobs, penalties, a grammar or min_tokens still to reach."""
    params = request.sampling_params
    return params.is_greedy and params.logprobs is None and not _position_dependent(request)


def _draft_rows(scheduled: list[tuple[Request, int]], computed: list[int]) -> np.ndarray:
    """[3, num_seqs] int32: a hybrid model's DraftRows for the step (speculative decoding). A
    request commits the tokens of its last verification that it kept (those now computed), and a
    request with drafts records its tokens in its slot's other pending block."""
    rows = np.zeros((3, len(scheduled)), dtype=np.int32)
    rows[1:] = -1
    for i, ((request, n), c) in enumerate(zip(scheduled, computed)):
        half = 0
        if request.pending_drafts is not None:
            block, position, count = request.pending_drafts
            if not position < c <= position + count:
                raise AssertionError(f"request {request.request_id}: {c} tokens computed, but its last verification "
                                     f"recorded positions {position}..{position + count - 1}")
            rows[0, i], rows[1, i], half = c - position, block, 1 - block % 2
        if request.spec_token_ids:
            rows[2, i] = 2 * request.state_slot + half
            request.pending_drafts = (int(rows[2, i]), c, n)
        else:
            request.pending_drafts = None
    return rows


def _position_dependent(request: Request) -> bool:
    """Whether each position's distribution depends on the tokens before it in a way drafts
    cannot follow (penalties, min_tokens, a grammar): such a request drafts nothing."""
    params = request.sampling_params
    return request.grammar is not None or bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        or request.num_output_tokens < params.min_tokens)


class LaunchedStep:
    """A step queued on the device: its sampled ids stay on the device (the next step's inputs)
    and are copied to pinned host memory behind an event, so waiting for this step does not wait
    for the steps launched after it.

    With worker processes, waiting polls the event and `health_check` (which raises once a
    worker has died), so a step whose collectives wait for a dead rank fails instead of hanging.

    A step with structured outputs queues its sampling only when first needed (`complete`: the
    next launch, or reading this step's results), so that its masks fill meanwhile.
    """

    def __init__(self, sampling_request_ids: list[str], watchdog: StepWatchdog | None = None) -> None:
        self.request_ids = sampling_request_ids
        self._watchdog = watchdog  # a multi-GPU engine's: waits poll and ask it (dead workers, hangs)
        self.row_of = {rid: i for i, rid in enumerate(sampling_request_ids)}
        self.sampled_device: torch.Tensor | None = None  # [num_sampled] int64
        self.logprob_counts: list[int | None] = []
        self.cu_num_drafts: np.ndarray | None = None  # [num_sampled + 1]: a verification step's drafts
        self.prompt_logprob_requests: list[tuple[str, int]] = []  # (request id, chunk start)
        self._host: dict[str, torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None
        self._sampled: list[int] | None = None  # the host copy of "sampled", once waited for
        self._deferred: Callable[[], None] | None = None  # the rest of the launch, not queued yet

    def defer(self, finish: Callable[[], None]) -> None:
        """Queue the rest of the launch (sampling and the copies of its results) at `complete`."""
        self._deferred = finish

    def complete(self) -> None:
        """Queue what the launch deferred, if anything (once)."""
        if self._deferred is not None:
            finish, self._deferred = self._deferred, None
            with torch.inference_mode():  # as the launch was (its tensors are inference tensors)
                finish()

    def copy_to_host(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._host[name] = host
        else:
            self._host[name] = tensor

    def keep_logprobs(self, requests: list[Request], result) -> None:
        """Copy a sampler's logprobs (SamplerOutput or RejectionSamplerOutput: one row per sampled
        position) to the host, when asked for."""
        if result.logprobs is not None:
            self.logprob_counts = [r.sampling_params.logprobs for r in requests]
            self.copy_to_host("logprob_ids", result.logprob_token_ids)
            self.copy_to_host("logprobs", result.logprobs)
            self.copy_to_host("sampled_rank", result.sampled_rank)

    def finish_launch(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def _wait(self) -> None:
        if self._watchdog is None:
            self._event.synchronize()
            return
        start = last_check = time.monotonic()
        while not self._event.query():
            now = time.monotonic()
            if now - last_check > _WATCH_INTERVAL_S:
                self._watchdog.check(now - start)
                last_check = now
                time.sleep(0)  # let the worker monitor's thread run

    def pending_tokens(self, requests: list[Request]) -> list[int | None]:
        """For each request, the last token this step sampled for it where the request's output
        does not hold that token yet (it is pending: the next step reads it on the device), else
        None; waits for this step if some token is pending."""
        if not any(r.num_pending_tokens for r in requests):
            return [None] * len(requests)
        self.complete()
        if self._sampled is None:
            if self._event is not None:
                self._wait()
            if "sampled" in self._host:
                self._sampled = self._host["sampled"].tolist()
            else:  # a verification: each request's last emitted token
                self._sampled = [tokens[n - 1] for tokens, n in zip(self._host["verified"].tolist(),
                                                                    self._host["num_verified"].tolist())]
        sampled, row_of = self._sampled, self.row_of
        return [sampled[row_of[r.request_id]] if r.num_pending_tokens else None for r in requests]

    def result(self) -> ModelRunnerOutput:
        """Wait for this step (only) and return its sampled tokens and logprobs as Python values."""
        self.complete()
        if self._event is not None:
            self._wait()
        output = ModelRunnerOutput()
        # Row of each request's first sampled token, and how many tokens it got.
        first_row, counts = list(range(len(self.request_ids))), [1] * len(self.request_ids)
        if "sampled" in self._host:
            output.sampled = {rid: [t] for rid, t in zip(self.request_ids, self._host["sampled"].tolist())}
        elif "verified" in self._host:
            counts = self._host["num_verified"].tolist()
            first_row = (self.cu_num_drafts[:-1] + np.arange(len(counts))).tolist()
            output.sampled = {rid: tokens[:n] for rid, tokens, n in
                              zip(self.request_ids, self._host["verified"].tolist(), counts)}
        if "logprobs" in self._host:
            ids, values = self._host["logprob_ids"].tolist(), self._host["logprobs"].tolist()
            ranks = self._host["sampled_rank"].tolist()
            for i, (rid, k) in enumerate(zip(self.request_ids, self.logprob_counts)):
                if k is not None:
                    rows = range(first_row[i], first_row[i] + counts[i])
                    output.logprobs[rid] = [(ids[r][: k + 1], values[r][: k + 1], ranks[r]) for r in rows]
        for rid, start in self.prompt_logprob_requests:
            name = f"prompt:{rid}"
            rows = zip(self._host[name + ":ids"].tolist(), self._host[name + ":values"].tolist(),
                       self._host[name + ":ranks"].tolist())
            output.prompt_logprobs[rid] = list(rows)
            output.prompt_logprobs_start[rid] = start
        return output
