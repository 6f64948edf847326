"""ProposePlan: what the other tensor-parallel ranks need to draft alongside rank 0.

A draft model, an EAGLE-3 head or DeepSeek's MTP layers are sharded over the ranks like the target,
so every rank runs each draft forward pass (their collectives must meet). Only rank 0 knows the
requests; before each `propose` it sends this message, from which every other rank rebuilds the
same requests as far as a proposer reads them (tokens, cached count, blocks, preemptions, greedy or
not) and runs the proposer's own code on them: its host decisions come out the same, so its
forward passes and collectives do too. The drafts a step samples reach the other ranks over the
device (`broadcast_from_first`), as the target's sampled ids do.

Tokens travel once: each plan carries only the tokens a request gained since the last plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from baryon.request import Request


@dataclass
class DraftRequest:
    """A request as a rank > 0 knows it, with the fields the proposers read."""

    request_id: str
    greedy: bool
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)

    @property
    def sampling_params(self) -> DraftRequest:  # proposers ask `request.sampling_params.is_greedy`
        return self

    @property
    def is_greedy(self) -> bool:
        return self.greedy


class ProposePlan(msgspec.Struct, array_like=True):
    request_ids: list[str]
    new_tokens: list[list[int]]  # per request, the tokens it gained since the last plan
    num_computed: list[int]
    num_preemptions: list[int]
    block_ids: list[list[int]]
    greedy: list[bool]
    max_drafts: list[int]
    forgotten: list[str]  # requests that ended since the last plan
    # A hidden-state draft's view of the last step: request id -> (first flat token, computed before).
    rows: dict[str, tuple[int, int]]

    def encode(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ProposePlan:
        return _decoder.decode(data)


class ProposeSender:
    """Rank 0's side: builds each plan from the requests, remembering what each rank has seen."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # request id -> tokens already sent
        self.forgotten: list[str] = []

    def forget(self, request_id: str) -> None:
        if self.sent.pop(request_id, None) is not None:
            self.forgotten.append(request_id)

    def plan(self, requests: list[Request], max_drafts: list[int], rows: dict[str, tuple[int, int]]) -> ProposePlan:
        new_tokens = []
        for request in requests:
            sent = self.sent.get(request.request_id, 0)
            new_tokens.append(list(request.all_token_ids[sent:]))
            self.sent[request.request_id] = len(request.all_token_ids)
        plan = ProposePlan(
            request_ids=[r.request_id for r in requests], new_tokens=new_tokens,
            num_computed=[r.num_computed_tokens for r in requests],
            num_preemptions=[r.num_preemptions for r in requests],
            block_ids=[list(r.block_ids) for r in requests],
            greedy=[r.sampling_params.is_greedy for r in requests], max_drafts=list(max_drafts),
            forgotten=self.forgotten, rows=dict(rows))
        self.forgotten = []
        return plan


class ProposeReceiver:
    """A rank > 0's side: the requests rebuilt from the plans."""

    def __init__(self) -> None:
        self.requests: dict[str, DraftRequest] = {}

    def apply(self, plan: ProposePlan) -> tuple[list[DraftRequest], list[str]]:
        """-> (the plan's requests, in order; the ids of requests that ended, to forget)."""
        for request_id in plan.forgotten:
            self.requests.pop(request_id, None)
        requests = []
        for i, request_id in enumerate(plan.request_ids):
            request = self.requests.get(request_id)
            if request is None:
                request = self.requests[request_id] = DraftRequest(request_id, plan.greedy[i])
            request.all_token_ids.extend(plan.new_tokens[i])
            request.num_computed_tokens = plan.num_computed[i]
            request.num_preemptions = plan.num_preemptions[i]
            request.block_ids = plan.block_ids[i]
            requests.append(request)
        return requests, list(plan.forgotten)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ProposePlan)
