"""StepPlan: one step's forward-pass inputs as host arrays.

Rank 0 builds it from the scheduled requests; with tensor parallelism it is also the message
every other rank receives (a few small arrays, encoded once with msgspec), so that all ranks run
the same forward pass, collectives in the same order. Only rank 0 knows the requests: it samples,
and the ids it sampled reach the other ranks over the device (`broadcast_from_first`), where a
pending token's slot of the next step's `input_ids` reads them; a step whose rows all take the
argmax (`argmax_only`) finds the same ids on every rank instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

_ARRAYS = ("input_ids", "num_computed", "num_new", "block_tables", "state_slots", "drafts", "rope_positions",
           "pending_index", "pending_source", "logit_rows")


@dataclass
class StepPlan:
    input_ids: np.ndarray  # [num_tokens] int64; a pending token's slot holds 0 until filled on the device
    num_computed: np.ndarray  # [num_seqs] int64: tokens already in the cache
    num_new: np.ndarray  # [num_seqs] int64: tokens computed this step
    block_tables: np.ndarray  # [num_seqs, width] int32, width: the longest table this step
    state_slots: np.ndarray  # [num_seqs] int32: recurrent-state slots (hybrid models; else all -1)
    # [3, num_seqs] int32: a hybrid model's DraftRows (speculative decoding; else [3, 0])
    drafts: np.ndarray
    # [num_tokens] int64: RoPE positions where image requests shift them (multimodal RoPE); empty:
    # every token's RoPE position is its cache position
    rope_positions: np.ndarray
    pending_index: np.ndarray  # [p] int64: token indices whose id the previous step sampled ...
    pending_source: np.ndarray  # [p] int64: ... at these rows of its sampled ids
    logit_rows: np.ndarray  # [r] int64: token indices whose logits are computed (sampled rows first)
    num_sampled_rows: int  # the first rows of logit_rows that are sampled (or verified)
    num_sampling: int  # requests that get new tokens: the length of the sampled ids rank 0 broadcasts
    per_token: bool  # a verification step run as one decode per token
    # Every sampled row takes its logits' argmax (runner's _takes_argmax): a decode graph's step
    # then finds the tokens on every rank from its vocabulary slice (ParallelLMHead.argmax), with
    # no sampling on rank 0 and no broadcast of the ids.
    argmax_only: bool
    # (image tokens, DeepStack layers) of the step's MultiModalStep, whose tensors rank 0 broadcasts
    # right after the plan (runner/image_inputs.py); None: the step computes no image prompt's tokens
    image_step: tuple[int, int] | None = None

    def encode(self) -> bytes:
        arrays = [_WireArray(str(a.dtype), list(a.shape), a.tobytes()) for a in (getattr(self, n) for n in _ARRAYS)]
        return _encoder.encode(_WirePlan(arrays, self.num_sampled_rows, self.num_sampling, self.per_token,
                                         self.argmax_only, self.image_step))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> StepPlan:
        wire = _decoder.decode(data)
        arrays = {name: np.frombuffer(a.data, dtype=a.dtype).reshape(a.shape).copy()  # writable
                  for name, a in zip(_ARRAYS, wire.arrays)}
        return cls(**arrays, num_sampled_rows=wire.num_sampled_rows, num_sampling=wire.num_sampling,
                   per_token=wire.per_token, argmax_only=wire.argmax_only, image_step=wire.image_step)


class _WireArray(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    data: bytes


class _WirePlan(msgspec.Struct, array_like=True):
    arrays: list[_WireArray]
    num_sampled_rows: int
    num_sampling: int
    per_token: bool
    argmax_only: bool
    image_step: tuple[int, int] | None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_WirePlan)
