"""Scheduler with a real BlockManager, driven by a fake model loop that mimics EngineCore.

The fake model (`Sim`) does what EngineCore.step/_update do around the scheduler: it runs the
scheduled (request, num_new) pairs, then advances num_computed_tokens, registers full blocks in
the prefix cache, appends a random token when a request has computed all its tokens, and finishes
a request once it has its (random) number of output tokens. It also keeps the token held by
every KV slot, and checks on every step that each request's context reads back its own tokens
(so a wrong prefix hit, a shared block being written, or a recompute that skipped tokens fails).

Every step is checked against the scheduling rules: the token budget, max_num_seqs, running
requests first (oldest first, chunked prefill, decodes of one token), preemption of the newest,
FIFO admission that stops only for a reason, no admission in a step that preempted, and the
oldest unfinished request always advancing (which bounds the steps to completion).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baryon.config import SchedulerConfig
from baryon.engine.kv_cache import BlockManager
from baryon.engine.scheduler import Scheduler
from baryon.request import Request, RequestStatus
from baryon.sampling_params import SamplingParams


def make_request(rid, prompt, num_outputs: int, **params) -> Request:
    return Request(str(rid), list(prompt), SamplingParams(max_tokens=num_outputs, **params),
                   eos_token_ids=frozenset(), max_tokens=num_outputs)


class Sim:
    def __init__(self, max_num_seqs, max_num_batched_tokens, num_blocks, block_size,
                 prefix_caching, rng: random.Random, max_model_len: int = 4096):
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len)
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.config, self.bm)
        self.rng = rng
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.arrival: dict[str, int] = {}  # request id -> order of add()
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.admission_order: list[str] = []  # first admission of each request
        self.num_steps = 0
        self.num_preemptions = 0
        self.log: list[list[tuple[str, int]]] = []  # scheduled (id, num_new) per step
        self.preempted_log: list[list[str]] = []
        self.readmissions: list[tuple[Request, int, int]] = []  # (request, num_computed, num_new)

    # -- requests ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.arrival[request.request_id] = len(self.arrival)
        self.requests[request.request_id] = request
        self.sched.add(request)
        assert request.status == RequestStatus.WAITING

    def abort(self, request: Request) -> None:
        """EngineCore.abort_requests."""
        self.sched.finish(request, RequestStatus.FINISHED_ABORTED)
        assert request.block_ids == []
        assert request not in self.sched.running and request not in self.sched.waiting
        del self.requests[request.request_id]
        self.finished.append(request)

    def unfinished(self) -> list[Request]:
        return list(self.sched.running) + list(self.sched.waiting)

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[tuple[Request, int]]:
        sched, bm, cfg = self.sched, self.bm, self.config
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        computed_before = {r.request_id: r.num_computed_tokens for r in running_before}
        preemptions_before = {r.request_id: r.num_preemptions for r in running_before}
        oldest = min(running_before + waiting_before, key=lambda r: self.arrival[r.request_id], default=None)

        out = sched.schedule()
        scheduled = out.scheduled
        self.num_steps += 1
        self.log.append([(r.request_id, n) for r, n in scheduled])
        self.preempted_log.append([r.request_id for r in out.preempted])

        # Budget, batch size, one entry per request.
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert all(n >= 1 for _, n in scheduled)
        assert len({r.request_id for r, _ in scheduled}) == len(scheduled)
        assert len(sched.running) <= cfg.max_num_seqs

        # Preemption takes the newest running requests, newest first, and puts them back at the
        # front of the waiting queue, in arrival order, with nothing computed and no blocks.
        p = len(out.preempted)
        assert out.preempted == list(reversed(running_before[len(running_before) - p:]))
        for r in out.preempted:
            assert r.num_computed_tokens == 0 and r.block_ids == []
            assert r.status == RequestStatus.PREEMPTED
            assert r.num_preemptions == preemptions_before[r.request_id] + 1
        self.num_preemptions += p
        kept = running_before[:len(running_before) - p]

        # Running requests first, oldest first; then admissions from the head of the waiting
        # queue, in order; none at all in a step that preempted.
        k = 0
        while k < len(scheduled) and scheduled[k][0].request_id in computed_before:
            k += 1
        assert [r for r, _ in scheduled[:k]] == kept[:k]
        admitted = [r for r, _ in scheduled[k:]]
        m = len(admitted)
        assert admitted == waiting_before[:m]
        if p:
            assert m == 0, "admitted a waiting request in a step that preempted"

        # Chunk sizes: each request takes what it has left or what is left of the budget.
        budget = cfg.max_num_batched_tokens
        for r, n in scheduled[:k]:
            assert n == min(r.num_tokens - computed_before[r.request_id], budget)
            budget -= n
        if k < len(kept):
            assert budget == 0, "a running request was skipped with budget left"
        for r, n in scheduled[k:]:
            assert r.status == RequestStatus.RUNNING
            assert r.num_computed_tokens % bm.block_size == 0
            assert r.num_computed_tokens <= r.num_tokens - 1  # the last token is always computed
            if not bm.enable_prefix_caching:
                assert r.num_computed_tokens == 0
            assert n == min(r.num_tokens - r.num_computed_tokens, budget)
            budget -= n
            if r.num_preemptions:
                self.readmissions.append((r, r.num_computed_tokens, n))
            else:
                assert r.request_id not in self.admission_order
                self.admission_order.append(r.request_id)
        assert sched.running == kept + admitted
        assert list(sched.waiting) == running_before[len(running_before) - p:] + waiting_before[m:]

        # Admission stops only for a reason: no budget, no room for a sequence, or no blocks.
        if not p and m < len(waiting_before) and budget > 0 and len(sched.running) < cfg.max_num_seqs:
            head = waiting_before[m]
            hits = bm.find_cached_prefix(head)
            num_new = min(head.num_tokens - len(hits) * bm.block_size, budget)
            needed = bm.blocks_needed(len(hits) * bm.block_size + num_new) - len(hits)
            free_hits = sum(bm.blocks[b].ref_count == 0 for b in hits)
            assert needed > bm.num_free_blocks - free_hits, (
                f"request {head.request_id} could have been admitted: needs {needed} blocks, "
                f"{bm.num_free_blocks - free_hits} free")

        # The oldest unfinished request always advances: no starvation.
        if oldest is not None:
            assert oldest in [r for r, _ in scheduled], f"oldest request {oldest.request_id} did not advance"

        # Arrival order is kept: running oldest first, waiting oldest first, and every running
        # request arrived before every waiting one.
        run_order = [self.arrival[r.request_id] for r in sched.running]
        wait_order = [self.arrival[r.request_id] for r in sched.waiting]
        assert run_order == sorted(run_order) and wait_order == sorted(wait_order)
        if run_order and wait_order:
            assert run_order[-1] < wait_order[0]

        self._check_blocks()
        self._execute(scheduled)
        self._update(scheduled)
        self._check_blocks()
        return scheduled

    def _execute(self, scheduled) -> None:
        """The model: read each request's context from its blocks, write the new tokens' K/V."""
        bs = self.bm.block_size
        for r, n in scheduled:
            start = r.num_computed_tokens
            assert n <= r.num_tokens - start
            assert len(r.block_ids) * bs >= start + n, "too few blocks for the step"
            for pos in range(start):
                block_id = r.block_ids[pos // bs]
                assert self.kv[block_id][pos % bs] == r.all_token_ids[pos], (
                    f"request {r.request_id} position {pos}: block {block_id} holds "
                    f"{self.kv[block_id][pos % bs]}, expected {r.all_token_ids[pos]}")
        for r, n in scheduled:
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                block = self.bm.blocks[r.block_ids[pos // bs]]
                assert block.ref_count == 1, f"block {block.block_id} written while shared"
                assert block.block_hash is None, f"cached block {block.block_id} overwritten"
                self.kv[block.block_id][pos % bs] = r.all_token_ids[pos]

    def _update(self, scheduled) -> None:
        """EngineCore._update."""
        for r, n in scheduled:
            r.num_computed_tokens += n
            self.bm.cache_full_blocks(r)
            if r.num_computed_tokens != r.num_tokens:
                continue  # a prefill chunk: no token yet
            r.append_output_token(self.rng.randrange(8))
            if r.num_output_tokens >= r.max_tokens:
                self.sched.finish(r, RequestStatus.FINISHED_LENGTH)
                assert r.block_ids == [] and r.status == RequestStatus.FINISHED_LENGTH
                del self.requests[r.request_id]
                self.finished.append(r)

    def _check_blocks(self) -> None:
        bm = self.bm
        holders: dict[int, int] = {}
        for r in self.sched.running:
            assert len(set(r.block_ids)) == len(r.block_ids)
            for b in r.block_ids:
                holders[b] = holders.get(b, 0) + 1
        for r in self.sched.waiting:
            assert r.block_ids == [], f"waiting request {r.request_id} holds blocks"
        for block in bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0) >= 0
            assert (block.block_id in bm.free_queue) == (block.ref_count == 0)
        assert bm.cached == {b.block_hash: b.block_id for b in bm.blocks if b.block_hash is not None}

    def run(self, arrivals: list[tuple[int, Request]], max_steps: int, abort_prob: float = 0.0) -> None:
        """Add each request at its arrival step and step until all are done (at most max_steps)."""
        pending = sorted(arrivals, key=lambda a: a[0])
        step = 0
        while pending or self.sched.num_unfinished:
            while pending and pending[0][0] <= step:
                self.add(pending.pop(0)[1])
            if abort_prob and self.unfinished() and self.rng.random() < abort_prob:
                self.abort(self.rng.choice(self.unfinished()))
            if self.sched.num_unfinished:
                assert self.step(), "a step with unfinished requests scheduled nothing"
            step += 1
            assert step <= max_steps, f"requests still unfinished after {max_steps} steps"

    def check_all_done(self) -> None:
        assert self.sched.running == [] and list(self.sched.waiting) == []
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        for r in self.finished:
            assert r.block_ids == []
            if r.status == RequestStatus.FINISHED_LENGTH:
                assert r.num_output_tokens == r.max_tokens
                assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids


def fits_alone(prompt_len: int, num_outputs: int, block_size: int) -> int:
    """Blocks a request needs at its largest step (its last output token is never computed)."""
    return -(-(prompt_len + num_outputs - 1) // block_size)


# -- deterministic scenarios ---------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt():
    sim = Sim(4, 32, num_blocks=64, block_size=4, prefix_caching=False, rng=random.Random(0))
    r = make_request("long", range(100), 3)
    sim.add(r)
    sizes = []
    while sim.sched.num_unfinished:
        ((req, n),) = sim.step()
        assert req is r
        sizes.append(n)
        # No token is sampled until the whole prompt is in the cache.
        assert r.num_output_tokens == (0 if r.num_computed_tokens < 100 else r.num_computed_tokens - 99)
    assert sizes == [32, 32, 32, 4, 1, 1]
    assert r.num_output_tokens == 3
    sim.check_all_done()


def test_decodes_go_before_new_prefills_and_share_the_budget():
    sim = Sim(4, 16, num_blocks=64, block_size=4, prefix_caching=False, rng=random.Random(0))
    a = make_request("a", range(5), 10)
    sim.add(a)
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 5)]
    b = make_request("b", range(50), 2)
    sim.add(b)
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 15)]
    c = make_request("c", range(7), 2)
    sim.add(c)
    # b's prefill chunk is a running request's work: it goes before c's admission.
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 15)]
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 15)]
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 5), ("c", 7)]
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 1), ("c", 1)]
    sim.run([], max_steps=50)
    sim.check_all_done()


def test_a_full_budget_of_decodes_keeps_prefills_out():
    sim = Sim(8, 2, num_blocks=64, block_size=2, prefix_caching=False, rng=random.Random(0))
    a, b, c = make_request("a", [1], 4), make_request("b", [2], 4), make_request("c", [3], 1)
    for r in (a, b, c):
        sim.add(r)
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 1)]
    for _ in range(3):  # a and b decode with the whole budget; c waits
        assert list(sim.sched.waiting) == [c]
        assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 1)]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert [(r.request_id, n) for r, n in sim.step()] == [("c", 1)]
    sim.check_all_done()


def test_max_num_seqs_caps_running_and_admits_in_fifo_order():
    sim = Sim(2, 1000, num_blocks=100, block_size=4, prefix_caching=False, rng=random.Random(0))
    reqs = [make_request(i, range(3 + i), 2 + i % 3) for i in range(6)]
    for r in reqs:
        sim.add(r)
    sim.step()
    assert sim.sched.running == reqs[:2]
    sim.run([], max_steps=100)
    assert sim.admission_order == [r.request_id for r in reqs]
    sim.check_all_done()


def test_a_blocked_head_of_queue_is_not_overtaken():
    sim = Sim(8, 1000, num_blocks=10, block_size=1, prefix_caching=False, rng=random.Random(0))
    r0 = make_request("r0", range(6), 4)
    sim.add(r0)
    sim.step()  # r0 holds 6 blocks
    big, small = make_request("big", range(8), 1), make_request("small", [1], 1)
    sim.add(big)
    sim.add(small)
    # r0 takes a 7th block; big needs 8 of the 3 left; small would fit but must wait its turn.
    assert [(r.request_id, n) for r, n in sim.step()] == [("r0", 1)]
    assert list(sim.sched.waiting) == [big, small]
    sim.run([], max_steps=30)
    assert sim.admission_order == ["r0", "big", "small"]
    sim.check_all_done()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_frees_the_newest_and_recomputes_it(prefix_caching):
    # 4 blocks of 2: two requests of 3 prompt tokens fit until they outgrow 2 blocks each.
    sim = Sim(4, 64, num_blocks=4, block_size=2, prefix_caching=prefix_caching, rng=random.Random(0))
    a, b = make_request("a", [1, 2, 3], 4), make_request("b", [4, 5, 6], 4)
    sim.add(a)
    sim.add(b)
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 3), ("b", 3)]
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 1)]
    b_outputs = list(b.output_token_ids)
    assert len(b_outputs) == 2 and b.num_computed_tokens == 4 and len(b.block_ids) == 2
    c = make_request("c", [7], 1)  # would fit in the block the preemption frees
    sim.add(c)
    # a's 5th token needs a 3rd block: b (the newest) is preempted, and nothing is admitted.
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1)]
    assert sim.preempted_log[-1] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_ids == []
    assert list(sim.sched.waiting) == [b, c]
    assert b.output_token_ids == b_outputs  # generated tokens survive the preemption
    sim.run([], max_steps=40)
    sim.check_all_done()
    assert b.num_output_tokens == 4 and b.output_token_ids[:2] == b_outputs
    ((req, computed, n),) = sim.readmissions
    assert req is b
    # b comes back with its prompt and its 2 outputs (5 tokens) to compute, less what the
    # prefix cache still holds of it.
    assert computed + n == 5
    if prefix_caching:
        assert computed > 0 and computed % 2 == 0
    else:
        assert computed == 0
    assert sim.admission_order == ["a", "b", "c"]


def test_no_admission_in_a_step_that_preempted_even_with_room():
    # 3 one-token blocks, budget 2: the preempted request's freed block and the budget it leaves
    # would let its first recompute chunk in at once; it must wait for the next step.
    sim = Sim(4, 2, num_blocks=3, block_size=1, prefix_caching=False, rng=random.Random(0))
    a, b = make_request("a", [1], 3), make_request("b", [2], 3)
    sim.add(a)
    sim.add(b)
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1), ("b", 1)]
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1)]
    assert sim.preempted_log[-1] == ["b"] and sim.bm.num_free_blocks == 1
    assert [(r.request_id, n) for r, n in sim.step()] == [("a", 1)]  # a finishes; b had no room
    # b recomputes its prompt and its first output together.
    assert [(r.request_id, n) for r, n in sim.step()] == [("b", 2)]
    sim.run([], max_steps=10)
    sim.check_all_done()
    assert sim.readmissions == [(b, 0, 2)]


def test_preemption_with_tiny_cache_still_finishes_everything():
    rng = random.Random(1234)
    sim = Sim(8, 16, num_blocks=6, block_size=2, prefix_caching=True, rng=rng)
    arrivals = [(0, make_request(i, [rng.randrange(3) for _ in range(rng.randint(1, 6))], rng.randint(3, 6)))
                for i in range(10)]
    bound = sum(r.num_prompt_tokens + r.max_tokens for _, r in arrivals) + 1
    sim.run(arrivals, max_steps=bound)
    sim.check_all_done()
    assert sim.num_preemptions > 0
    assert sim.admission_order == [str(i) for i in range(10)]
    assert len(sim.finished) == 10


def test_finish_removes_waiting_preempted_and_running_requests():
    sim = Sim(4, 64, num_blocks=4, block_size=2, prefix_caching=False, rng=random.Random(0))
    a, b, c = make_request("a", [1, 2, 3], 8), make_request("b", [4, 5, 6], 8), make_request("c", [1], 1)
    for r in (a, b):
        sim.add(r)
    sim.step()
    sim.step()
    sim.add(c)
    sim.step()  # b is preempted
    assert b.status == RequestStatus.PREEMPTED
    sim.abort(b)
    assert b.status == RequestStatus.FINISHED_ABORTED and list(sim.sched.waiting) == [c]
    sim.abort(c)
    sim.sched.finish(c, RequestStatus.FINISHED_ABORTED)  # a second abort changes nothing
    assert list(sim.sched.waiting) == []
    sim.abort(a)
    assert sim.sched.num_unfinished == 0
    sim.check_all_done()


# -- random workloads ----------------------------------------------------------------------------


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 8))
    vocab = draw(st.integers(1, 4))  # small vocabularies make shared prefixes common
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=40, max_size=40))
    requests = []
    for i in range(n):
        length = draw(st.integers(1, 40))
        prompt = base[:length] if draw(st.booleans()) else draw(
            st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length))
        num_outputs = draw(st.integers(1, 10))
        arrival = draw(st.integers(0, 12))
        logprobs = 1 if draw(st.integers(0, 9)) == 0 else None
        requests.append((arrival, make_request(i, prompt, num_outputs, prompt_logprobs=logprobs)))
    largest = max(fits_alone(r.num_prompt_tokens, r.max_tokens, block_size) for _, r in requests)
    # Often just enough for the largest request alone, so preemption is common.
    num_blocks = largest + draw(st.one_of(st.integers(0, 2), st.integers(0, 3 * largest)))
    return dict(
        block_size=block_size, requests=requests, num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 48)),
        prefix_caching=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)),
    )


@given(workloads())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_workloads_respect_every_rule_and_finish(w):
    sim = Sim(w["max_num_seqs"], w["max_num_batched_tokens"], w["num_blocks"], w["block_size"],
              w["prefix_caching"], random.Random(w["seed"]))
    arrivals = w["requests"]
    # The oldest unfinished request advances every step, so each request is the oldest for at
    # most (its tokens) steps: that bounds the whole run.
    bound = max(a for a, _ in arrivals) + sum(r.num_prompt_tokens + r.max_tokens for _, r in arrivals) + 1
    sim.run(arrivals, max_steps=bound)
    sim.check_all_done()
    assert len(sim.finished) == len(arrivals)
    # Admission in arrival order (ties in arrival step: in order of add()).
    assert sim.admission_order == sorted(sim.arrival, key=sim.arrival.get)
    for r, computed, n in sim.readmissions:
        assert computed == 0 or w["prefix_caching"]


def test_preemption_is_exercised_by_tight_random_workloads(seed):
    """Many requests in a cache that holds about one of them: preemption must happen, and
    everything still finishes in FIFO order with every block returned."""
    rng = random.Random(seed)
    total_preemptions = 0
    for _ in range(15):
        bs = rng.choice([1, 2, 4])
        base = [rng.randrange(3) for _ in range(48)]
        arrivals = []
        for i in range(rng.randint(4, 12)):
            length = rng.randint(1, 48)
            prompt = base[:length] if rng.random() < 0.5 else [rng.randrange(3) for _ in range(length)]
            arrivals.append((rng.randint(0, 5), make_request(i, prompt, rng.randint(2, 12))))
        largest = max(fits_alone(r.num_prompt_tokens, r.max_tokens, bs) for _, r in arrivals)
        sim = Sim(rng.randint(2, 8), rng.randint(8, 64), num_blocks=largest + rng.randint(0, 2),
                  block_size=bs, prefix_caching=rng.random() < 0.5, rng=rng)
        bound = 6 + sum(r.num_prompt_tokens + r.max_tokens for _, r in arrivals) + 1
        sim.run(arrivals, max_steps=bound)
        sim.check_all_done()
        assert sim.admission_order == sorted(sim.arrival, key=sim.arrival.get)
        total_preemptions += sim.num_preemptions
        for r, computed, n in sim.readmissions:
            assert r.num_preemptions >= 1
    assert total_preemptions > 0


def test_random_workloads_with_aborts(seed):
    """Aborts (of waiting, preempted and running requests) between steps, as the frontend does:
    the rules still hold and no block leaks."""
    rng = random.Random(seed)
    for _ in range(25):
        bs = rng.choice([1, 2, 4])
        arrivals = []
        for i in range(rng.randint(1, 10)):
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
            arrivals.append((rng.randint(0, 8), make_request(i, prompt, rng.randint(1, 10))))
        largest = max(fits_alone(r.num_prompt_tokens, r.max_tokens, bs) for _, r in arrivals)
        sim = Sim(rng.randint(1, 6), rng.randint(1, 40), num_blocks=largest + rng.randint(0, 10),
                  block_size=bs, prefix_caching=rng.random() < 0.7, rng=rng)
        bound = 9 + sum(r.num_prompt_tokens + r.max_tokens for _, r in arrivals) + 1
        sim.run(arrivals, max_steps=bound, abort_prob=0.1)
        sim.check_all_done()
        assert len(sim.finished) == len(arrivals)
