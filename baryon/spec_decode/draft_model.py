"""A smaller model of the same tokenizer drafts the next tokens (vLLM's `method: "draft_model"`).

The draft keeps its own paged KV cache, indexed by the target's block tables (the runner binds
it with the same number of blocks, so a request's blocks hold both models' K/V). Each step:

1. catch up: the draft runs over the request's tokens it has not seen (its prompt on the first
   step, then the drafts the target accepted plus the target's new token), in chunks of at most
   `max_num_batched_tokens`; the logits after the last token give the first draft;
2. then one token at a time, each draft the input of the next, up to max_drafts tokens. These
   steps write K/V past the verified tokens, into the lookahead slots the scheduler reserved;
   the next catch-up rewrites from the first token the target had not verified.

Greedy requests draft greedily; sampling requests draw from the draft's distribution after
temperature / top-k / top-p / min-p, which is kept for the rejection rule. A preempted request
lost its blocks, so the draft starts over with it. With tensor parallelism the draft is sharded
like the target and every rank runs this code on the requests rank 0 sends it
(runner/propose_plan.py); rank 0 draws the drafts and the others receive them. With DP
attention a draft with experts divides them among the replicas as the target does, so every
replica runs each of a propose's forward passes with the others: they agree first on the rows of
each pass (one host all-gather), and a replica with none in a pass runs it on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baryon.config import EngineConfig
from baryon.distributed.parallel_state import broadcast_from_first, dp_all_gather_host, dp_world_size, tp_rank
from baryon.kernels.attention.metadata import batch_layout, build_metadata, padding_metadata
from baryon.kernels.selector import select
from baryon.layers.attention import PagedKVLayer
from baryon.layers.forward_context import DPStep, forward_context
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.sampler import SamplingBatch, sampling_probs
from baryon.loader.model_loader import load_model
from baryon.request import Request
from baryon.transfer import to_device


@dataclass
class CatchUp:
    """A propose's first forward pass: for each request listed, the tokens whose draft K/V it
    writes (a draft model: those it has not run yet; a draft on the target's hidden states: those
    the target kept this step, with the target's features)."""

    requests: list[Request]
    computed: np.ndarray  # [len(requests)] int64: each one's tokens before its rows
    num_new: np.ndarray  # [len(requests)] int64
    input_ids: np.ndarray  # [num_rows] int64
    last_rows: np.ndarray  # [len(ready)]: each request drafting after it, as an index into `requests`
    ready: list[int]  # the propose's requests (indices) that draft after it
    features: torch.Tensor | None = None  # [num_rows, features]: the target's, per row (hidden-state drafts)

    @property
    def num_rows(self) -> int:
        return int(self.num_new.sum())


class DraftModelProposer:
    samples = True  # drafts for sampling requests are drawn with their parameters

    def __init__(self, config: EngineConfig, max_blocks_per_seq: int) -> None:
        spec = config.speculative
        self.device = config.device
        self.model = load_model(spec.draft, self.device, config.seed)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedKVLayer)]
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.chunk_tokens = config.scheduler.max_num_batched_tokens
        self.dtype = spec.draft.dtype
        # The draft's decode CUDA graphs (forward + LM head), set by the model runner on a GPU.
        self.graph_runner = None
        self.sampling_kernel = select("sampling", self.device)
        self.generator = torch.Generator(self.device).manual_seed(config.seed + 1)
        # request id -> (tokens whose draft K/V are cached, the request's preemption count then)
        self.num_computed: dict[str, tuple[int, int]] = {}
        self.probs: dict[str, torch.Tensor] = {}  # request id -> [num drafts, vocab]: sampling requests
        # DP attention and a draft with experts: every replica runs each draft forward pass with
        # the others (their MoE layers exchange rows), on padding where it has no rows of its own.
        self.meets_replicas = dp_world_size() > 1 and any(isinstance(m, FusedMoE) for m in self.model.modules())
        self.num_speculative_tokens = spec.num_speculative_tokens  # a propose's forward passes, at most
        self._rounds: list[DPStep | None] = []  # this propose's agreed passes, by depth (0: the catch-up)

    def forget(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)
        self.probs.pop(request_id, None)

    def draft_probs(self, requests: list[Request], num_drafts: list[int], vocab_size: int) -> torch.Tensor | None:
        if not any(r.request_id in self.probs for r, n in zip(requests, num_drafts) if n):
            return None  # every request drafted greedily: the rule reads no probabilities
        rows = []
        for request, n in zip(requests, num_drafts):
            probs = self.probs.get(request.request_id)
            if probs is None:  # a greedy request: its rows are not read
                probs = torch.zeros(n, vocab_size, device=self.device)
            rows.append(probs[:n])
        return torch.cat(rows)

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_drafts: list[int], sampling: SamplingBatch) -> list[list[int]]:
        for request in requests:
            self.probs.pop(request.request_id, None)
        drafts: list[list[int]] = [[] for _ in requests]
        catch_up = self._plan_catch_up(requests, [i for i, m in enumerate(max_drafts) if m > 0])
        alive = catch_up.ready if catch_up is not None else []  # the requests drafting now
        # Rows of each forward pass this call runs: the catch-up, then per depth the requests drafting that far.
        rows = [catch_up.num_rows if catch_up is not None else 0]
        rows += [sum(max_drafts[i] > depth for i in alive) for depth in range(1, max(max_drafts[i] for i in alive))] \
            if alive else []
        self._rounds = self._agree_with_replicas(rows) if self.meets_replicas else []
        if catch_up is not None:
            logits = self._run_catch_up(catch_up)  # [len(alive), vocab]
            if alive:
                self._draft_depths(requests, max_drafts, sampling, alive, logits, drafts)
        self._pad_rounds(sum(n > 0 for n in rows))
        return drafts

    def _draft_depths(self, requests: list[Request], max_drafts: list[int], sampling: SamplingBatch,
                      alive: list[int], logits: torch.Tensor, drafts: list[list[int]]) -> None:
        """From the catch-up's logits of the `alive` requests, draw their drafts depth by depth
        (each the next depth's input) into `drafts`, and keep the sampling requests' distributions."""
        batch = _select_rows(sampling, alive, [requests[i] for i in alive], self.device)
        columns: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (alive, tokens, probs)
        tokens = torch.empty(0)
        for depth in range(max(max_drafts[i] for i in alive)):
            if depth:
                keep = [j for j, i in enumerate(alive) if max_drafts[i] > depth]
                if len(keep) < len(alive):
                    alive = [alive[j] for j in keep]
                    index = to_device(torch.tensor(keep), self.device)
                    tokens = tokens[index]
                    self._narrow(index)
                    batch = _select_rows(batch, keep, [requests[i] for i in alive], self.device)
                logits = self._decode([requests[i] for i in alive], tokens, depth)
            tokens, probs = self._draw(logits, batch)
            columns.append((alive, tokens, probs))
        for alive, tokens, probs in columns:
            for i, token in zip(alive, tokens.tolist()):
                drafts[i].append(token)
        row_of = [{i: j for j, i in enumerate(rows)} for rows, _, _ in columns]  # per depth: request -> row
        for i, request in enumerate(requests):
            if max_drafts[i] and not request.sampling_params.is_greedy and tp_rank() == 0:  # rank 0 verifies
                self.probs[request.request_id] = torch.stack(
                    [probs[row_of[depth][i]] for depth, (_, _, probs) in enumerate(columns[:max_drafts[i]])])

    # -- DP attention: a draft with experts runs its forward passes with the other replicas -------

    def _agree_with_replicas(self, rows: list[int]) -> list[DPStep | None]:
        """rows: this replica's rows in each forward pass of this propose (a prefix of nonzero
        counts) -> the passes every replica runs, in order: each padded to the largest replica's
        rows, on the CUDA graph of that size where one is captured (None: no replica runs it)."""
        counts = rows + [0] * (self.num_speculative_tokens - len(rows))  # the same length on every replica
        agreed = [max(column) for column in zip(*dp_all_gather_host(counts))]
        return [DPStep(n, self._graph_size(n, 0)) if n else None for n in agreed]

    def _agreed(self, depth: int) -> DPStep | None:
        """The agreed forward pass at this depth (0: the catch-up); None without DP attention."""
        return self._rounds[depth] if self._rounds else None

    def _pad_rounds(self, first: int) -> None:
        """The agreed forward passes from `first` on, which this replica has no rows for: padding
        only, so that the other replicas' rows reach this replica's experts."""
        for depth, agreed in enumerate(self._rounds[first:], first):
            if agreed is None:
                break
            runner = self._graph_runner(depth)
            if agreed.graph_size is not None:
                no_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
                runner.run(no_ids, no_ids, padding_metadata(0, self.block_size, self.device), size=agreed.graph_size)
            else:
                token = torch.zeros(1, dtype=torch.int64, device=self.device)
                with forward_context(padding_metadata(1, self.block_size, self.device), agreed.padded_tokens):
                    self._padding_forward(token, depth)

    def _padding_forward(self, token: torch.Tensor, depth: int) -> None:
        """The draft's forward pass of depth `depth` over one padding token (token: its id and position)."""
        self.model(token, token)

    def _graph_runner(self, depth: int):
        """The CUDA graphs the forward pass of this depth replays (None: none captured)."""
        return self.graph_runner

    def _graph_size(self, num_rows: int, depth: int) -> int | None:
        """The captured graph a forward pass of num_rows rows at this depth replays (None: eager)."""
        runner = self._graph_runner(depth)
        return runner.padded_size(num_rows) if runner is not None else None

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next draft of each row [rows]: argmax (greedy rows) or a draw from the processed
        distribution [rows, vocab], returned too when a row samples. With tensor parallelism rank
        0 draws and the others receive its drafts (batch None there)."""
        if tp_rank() > 0:
            return broadcast_from_first(torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)), None
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return broadcast_from_first(greedy), None
        q = sampling_probs(self.sampling_kernel, logits, batch)
        q = q / q.sum(dim=-1, keepdim=True)  # [rows, vocab]: kept for the rejection rule
        noise = torch.empty_like(q).exponential_(generator=self.generator)
        for row, generator in batch.generators.items():
            noise[row].exponential_(generator=generator)
        return broadcast_from_first(torch.where(batch.greedy, greedy, (q / noise).argmax(dim=-1))), q

    def capture_cuda_graphs(self, graph_runner_class, sizes: list[int]) -> None:
        """Capture the draft's forward + LM head for these token counts (its caches bound);
        graph_runner_class: runner/cuda_graph.CUDAGraphRunner."""
        self.graph_runner = graph_runner_class(self.model, self.model.lm_head.logits_into, self.model.config.vocab_size,
                                               self.dtype, sizes, self.max_blocks_per_seq, self.device)
        self.graph_runner.capture()

    def _forward(self, block_tables: np.ndarray, computed: np.ndarray, num_new: np.ndarray,
                 input_ids: torch.Tensor, last_rows: np.ndarray, depth: int) -> torch.Tensor:
        """Logits after the last token of each sequence in last_rows. Up to the largest captured
        size, the tokens run as one decode each (build_metadata's per_token) in a CUDA graph
        (with DP attention: the agreed pass of this depth says which)."""
        layout = batch_layout(block_tables, computed, num_new, self.block_size)
        positions = to_device(torch.from_numpy(layout.positions), self.device)
        last = to_device(torch.from_numpy(layout.query_start[1:][last_rows] - 1), self.device)
        agreed = self._agreed(depth)
        graph_size = self._graph_size(len(layout.positions), depth) if agreed is None else agreed.graph_size
        if graph_size is not None:
            metadata = build_metadata(layout, block_tables, self.device, per_token=True)
            return self.graph_runner.run(input_ids, positions, metadata, size=graph_size)[last].float()
        metadata = build_metadata(layout, block_tables, self.device)
        with forward_context(metadata, None if agreed is None else agreed.padded_tokens):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden[last])

    def _block_tables(self, requests: list[Request]) -> np.ndarray:
        tables = np.zeros((len(requests), self.max_blocks_per_seq), dtype=np.int32)
        for i, request in enumerate(requests):
            tables[i, :len(request.block_ids)] = request.block_ids
        return tables

    def _narrow(self, index: torch.Tensor) -> None:
        """Fewer requests draft further: keep the state of these rows (none kept here)."""

    def _plan_catch_up(self, all_requests: list[Request], drafting: list[int]) -> CatchUp | None:
        """The drafting requests' unseen tokens, at most about one step budget of them per call (a
        long prompt or a preempted request catches up over several steps and drafts once it has)."""
        requests = [all_requests[i] for i in drafting]
        if not requests:
            return None
        done = np.zeros(len(requests), dtype=np.int64)
        for i, request in enumerate(requests):
            seen, preemptions = self.num_computed.get(request.request_id, (0, -1))
            done[i] = seen if preemptions == request.num_preemptions else 0
        total = np.fromiter((len(r.all_token_ids) for r in requests), dtype=np.int64, count=len(requests))
        done = np.minimum(done, total - 1)  # the newest token is always run: its logits give the first draft
        left = total - done
        # Chunks in request order within the budget; every request advances at least one token.
        num_new = np.minimum(left, np.maximum(self.chunk_tokens - np.concatenate(([0], np.cumsum(left)[:-1])), 1))
        input_ids = np.concatenate([r.all_token_ids[d:d + n] for r, d, n in zip(requests, done, num_new)])
        finished = np.flatnonzero(done + num_new == total)
        return CatchUp(requests, done, num_new, input_ids.astype(np.int64), finished,
                       [drafting[j] for j in finished])

    def _run_catch_up(self, plan: CatchUp) -> torch.Tensor:
        """-> the logits after the last token of each request ready to draft [len(plan.ready), vocab]."""
        logits = self._forward(self._block_tables(plan.requests), plan.computed, plan.num_new,
                               to_device(torch.from_numpy(plan.input_ids), self.device), plan.last_rows, 0)
        for request, seen in zip(plan.requests, (plan.computed + plan.num_new).tolist()):
            self.num_computed[request.request_id] = (seen, request.num_preemptions)
        return logits

    def _decode(self, requests: list[Request], tokens: torch.Tensor, step: int) -> torch.Tensor:
        """One draft token per request, at position len(all_token_ids) - 1 + step."""
        tables = self._block_tables(requests)
        computed = np.fromiter((len(r.all_token_ids) - 1 + step for r in requests), dtype=np.int64,
                               count=len(requests))
        return self._forward(tables, computed, np.ones(len(requests), dtype=np.int64), tokens,
                             np.arange(len(requests)), step)


def _select_rows(batch: SamplingBatch | None, rows: list[int], requests: list[Request],
                 device: torch.device) -> SamplingBatch | None:
    """The sampling parameters of some rows of a batch (requests: theirs); None stays None (a
    rank > 0, which does not sample)."""
    if batch is None:
        return None
    index = to_device(torch.tensor(rows), device)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[index]

    position = {row: j for j, row in enumerate(rows)}
    return SamplingBatch(
        temperature=take(batch.temperature), greedy=take(batch.greedy),
        all_greedy=all(r.sampling_params.is_greedy for r in requests),
        top_k=take(batch.top_k), top_p=take(batch.top_p), min_p=take(batch.min_p),
        generators={position[r]: g for r, g in batch.generators.items() if r in position},
        penalties=None, banned=None, num_logprobs=None)
