"""The scheduler: which requests advance this step, and by how many tokens.

One step has a token budget (`max_num_batched_tokens`). Running requests go first, oldest first:
a decode takes one token, a prefill takes what is left of its prompt or of the budget (chunked
prefill), so decodes and prefill chunks share a step. When the KV blocks run out, the newest
running request is preempted: its blocks (and a hybrid model's recurrent-state slot) are freed
and it goes back to the front of the waiting queue, to be recomputed later (its prefix may still
be in the prefix cache). Waiting requests are admitted in arrival order while budget, blocks and
`max_num_seqs` allow (one whose grammar is still compiling is passed over), and none while a
preemption happened in the step; an admitted request of a hybrid model takes a state slot.

With speculative decoding a decoding request also computes its draft tokens (`spec_token_ids`,
trimmed to the budget), and gets KV slots `num_lookahead_slots` past them, where a draft model's
own steps write; the engine rolls back the rejected ones (`num_computed_tokens`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from baryon.config import SchedulerConfig
from baryon.engine.kv_cache import BlockManager
from baryon.engine.state_slots import StateSlots
from baryon.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # (request, number of new tokens to compute this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_lookahead_slots: int = 0,
                 state_slots: StateSlots | None = None) -> None:
        self.max_num_seqs = config.max_num_seqs
        # A hybrid model's recurrent-state slots (one per running request); None: the model has none.
        self.state_slots = state_slots
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.num_lookahead_slots = num_lookahead_slots
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending_tokens and request.num_output_tokens + 1 >= request.max_tokens:
                i += 1  # its pending token is its last: it finishes when that step is read back
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.spec_token_ids:  # a decode (the proposer drafts for those only) + its drafts
                del request.spec_token_ids[budget - num_new:]
                num_new += len(request.spec_token_ids)
            while not self.block_manager.allocate(request, num_new + self._lookahead(request, num_new)):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append((request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in arrival order, passing over those whose grammar is still
        compiling (structured outputs): only they wait for it."""
        block_size = self.block_manager.block_size
        position = 0
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[position]
            if request.grammar is not None and not request.grammar.ready():
                position += 1
                continue
            cached_blocks = self.block_manager.find_cached_prefix(request)
            num_cached = len(cached_blocks) * block_size
            num_new = min(request.num_tokens - num_cached, budget)
            lookahead = self._lookahead(request, num_cached + num_new)
            if not self.block_manager.allocate(request, num_new + lookahead, cached_blocks):
                return
            del self.waiting[position]
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if self.state_slots is not None:
                self.state_slots.take(request)
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past this step's tokens for the draft model's steps (none past max_model_len)."""
        end = request.num_computed_tokens + num_new
        return max(min(self.num_lookahead_slots, self.max_model_len - end), 0)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.spec_token_ids.clear()
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) from the queues and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        self._release(request)
        request.status = status

    def _release(self, request: Request) -> None:
        self.block_manager.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)
