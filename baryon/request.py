"""A request inside the engine core: its tokens, progress, cache blocks and sampled results.

A plain data type read by the engine (scheduler, block manager) and the runner alike.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from baryon.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baryon.multimodal.inputs import RequestImages
    from baryon.structured_output.matcher import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: SamplingParams.max_tokens or what the context leaves
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # prompt + generated tokens; the last one may not be in the KV cache yet.
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or queued to be)
    # 1 while a sampled token is still on the device (its step launched, not yet read back).
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first schedule
    block_ids: list[int] = field(default_factory=list)  # the KV blocks, in position order
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    generator: torch.Generator | None = None  # the request's own RNG when it has a seed
    # Draft tokens proposed to follow all_token_ids, verified by the next step (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    grammar: RequestGrammar | None = None  # structured outputs: the output's grammar state
    # Its recurrent state's slot in linear-attention layers (engine/state_slots.py); -1: none held.
    state_slot: int = -1
    # Its last verification's tokens in the slot's pending block (speculative decoding of a hybrid
    # model: metadata.DraftRows): (block, position of the first, count); None: nothing pending.
    pending_drafts: tuple[int, int, int] | None = None
    images: RequestImages | None = None  # the prompt's images (image-and-text models)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, the pending one included."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token (it replaces the pending one, if any)."""
        self.num_pending_tokens = max(self.num_pending_tokens - 1, 0)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_last_output_token(self) -> None:
        """Take back the last recorded token (one the output's grammar refused)."""
        self.output_token_ids.pop()
        self.all_token_ids.pop()

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
