"""The LM head of a checkpoint that quantized it (GPTQ `lm_head: true`, a compressed-tensors
checkpoint whose `ignore` list leaves `lm_head` out): a linear layer of this rank's vocabulary
slice, [rows_per_rank, hidden] in the checkpoint's layout, whose output is that slice of the
logits. It replaces the model's dense `ParallelLMHead` before the weights load (same name, so the
checkpoint's `lm_head.*` tensors land in it) and serves the same calls: gathering, greedy argmax.

The vocabulary is split over tensor-parallel ranks as the dense head splits it (ceil(vocab / N)
rows a rank, the last rank's rows past the vocabulary zero): each checkpoint tensor is padded
along its output dimension to N slices before the linear loader takes this rank's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.distributed.parallel_state import tp_rank, tp_world_size
from baryon.layers.embedding import VocabLogits
from baryon.layers.linear import LinearBase
from baryon.quantization.base import LinearMethod


class QuantizedLMHead(VocabLogits, LinearBase):
    def __init__(self, vocab_size: int, hidden_size: int, method: LinearMethod) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        super().__init__(hidden_size, self.rows_per_rank, bias=False)
        self.checkpoint_prefix = "lm_head"
        self.use_method(method)

    def shard_span(self, shard_id) -> tuple[int, int, int, int]:
        return 0, self.output_size, self.tp_rank, self.tp_size

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        dim = param.output_dim
        if dim is not None and self.tp_size > 1:  # the vocabulary padded to tp_size equal slices
            entries = -(-self.output_size // param.output_block)  # of this tensor along dim, per rank
            if self.output_size % param.output_block:
                raise ValueError(f"{self.rows_per_rank} vocabulary rows a rank do not align with this tensor's "
                                 f"{param.output_block}-row blocks; use a tensor-parallel size that divides the "
                                 f"vocabulary into multiples of {param.output_block}")
            missing = entries * self.tp_size - loaded.shape[dim]
            if missing > 0:
                pad = [0, 0] * (loaded.dim() - 1 - dim) + [0, missing]
                loaded = F.pad(loaded, pad)
        super().weight_loader(param, loaded, shard_id)

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden] -> this rank's vocabulary slice of the logits [n, rows_per_rank]."""
        return self.method.apply(self, hidden_states, None)

    def local_logits_into(self, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """As ParallelLMHead.local_logits_into (the target's decode graphs)."""
        out.copy_(self.local_logits(hidden_states))

    def logits_into(self, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """As ParallelLMHead.logits_into (a draft model's decode graphs)."""
        out.copy_(self.finished_logits(self._gathered(self.local_logits(hidden_states))))
