"""What the server and the engine-core process say to each other over ZMQ (msgspec, msgpack).

The server sends `AddRequests`, `AbortRequests` and `Shutdown`; the engine answers once with
`EngineReady` (or `EngineFailed` when it cannot start), then with one `EngineOutputs` per step
that changed something: the new tokens of each request (ids and logprobs only: text is the
server's job) and the engine's load, which feeds /metrics. A request the engine refuses comes
back in `EngineOutputs.rejected` with the reason.
"""

from __future__ import annotations

import msgspec

from baryon.engine.core import EngineCoreOutput
from baryon.multimodal.inputs import MultiModalInputs
from baryon.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct):
    """One engine-core request: one sample of a server request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    multimodal: MultiModalInputs | None = None  # the prompt's images


class AddRequests(msgspec.Struct, tag=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


ClientMessage = AddRequests | AbortRequests | Shutdown


class EngineStats(msgspec.Struct):
    """The engine's load after a step: engine-core requests (samples) and KV-cache blocks."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks: int = 0
    num_steps: int = 0  # steps launched since start
    # Speculative decoding totals since start (all 0 without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []


def total_stats(replicas: list[EngineStats]) -> EngineStats:
    """Several replicas' stats added up (counts and totals; the per-position acceptances position
    by position)."""
    if len(replicas) == 1:
        return replicas[0]
    total = EngineStats()
    for stats in replicas:
        for name in ("num_running", "num_waiting", "num_kv_blocks_used", "num_kv_blocks", "num_steps",
                     "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        per_position = stats.spec_accepted_per_position
        total.spec_accepted_per_position = [a + b for a, b in zip(total.spec_accepted_per_position, per_position)] \
            if total.spec_accepted_per_position else list(per_position)
    return total


class EngineReady(msgspec.Struct, tag=True):
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=True):
    message: str


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    rejected: dict[str, str] = {}  # engine-core request id -> why it was refused


EngineMessage = EngineReady | EngineFailed | EngineOutputs

encoder = msgspec.msgpack.Encoder()
client_message_decoder = msgspec.msgpack.Decoder(ClientMessage)
engine_message_decoder = msgspec.msgpack.Decoder(EngineMessage)
